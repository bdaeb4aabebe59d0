"""`make airflow`: a local Airflow on this machine, stopped whole by one Ctrl-C.

Its metadata lives in a PostgreSQL server of its own (dev/postgres.py), kept
with the Airflow home. Two profiles:

* ``local`` (the default): `airflow standalone`, with the LocalExecutor
  (standalone forces it, whatever it is told).
* ``celery``: the CeleryExecutor as production runs it, with a Redis broker
  of its own (dev/redis.py) and `--workers` Celery workers on this machine;
  the components (api-server, scheduler, dag-processor, triggerer) are
  started one by one, since standalone would not run Celery.

Either profile can share one Spark engine among its tasks (`--engine
connect`): a Spark Connect server of its own (pyspark's, with the project's
JAR set and Delta's SQL extension), which every task then uses as a thin
client (``MICROBATCH_SPARK_MASTER=sc://...``, under a spec's own
`engine.master` and a DAG's `spark_conn_id`): one JVM for the fleet
instead of one a task (docs/fleet.md says which to pick when).

One Ctrl-C (or TERM) stops everything. Each process runs in a session of
its own, and the stop signals whole sessions: Airflow's task supervisor puts
each task (and the Spark JVM it starts) in a process group of its own, which
a signal to the component's group misses, while the session holds them. A
running batch gets TERM and stops at its next protocol boundary; whatever
still runs after `--grace` seconds is killed, which the commit protocol is
built to survive. Then the engine, the broker and the database stop (the
database keeps its data; the broker keeps none: the scheduler queues again
what it does not see run).

    python -m dev.airflow HOME [--executor celery] [--workers 2] [--engine connect] [--grace 30]

The caller's environment carries the rest of Airflow's settings (the
Makefile's AIRFLOW_ENV: folders, port, auth).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dev.postgres import PostgresMissing, PostgresServer
from dev.redis import RedisMissing, RedisServer

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
#: Celery worker i serves its task logs on this port + i (8793 is Airflow's
#: default worker log port, 8794 the triggerer's): two workers on one host
#: cannot share one.
WORKER_LOG_PORT_BASE = 8794


def _say(message: str) -> None:
    print(message, flush=True)


def _api_url(env: dict[str, str]) -> str:
    return f"http://{env.get('AIRFLOW__API__HOST', '127.0.0.1')}:{env.get('AIRFLOW__API__PORT', '8080')}"


def _api_ready(env: dict[str, str]) -> bool:
    """Whether the UI answers (its health endpoint), asked once a half-second until it does."""
    try:
        with urllib.request.urlopen(f"{_api_url(env)}/api/v2/monitor/health", timeout=2) as answer:
            return answer.status == 200
    except (OSError, ValueError):
        return False


def _banner(env: dict[str, str], database: PostgresServer, grace: float) -> str:
    """What a user needs once the UI is up, set apart from the components'
    hundred lines: where, who, how to stop, where the data is."""
    url = _api_url(env)
    lines = [
        f"Airflow is ready: {url}/",
        f"  the pipelines' console: \"Batches\" in Airflow's navigation, or {url}/microbatch/",
        "  login: none; every visitor is an admin (SimpleAuthManager, all_admins): keep it on this machine",
        f"  stop: Ctrl-C once (a running batch stops at its next protocol boundary; whatever runs after {grace:.0f} s is killed)",
        f"  metadata: PostgreSQL in {database.folder}: kept across stops; deleting .airflow/ starts afresh",
    ]
    rule = "=" * max(len(line) for line in lines)
    return "\n".join([rule, *lines, rule])


def _sessions_alive(sessions: list[int]) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) in sessions:
            return True
    return False


def _signal_sessions(sessions: list[int], sig: int) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) in sessions:
                os.kill(int(pid), sig)
        except (OSError, ProcessLookupError):
            continue


def _start_connect(home: Path, port: int, java_options: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """A Spark Connect server on loopback in a session of its own; (it, its URL).
    The project's server (`spark_jobs.engine.connect_server`): its sessions
    share compiled code, and its JVM runs C1 alone; `java_options` are the
    user's (`spark.driver.extraJavaOptions`), which come after that."""
    import socket

    import pyspark

    from spark_jobs.engine import connect_server
    from spark_jobs.engine.session import DELTA_SQL, extra_jars

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            sys.exit(f"port {port} is taken (another Spark Connect server?): stop it, or pass CONNECT_PORT=<free port>")
    spark_home = Path(pyspark.__file__).resolve().parent
    folder = home / "spark-connect"
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.defaultJavaOptions": connect_server.JVM_OPTIONS,
        **({"spark.driver.extraJavaOptions": java_options} if java_options.strip() else {}),
        **DELTA_SQL,
    }
    env = {**os.environ, "SPARK_HOME": str(spark_home), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    log = folder / "server.log"
    server = subprocess.Popen(
        [str(spark_home / "bin" / "spark-submit"), "--master", "local[*]", "--name", "microbatch-connect",
         "--jars", ",".join(extra_jars()),
         *[arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}")], connect_server.__file__],
        env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                if server.poll() is None:
                    break
                raise OSError("the server exited")
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                _signal_sessions([server.pid], signal.SIGKILL)
                sys.exit(f"the Spark Connect server did not start (its log: {log}):\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(1)
    return server, f"sc://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("home", type=Path, help="the Airflow home (AIRFLOW_HOME)")
    parser.add_argument("--executor", choices=["local", "celery"], default="local")
    parser.add_argument("--workers", type=int, default=2, help="Celery workers (the celery profile)")
    parser.add_argument("--engine", choices=["local", "connect"], default="local",
                        help="connect: one Spark Connect server that every task uses (default: a JVM in each task)")
    parser.add_argument("--connect-port", type=int, default=15002)
    parser.add_argument("--connect-java-options", default="",
                        help="more JVM options for the Connect server, after its own (-XX:TieredStopAtLevel=4: C2 back)")
    parser.add_argument("--grace", type=float, default=30, help="seconds a stop waits before it kills")
    args = parser.parse_args()
    sessions: list[int] = []  # Airflow's processes, each a session
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        _say(f"stopping Airflow (up to {args.grace:.0f} s)")
        _signal_sessions(sessions, signal.SIGTERM)

    # First: a Ctrl-C while the servers start still stops what started.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    database: PostgresServer | None = None
    broker: RedisServer | None = None
    engine: subprocess.Popen[bytes] | None = None
    processes: list[subprocess.Popen[bytes]] = []
    try:
        try:
            database = PostgresServer.kept(args.home)
            broker = RedisServer.kept(args.home) if args.executor == "celery" else None
        except (PostgresMissing, RedisMissing) as exc:
            sys.exit(str(exc))
        env = {**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database.url("airflow", driver="postgresql+psycopg2")}
        airflow = str(Path(sys.executable).parent / "airflow")
        if args.engine == "connect" and not stopping:
            engine, url = _start_connect(args.home, args.connect_port, args.connect_java_options)
            env["MICROBATCH_SPARK_MASTER"] = url
            _say(f"Spark Connect server at {url}: every task is its thin client")
        commands: list[tuple[list[str], dict[str, str]]] = []
        if broker is None:
            commands.append(([airflow, "standalone"], env))
        else:
            env.update({
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__CELERY__BROKER_URL": broker.url(),
                "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + database.url("airflow", driver="postgresql+psycopg2"),
                # Each worker imports what a task imports once, before it forks its pool;
                # the scheduler's processes that send tasks start with the Celery executor imported.
                "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "microbatch_airflow.celery_config.CELERY_CONFIG",
                "AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD":
                    env.get("AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD", "airflow,microbatch_airflow.task_imports")
                    + ",airflow.providers.celery.executors.celery_executor",
            })
            migrated = subprocess.run([airflow, "db", "migrate"], env=env, capture_output=True, text=True)
            if migrated.returncode != 0:
                sys.exit(f"airflow db migrate failed:\n{migrated.stderr[-3000:]}")
            commands += [([airflow, component], env) for component in COMPONENTS]
            for i in range(1, args.workers + 1):
                # The UI fetches a running task's log from the port it expects
                # (8793), which only one worker on a host can have: the others'
                # show once the task ends (the same disk here).
                worker_env = {**env, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(WORKER_LOG_PORT_BASE + i)}
                commands.append(([airflow, "celery", "worker", "--celery-hostname", f"worker{i}@%h"], worker_env))
            _say(f"CeleryExecutor: broker {broker.url()}, {args.workers} workers, metadata and results in PostgreSQL")
        for command, command_env in commands:
            if stopping:
                break
            processes.append(subprocess.Popen(command, env=command_env, start_new_session=True))
            sessions.append(processes[-1].pid)
        watched = processes + ([engine] if engine is not None else [])
        announced = False
        while not stopping and all(p.poll() is None for p in watched):
            if not announced and _api_ready(env):
                announced = True
                _say(_banner(env, database, args.grace))
            time.sleep(0.5)
        if not stopping:  # a component (or the engine) ended on its own: the rest go too
            _say("an Airflow process or the Spark engine ended: stopping the rest")
            stop(signal.SIGTERM, None)
        deadline = time.monotonic() + args.grace
        while _sessions_alive(sessions) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _sessions_alive(sessions):
            _say(f"still running after {args.grace:.0f} s: killing what is left")
            _signal_sessions(sessions, signal.SIGKILL)
        for p in processes:
            p.wait()
    finally:
        if _sessions_alive(sessions):  # an error on the way: nothing is left running
            _signal_sessions(sessions, signal.SIGKILL)
        # The engine stops after Airflow: a batch stopping at its next
        # boundary may still need it until then.
        if engine is not None:
            _signal_sessions([engine.pid], signal.SIGTERM)
            try:
                engine.wait(20)
            except subprocess.TimeoutExpired:
                _signal_sessions([engine.pid], signal.SIGKILL)
        if broker is not None:
            broker.stop()
        if database is not None:
            database.stop()

if __name__ == "__main__":
    main()
