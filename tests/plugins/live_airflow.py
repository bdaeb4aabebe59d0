"""A real Airflow on loopback for end-to-end tests: api-server, scheduler,
dag-processor and triggerer as separate processes, and the metadata DB on a
PostgreSQL server of its own (dev/postgres.py). The LocalExecutor, or the
CeleryExecutor (`executor="celery"`) with Celery workers of their own and a
Redis server as the broker (dev/redis.py).

Each process runs in its own session so teardown can kill the whole group:
Airflow's processes rename themselves and fork workers, which a pattern
match on the command line would miss.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from dev.postgres import PostgresServer
from dev.redis import RedisServer

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


#: How often the components start again on another port when the api-server's was taken.
PORT_TRIES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_of(pid: int) -> int | None:
    """The session of a live process (None once it is gone, or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[3])  # after the name: state, ppid, pgrp, session


def session_pids(session: int) -> list[int]:
    """The live processes of `session`."""
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if session_of(int(pid)) == session]


def kill_session(session: int) -> int:
    """SIGKILL every process of `session` (a Celery worker's: the worker, its
    pool, the task supervisors, the tasks and their JVMs), as a lost machine
    would; how many were killed."""
    killed = 0
    for pid in session_pids(session):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def _log_line(line: str) -> str:
    """A task log record (JSON) as one readable line: time, level, logger, event, the rest."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict):
        return line
    head = [str(record.pop(k, "")) for k in ("timestamp", "level", "logger", "event")]
    for noise in ("ti_id", "dag_id", "task_id", "run_id", "map_index", "try_number"):
        record.pop(noise, None)
    return " ".join(head) + (f" {json.dumps(record, default=str)}" if record else "")


class LiveAirflow:
    def __init__(
        self, home: Path, pipelines_dir: Path, port: int | None = None, *, executor: str = "local", workers: int = 2,
        worker_concurrency: int = 2,
    ) -> None:
        assert executor in ("local", "celery"), executor
        self.home = home
        self.port = port or free_port()
        self.executor = executor
        #: The processes started, by name: `COMPONENTS`, then each Celery worker.
        self.components = [*COMPONENTS, *(f"celery-worker-{i}" for i in range(1, workers + 1) if executor == "celery")]
        self.worker_concurrency = worker_concurrency
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor" if executor == "celery" else "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            # As `make airflow` and the compose file: the LocalExecutor's
            # workers start from a forkserver that imported a task's modules.
            "AIRFLOW__SCHEDULER__MP_START_METHOD": "forkserver",
            "AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD": "airflow,microbatch_airflow.task_imports",
            # The suite's in-process Airflow logs at WARNING (tests/conftest.py);
            # these processes must not inherit that: the task log files would
            # hold warnings only, and a failed attempt could not say why.
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            # The simple auth manager with two users, so that the console's
            # checks meet real tokens: requests go as `admin` unless a test
            # asks for `viewer` or for no token at all.
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__API_AUTH__JWT_SECRET": "microbatch-test-jwt-secret-not-for-production",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.port}/execution/",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
            "MICROBATCH_PIPELINES_DIR": str(pipelines_dir),
            "MICROBATCH_SPARK_LOG_LEVEL": "ERROR",
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        }
        self.env.pop("AIRFLOW__CORE__DAGS_FOLDER_OVERRIDE", None)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.database: PostgresServer | None = None
        self.broker: RedisServer | None = None
        self.passwords = {"admin": "admin-password", "viewer": "viewer-password"}
        self._tokens: dict[str, str] = {}

    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "airflow"), *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self) -> LiveAirflow:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps(self.passwords))
        # The metadata DB on PostgreSQL, as in production: on SQLite a
        # command racing the scheduler fails half-written (dev/postgres.py).
        try:
            self.database = PostgresServer.start()
            self.database.create_database("airflow")
            self.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = self.database.url("airflow", driver="postgresql+psycopg2")
            if self.executor == "celery":
                self.broker = RedisServer.start()
                self.env["AIRFLOW__CELERY__BROKER_URL"] = self.broker.url()
                self.env["AIRFLOW__CELERY__RESULT_BACKEND"] = "db+" + self.database.url("airflow", driver="postgresql+psycopg2")
                self.env["AIRFLOW__CELERY__WORKER_CONCURRENCY"] = str(self.worker_concurrency)
                # As `make airflow EXECUTOR=celery`: each worker imports a task's modules once,
                # and the scheduler's processes that send tasks start with the Celery executor imported.
                self.env["AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"] = "microbatch_airflow.celery_config.CELERY_CONFIG"
                self.env["AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD"] += ",airflow.providers.celery.executors.celery_executor"
            migrated = self.airflow("db", "migrate")
            assert migrated.returncode == 0, migrated.stderr[-3000:]
            for _ in range(PORT_TRIES):
                self._start_components()
                if self._api_server_up():
                    break
                # Another process bound the port between `free_port` and the
                # api-server (a JVM's ephemeral port, on a loaded machine):
                # every component again, on another port.
                self._stop_components()
                self._use_port(free_port())
            else:
                raise AssertionError(f"the api-server found its port taken {PORT_TRIES} times\n{self.logs()}")
            if self.executor == "celery":
                self.wait(self._workers_ready, 120, "the Celery workers to be ready")
        except BaseException:
            self.stop()  # nothing left running: the server, its folder, the components started
            raise
        return self

    def _use_port(self, port: int) -> None:
        self.port = port
        self.env["AIRFLOW__API__PORT"] = str(port)
        self.env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] = f"http://127.0.0.1:{port}/execution/"

    def _api_server_up(self) -> bool:
        """Whether the api-server answers on its port: False when something
        else does (no HTTP answer), or the api-server exited (the port taken)."""
        api_server = self.procs[self.components.index("api-server")]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                self.api("GET", "/api/v2/monitor/health", user=None)
                return True
            except http.client.HTTPException:
                return False
            except (AssertionError, OSError):
                if api_server.poll() is not None:
                    return False
            time.sleep(1)
        raise AssertionError(f"timed out after 120 s waiting for the api-server to answer\n{self.logs()}")

    def _start_components(self) -> None:
        self.procs = []
        for component in self.components:
            command, env = [component], self.env
            if component.startswith("celery-worker-"):
                # Each worker serves its task logs on a port of its own, under a Celery name of its own.
                command = ["celery", "worker", "--celery-hostname", f"{component}@%h"]
                env = {**self.env, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port())}
            log = open(self.home / f"{component}.log", "wb")
            self.procs.append(
                subprocess.Popen(
                    [str(BIN / "airflow"), *command],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def _workers_ready(self) -> bool:
        """Whether every Celery worker said it is ready; a worker that exited fails at once, with its log."""
        ready = True
        for name, proc in zip(self.components, self.procs):
            if not name.startswith("celery-worker-"):
                continue
            log = (self.home / f"{name}.log").read_text(errors="replace")
            assert proc.poll() is None, f"Celery worker {name} exited ({proc.returncode}):\n{log[-3000:]}"
            ready = ready and " ready." in log
        return ready

    def stop(self) -> None:
        self._stop_components()
        if self.broker is not None:
            self.broker.stop()
        if self.database is not None:
            self.database.stop()

    def _stop_components(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def logs(self, dag_id: str | None = None) -> str:
        """The components' logs (their ends), then the whole log of every task
        attempt (of `dag_id`, or of every DAG): what a failure message shows."""
        parts = [f"--- {c} ---\n" + (self.home / f"{c}.log").read_text(errors="replace")[-4000:] for c in self.components]
        return "\n".join(parts + [self.task_logs(dag_id)])

    def task_logs(self, dag_id: str | None = None) -> str:
        """Every task attempt's log file, whole, one line a record, oldest
        attempt first (the files are JSON lines; see `_log_line`)."""
        folder = self.home / "logs"
        pattern = f"dag_id={dag_id}/**/attempt=*.log" if dag_id else "dag_id=*/**/attempt=*.log"
        files = sorted(folder.glob(pattern), key=lambda f: f.stat().st_mtime)
        return "\n".join(
            f"--- {f.relative_to(folder)} ---\n" + "\n".join(_log_line(line) for line in f.read_text(errors="replace").splitlines())
            for f in files
        )

    def run_story(self, dag_id: str, run_id: str, calls: list[subprocess.CompletedProcess[str]] = ()) -> str:
        """What happened to one DAG run, for a failure message short enough
        to be read whole: the CLI calls made, the DAG's backfills, the
        scheduler's lines about the run, and every attempt's task log."""
        parts = [f"--- airflow CLI call {i}: exit {c.returncode} ---\n{c.stdout[-800:]}{c.stderr[-1500:]}" for i, c in enumerate(calls, 1)]
        parts.append(f"--- backfills ---\n{json.dumps(self.api('GET', f'/api/v2/backfills?dag_id={dag_id}')['backfills'], indent=1)}")
        scheduler = (self.home / "scheduler.log").read_text(errors="replace").splitlines()
        mine = [line for line in scheduler if run_id in line or "ackfill" in line]
        parts.append("--- scheduler, lines about the run or backfills ---\n" + "\n".join(mine)[-6000:])
        folder = self.home / "logs"
        for f in sorted(folder.glob(f"dag_id={dag_id}/run_id={run_id}/**/attempt=*.log")):
            records = [_log_line(line) for line in f.read_text(errors="replace").splitlines()]
            parts.append(f"--- {f.relative_to(folder)} ---\n" + "\n".join(records)[-3000:])
        return "\n".join(parts)

    # -- REST API, as the UI calls it ------------------------------------------

    def token(self, user: str) -> str:
        """A JWT for `user`, as the UI's login form gets one."""
        if user not in self._tokens:
            answer = self.api("POST", "/auth/token", {"username": user, "password": self.passwords[user]}, user=None)
            self._tokens[user] = answer["access_token"]
        return self._tokens[user]

    def api(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, user: str | None = "admin", host: str | None = None
    ) -> Any:
        """Call the api-server as `user` (None: with no credentials); `host`: a Host header of the caller's."""
        headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
        if user is not None:
            headers["Authorization"] = f"Bearer {self.token(user)}"
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers=headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path} -> {exc.code}: {exc.read()[:2000]!r}") from None

    def pipelines(self, user: str = "viewer", timeout: float = 60) -> dict[str, dict[str, Any]]:
        """The console's pipelines by name, once every probe has answered
        since `pipelines` was called (a first request shows slow ones as
        "probing": the console never waits long for a source)."""
        asked = time.time()
        found: dict[str, dict[str, Any]] = {}

        def answered() -> bool:
            found.clear()
            found.update({p["name"]: p for p in self.api("GET", "/microbatch/api/pipelines", user=user)})
            return all(
                p.get("probed_at") and datetime.fromisoformat(p["probed_at"]).timestamp() >= asked
                for p in found.values()
                if p["status"] != "broken" or p.get("dag_id")
            )

        self.wait(answered, timeout, "every console probe to answer")
        return found

    def api_text(self, path: str, *, user: str = "admin") -> str:
        """GET a non-JSON answer (a CSV download) as `user`."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"Bearer {self.token(user)}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read().decode()

    def _get_or_none(self, path: str, user: str | None = "admin") -> Any:
        try:
            return self.api("GET", path, user=user)
        except (AssertionError, OSError):
            return None

    def wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(1)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> None:
        self.wait(lambda: self._get_or_none(f"/api/v2/dags/{dag_id}") is not None, timeout, f"DAG {dag_id} to be parsed")

    def unpause(self, dag_id: str) -> None:
        self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns?order_by=logical_date&limit=100")["dag_runs"]

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        run = self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})
        return run["dag_run_id"]

    def wait_for_runs(self, dag_id: str, count: int, timeout: float = 300) -> list[dict[str, Any]]:
        def done() -> bool:
            runs = self.runs(dag_id)
            return len(runs) >= count and all(r["state"] in ("success", "failed") for r in runs)

        self.wait(done, timeout, f"{count} finished run(s) of {dag_id}")
        return self.runs(dag_id)

    def wait_for_backfills(self, dag_id: str, timeout: float = 120) -> None:
        """Until the scheduler has marked every backfill of `dag_id` completed."""

        def done() -> bool:
            backfills = self.api("GET", f"/api/v2/backfills?dag_id={dag_id}")["backfills"]
            return bool(backfills) and all(b["completed_at"] for b in backfills)

        self.wait(done, timeout, f"the backfills of {dag_id} to complete")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]

    def xcom(self, dag_id: str, run_id: str, task_id: str = "run_batch") -> Any:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
        return self.api("GET", path)["value"]

    def task_log(self, dag_id: str, run_id: str, task_id: str = "run_batch", try_number: int = 1) -> list[dict[str, Any]]:
        """The task's log records as the UI's log view gets them (level, event, ...)."""
        path = f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/logs/{try_number}?full_content=true"
        return [r for r in self.api("GET", path)["content"] if isinstance(r, dict)]

    def asset_events(self) -> list[dict[str, Any]]:
        return self.api("GET", "/api/v2/assets/events?limit=100")["asset_events"]
