"""`make airflow` (Airflow on this machine, its metadata in a PostgreSQL
server of its own) stops on one Ctrl-C, database included, even while a
batch runs: a real `make`, a real `airflow standalone` (or, with
EXECUTOR=celery, the components, two Celery workers and a Redis broker), a
real batch in Spark, and SIGINT to make's process group as a terminal sends
it. (`airflow standalone` alone waited for the running task until a second one.)
With ENGINE=connect, every batch runs on one shared Spark Connect server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from dev.postgres import PostgresServer
from dev.redis import RedisServer
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.engine import connect_server
from tests.conftest import ROOT, assert_exact, oracle_spec_dict, write_spec
from tests.plugins.live_airflow import free_port

# `make airflow` keeps files in the checkout (its JVM archives, its bytecode):
# its runs stay in one test process also where tests are spread one by one (`make soak`).
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("make_airflow")]


def _call(port: int, method: str, path: str, body: dict | None = None):
    """One API call. A GET that times out is asked again, twice: on a loaded
    machine (the suite's other JVMs starting at once) the api-server once
    took over 30 s to answer a poll; a write is never repeated."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None, headers={"Content-Type": "application/json"},
    )
    attempts = 3 if method == "GET" else 1
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except TimeoutError:
            if attempt == attempts - 1:
                raise


def _alive(marker: str, command: str = "") -> list[str]:
    """Live processes whose environment names `marker` (and whose command line holds `command`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if marker.encode() in handle.read():
                    with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        if stat.read().split()[2] != "Z" and command.encode() in cmdline.read():
                            found.append(pid)
        except OSError:
            continue
    return found


def _parent(pid: str) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[1]


def _jvms(marker: str) -> list[str]:
    """The live JVMs among `_alive(marker)`: their program is `java` (an
    argument that names java, such as --connect-java-options, does not count)."""
    found = []
    for pid in _alive(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if os.path.basename(cmdline.read().split(b"\0")[0]) == b"java":
                    found.append(pid)
        except OSError:
            continue
    return found


def _in_session_of(pid: str, server: str) -> bool:
    """Whether `pid` runs in `server`'s session (the server's own children,
    orphaned ones included); True once it is gone (a task's JVM lives for
    its batch: the next look sees it)."""
    try:
        return os.getsid(int(pid)) == os.getsid(int(server))
    except ProcessLookupError:
        return True


def _command(pid: str) -> str:
    """`pid`'s command line and its parent's, for a failure message."""
    def line(of: str) -> str:
        with open(f"/proc/{of}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:300]

    try:
        parent = _parent(pid)
        return f"{pid}: {line(pid)} (parent {parent}: {line(parent)})"
    except OSError as gone:
        return f"{pid}: gone ({gone})"


def _session_leader(pid: str) -> bytes:
    """The command line of the leader of `pid`'s session."""
    session = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[3])
    with open(f"/proc/{session}/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ")


@contextmanager
def _make_airflow(tmp_path: Path, pipelines: Path, *settings: str):
    """`make airflow` with these settings, as a terminal runs it; yields (make, port) once the
    pipelines' first DAG answers, and leaves nothing behind (kept database and broker included)."""
    port = free_port()
    env = {
        **os.environ,
        "MICROBATCH_PIPELINES_DIR": str(pipelines),
        "MICROBATCH_TEST_MARKER": str(tmp_path),  # finds every process of this Airflow
    }
    log = open(tmp_path / "make.log", "w")
    make = subprocess.Popen(
        ["make", "--no-print-directory", "airflow", f"AIRFLOW_PORT={port}", f"LOCAL_AIRFLOW_HOME={tmp_path / 'home'}", *settings],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    dag_id = sorted(pipelines.glob("*.yaml"))[0].stem
    try:
        # (Generous: with the suite's other JVMs on 2 cores, a Connect server
        # and Airflow's first parse once took more than 5 minutes.)
        deadline = time.monotonic() + 600
        while True:
            assert make.poll() is None, (tmp_path / "make.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Airflow did not come up:\n" + (tmp_path / "make.log").read_text()[-3000:]
            try:
                _call(port, "GET", f"/api/v2/dags/{dag_id}")
                break
            except OSError:
                time.sleep(2)
        yield make, port
    finally:
        if make.poll() is None:
            # A failed assertion above: one Ctrl-C stops every session `make airflow`
            # made (a SIGKILL to its group would miss them, and Airflow's retitled
            # processes no longer show the marker in their environment).
            os.killpg(make.pid, signal.SIGINT)
            try:
                make.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(make.pid, signal.SIGKILL)
        for pid in _alive(str(tmp_path)):
            os.kill(int(pid), signal.SIGKILL)
        log.close()
        database = PostgresServer.kept(tmp_path / "home", start=False)
        database.stop()
        broker = RedisServer.kept(tmp_path / "home", start=False)
        broker.stop()
        shutil.rmtree(broker.folder, ignore_errors=True)
    said = (tmp_path / "make.log").read_text()
    assert "stopping Airflow" in said
    # One banner, once the UI answered: its URL, the login, how to stop it (issue 49).
    assert said.count(f"Airflow is ready: http://127.0.0.1:{port}/\n") == 1, said[-3000:]
    assert "every visitor is an admin" in said and "stop: Ctrl-C once" in said
    # The metadata was in the home's own PostgreSQL (stopped with Airflow, data kept), not in SQLite.
    assert (database.folder / "data" / "PG_VERSION").exists() and not (tmp_path / "home" / "airflow.db").exists()
    shutil.rmtree(database.folder, ignore_errors=True)


def _ctrl_c(make: subprocess.Popen, tmp_path: Path) -> None:
    os.killpg(make.pid, signal.SIGINT)  # one Ctrl-C
    make.wait(90)
    time.sleep(2)
    assert _alive(str(tmp_path)) == [], "processes outlived one Ctrl-C"
    assert not PostgresServer.kept(tmp_path / "home", start=False).running(), "the database outlived one Ctrl-C"
    assert not RedisServer.kept(tmp_path / "home", start=False).running(), "the broker outlived one Ctrl-C"


# Celery's case in `make soak`: its executor's tasks, killed with their worker, are
# tests/plugins/test_airflow_celery.py's; one Ctrl-C stopping a whole stack is the local case's.
@pytest.mark.parametrize("executor", ["local", pytest.param("celery", marks=pytest.mark.slow)])
def test_one_ctrl_c_stops_make_airflow_while_a_batch_runs(tmp_path, executor):
    pipelines = tmp_path / "pipelines"
    spec_file = write_spec(pipelines, oracle_spec_dict(name="busy_clicks"), "busy_clicks.yaml")
    write_wave(spec_file.parent / "landing", 0, files=5, records_per_file=20000)
    with _make_airflow(tmp_path, pipelines, f"EXECUTOR={executor}") as (make, port):
        deadline = time.monotonic() + 300
        _call(port, "PATCH", "/api/v2/dags/busy_clicks", {"is_paused": False})
        _call(port, "POST", "/api/v2/dags/busy_clicks/dagRuns", {"logical_date": None, "conf": {}})
        while not _jvms(str(tmp_path)):
            assert time.monotonic() < deadline, "the batch never started Spark"
            time.sleep(0.5)
        time.sleep(3)  # inside the batch: Spark is at work
        # What a signal to the standalone's process group alone would miss:
        # Airflow's supervisor runs each task (and so its Spark JVM) in a
        # process group of its own, inside the session `make airflow` made.
        component = "standalone" if executor == "local" else "celery"
        runner = {os.getpgid(int(pid)) for pid in _alive(str(tmp_path), component)}
        spark = {os.getpgid(int(pid)) for pid in _jvms(str(tmp_path))}
        assert runner and spark and not spark & runner
        if executor == "celery":  # the batch runs under a Celery worker, not the scheduler
            assert all(b"celery worker" in _session_leader(pid) for pid in _jvms(str(tmp_path)))
        _ctrl_c(make, tmp_path)


# Soak: what it checks is `make airflow`'s options reaching each component
# (most of its three minutes are Airflow's parse interval going by); `make
# test` keeps `make airflow`'s own class (the Ctrl-C test above) and runs
# Airflow's tasks on a shared Connect server in plugins/test_airflow_live.py.
@pytest.mark.slow
def test_make_airflow_with_a_shared_connect_engine_runs_every_batch_on_it(tmp_path):
    """ENGINE=connect: one Spark Connect server; the tasks are its thin
    clients and start no JVM of their own. One Ctrl-C stops it too. And the
    server's JVM compiles with C1 alone and takes CONNECT_JAVA_OPTIONS. And the
    fleet's parse interval (PARSE_INTERVAL=300) reaches the dag-processor:
    the DAG file is not parsed again after Airflow's default 30 s; and its
    idle sleep (SCHEDULER_IDLE_SLEEP) reaches the scheduler."""
    pipelines = tmp_path / "pipelines"
    spec_file = write_spec(pipelines, oracle_spec_dict(name="shared_clicks"), "shared_clicks.yaml")
    write_wave(spec_file.parent / "landing", 0, files=3, records_per_file=200)
    settings = ("ENGINE=connect", f"CONNECT_PORT={free_port()}", "PARSE_INTERVAL=300", "SCHEDULER_IDLE_SLEEP=5",
                "CONNECT_JAVA_OPTIONS=-Dmicrobatch.test.option=given")
    with _make_airflow(tmp_path, pipelines, *settings) as (make, port):
        parsed_at, seen_at = _call(port, "GET", "/api/v2/dags/shared_clicks")["last_parsed_time"], time.monotonic()
        (server,) = _jvms(str(tmp_path))
        assert b"connect_server.py" in open(f"/proc/{server}/cmdline", "rb").read()
        # What the JVM runs with, not what its command line lists: C1 alone
        # (connect_server.JVM_OPTIONS), and the user's CONNECT_JAVA_OPTIONS too.
        flags = subprocess.run(["jcmd", str(server), "VM.flags"], capture_output=True, text=True, check=True).stdout
        assert set(connect_server.JVM_OPTIONS.split()) <= set(flags.split()), flags
        properties = subprocess.run(["jcmd", str(server), "VM.system_properties"], capture_output=True, text=True, check=True).stdout
        assert "microbatch.test.option=given" in properties.splitlines(), "CONNECT_JAVA_OPTIONS did not reach the server"
        _call(port, "PATCH", "/api/v2/dags/shared_clicks", {"is_paused": False})
        run = _call(port, "POST", "/api/v2/dags/shared_clicks/dagRuns", {"logical_date": None, "conf": {}})
        path = f"/api/v2/dags/shared_clicks/dagRuns/{run['dag_run_id']}"
        deadline = time.monotonic() + 300
        while _call(port, "GET", path)["state"] not in ("success", "failed"):
            # The server's own children count as the server: Java starts a
            # child (its Python workers, a shell command) through
            # `<JDK>/lib/jspawnhelper`, a command line that names java. The
            # server runs in a session of its own; a task's JVM is in the task's.
            others = [_command(pid) for pid in _jvms(str(tmp_path)) if not _in_session_of(pid, server)]
            assert not others, f"a task started a JVM of its own: {others}"
            assert time.monotonic() < deadline, "the run did not finish"
            time.sleep(0.5)
        assert _call(port, "GET", path)["state"] == "success", (tmp_path / "make.log").read_text()[-3000:]
        assert_exact(spec_file)
        time.sleep(max(0.0, seen_at + 40 - time.monotonic()))
        assert _call(port, "GET", "/api/v2/dags/shared_clicks")["last_parsed_time"] == parsed_at, "parsed again within 40 s"
        # And not because the machine was slow: the setting is in the dag-processor's own environment.
        configured = set(_alive("AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL=300\0", "dag-processor"))
        assert configured & set(_alive(str(tmp_path), "dag-processor")), "the dag-processor runs without PARSE_INTERVAL"
        sleeping = set(_alive("AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME=5\0", "scheduler"))
        assert sleeping & set(_alive(str(tmp_path), "scheduler")), "the scheduler runs without SCHEDULER_IDLE_SLEEP"
        _ctrl_c(make, tmp_path)
