"""`make airflow`: a local Airflow on this machine, stopped whole by one Ctrl-C.

Its metadata lives in a PostgreSQL server of its own (dev/postgres.py), kept
with the Airflow home. Two profiles:

* ``local`` (the default): `airflow standalone`, with the LocalExecutor
  (standalone forces it, whatever it is told).
* ``celery``: the CeleryExecutor as production runs it, with a Redis broker
  of its own (dev/redis.py) and `--workers` Celery workers on this machine;
  the components (api-server, scheduler, dag-processor, triggerer) are
  started one by one, since standalone would not run Celery.

One Ctrl-C (or TERM) stops everything. Each process runs in a session of
its own, and the stop signals whole sessions: Airflow's task supervisor puts
each task (and the Spark JVM it starts) in a process group of its own, which
a signal to the component's group misses, while the session holds them. A
running batch gets TERM and stops at its next protocol boundary; whatever
still runs after `--grace` seconds is killed, which the commit protocol is
built to survive. Then the broker and the database stop, their data kept.

    python -m dev.airflow HOME [--executor celery] [--workers 2] [--grace 30]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("home", type=Path, help="the Airflow home (AIRFLOW_HOME)")
    parser.add_argument("--executor", choices=["local", "celery"], default="local")
    parser.add_argument("--workers", type=int, default=2, help="Celery workers (the celery profile)")
    parser.add_argument("--grace", type=float, default=30, help="seconds a stop waits before it kills")
    args = parser.parse_args()
    try:
        database = PostgresServer.kept(args.home)
        broker = RedisServer.kept(args.home) if args.executor == "celery" else None
    except (PostgresMissing, RedisMissing) as exc:
        sys.exit(str(exc))
    env = {**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database.url("airflow", driver="postgresql+psycopg2")}
    airflow = str(Path(sys.executable).parent / "airflow")
    commands: list[tuple[list[str], dict[str, str]]] = []
    if broker is None:
        commands.append(([airflow, "standalone"], env))
    else:
        env.update({
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CELERY__BROKER_URL": broker.url(),
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + database.url("airflow", driver="postgresql+psycopg2"),
        })
        migrated = subprocess.run([airflow, "db", "migrate"], env=env, capture_output=True, text=True)
        if migrated.returncode != 0:
            sys.exit(f"airflow db migrate failed:\n{migrated.stderr[-3000:]}")
        commands += [([airflow, component], env) for component in COMPONENTS]
        for i in range(1, args.workers + 1):
            worker_env = {**env, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(WORKER_LOG_PORT_BASE + i)}
            commands.append(([airflow, "celery", "worker", "--celery-hostname", f"worker{i}@%h"], worker_env))
        _say(f"CeleryExecutor: broker {broker.url()}, {args.workers} workers, metadata and results in PostgreSQL")
    processes = [subprocess.Popen(command, env=command_env, start_new_session=True) for command, command_env in commands]
    sessions = [p.pid for p in processes]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        _say(f"stopping Airflow (up to {args.grace:.0f} s)")
        _signal_sessions(sessions, signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping and all(p.poll() is None for p in processes):
            time.sleep(0.5)
        if not stopping:  # a component ended on its own: the rest go too
            _say("an Airflow process ended: stopping the rest")
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
        if broker is not None:
            broker.stop()
        database.stop()


if __name__ == "__main__":
    main()
