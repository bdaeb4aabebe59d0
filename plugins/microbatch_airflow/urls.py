"""Where the console lives: its mount point, its tab on a DAG run's page,
and where it (and the task logs' links) reach Airflow's API server.

Below the console, the operators and their links alike, so that none of
them imports another for a name: `links` (imported by the operators, which
the DAG factory imports, which the console's app imports) used to import
the console's package for these.
"""

from __future__ import annotations

__all__ = ["CONSOLE_PREFIX", "RUN_VIEW", "airflow_root"]

#: Where the API server mounts the console (the plugin's `url_prefix`).
CONSOLE_PREFIX = "/microbatch"
#: The console's tab on a DAG run's page in Airflow's UI (the plugin's
#: `external_views`): ``/dags/<dag>/runs/<run>/plugin/<RUN_VIEW>``.
RUN_VIEW = "microbatch-run"


def airflow_root() -> str:
    """Where the console calls Airflow's REST API: `[api] base_url` when it is
    a URL, else the API server this app is mounted in, on this machine.

    Never from the request (its Host header): the call carries the caller's
    token, and a forged Host would send it, and the trigger, elsewhere. With
    TLS, set `[api] base_url` to the name the certificate holds: the
    certificate of `https://127.0.0.1` rarely does.
    """
    from airflow.configuration import conf

    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    if base.startswith(("http://", "https://")):
        return base
    host = conf.get("api", "host", fallback="") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):  # listening everywhere: loopback reaches it
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if conf.get("api", "ssl_cert", fallback="") else "http"
    return f"{scheme}://{host}:{conf.getint('api', 'port', fallback=8080)}{base}"
