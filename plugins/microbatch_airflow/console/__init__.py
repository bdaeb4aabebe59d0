"""The checkpoint console: the pipelines' ledgers, lag, quarantine and state
versions in the Airflow UI, served by the API server under ``/microbatch``.

`LazyConsole` is what the plugin registers. Every Airflow component loads
plugins (scheduler, workers, dag-processor, triggerer), and only the API
server serves the console, so FastAPI and the auth code are imported on the
first request, not at plugin load.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONSOLE_PREFIX", "RUN_VIEW", "LazyConsole", "airflow_root"]

#: Where the API server mounts the console (the plugin's `url_prefix`).
CONSOLE_PREFIX = "/microbatch"
#: The console's tab on a DAG run's page in Airflow's UI (the plugin's
#: `external_views`): ``/dags/<dag>/runs/<run>/plugin/<RUN_VIEW>``.
RUN_VIEW = "microbatch-run"


class LazyConsole:
    """An ASGI app that builds the console's FastAPI app on its first call."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._app is None:
            from microbatch_airflow.console.app import create_app

            self._app = create_app()
        await self._app(scope, receive, send)


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
