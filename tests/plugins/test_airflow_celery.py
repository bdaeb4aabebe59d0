"""The CeleryExecutor profile, live: six pipelines over two Celery workers
(Redis as the broker, PostgreSQL for metadata and results), and one worker
SIGKILLed, whole, while its batches sit between their state commit and their
ledger commit. Their tasks are retried on the other worker and every
pipeline ends exact by the oracle. The tasks are thin clients of the test
process's shared Spark Connect server, as a fleet on Celery workers runs
(`make airflow EXECUTOR=celery ENGINE=connect`): a worker's death takes its
tasks' Python processes, where every commit is made.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from spark_jobs.core.faults import MARKER
from spark_jobs.demo.clickstream import write_wave
from tests.conftest import assert_exact, oracle_spec_dict, write_spec
from tests.plugins.live_airflow import LiveAirflow, kill_session, session_of

pytestmark = pytest.mark.timeout(1500)

PIPELINES = 6  # four held mid-commit (two workers, two slots each), two waiting behind them
HELD = re.compile(rf"{MARKER} hold after_state_commit pid=(\d+)")


@pytest.fixture(scope="module")
def celery(tmp_path_factory, shared_connect):
    root = tmp_path_factory.mktemp("celery")
    pipelines = root / "pipelines"
    for i in range(PIPELINES):
        name = f"fleet_{i:02d}"
        spec = oracle_spec_dict(name=name, airflow={"retries": 3, "retry_delay_seconds": 2}, engine={"master": shared_connect})
        spec["source"]["path"] = f"landing/{name}"
        spec["state"]["path"] = f"lake/{name}"
        spec["checkpoint"] = f"lake/_checkpoints/{name}"
        write_spec(pipelines, spec, f"{name}.yaml")
        write_wave(pipelines / "landing" / name, 0, files=2, records_per_file=25, users=7)
    airflow = LiveAirflow(root / "home", pipelines, executor="celery", workers=2, worker_concurrency=2)
    # While this file exists, every batch waits between its state commit and its ledger commit.
    airflow.env["MICROBATCH_HOLD_POINT"] = "after_state_commit"
    airflow.env["MICROBATCH_HOLD_FILE"] = str(root / "hold")
    # A worker lost with its tasks is found by their missed heartbeats: 90 s
    # here, 5 min by default. (At 20 s, the held batches of the live worker
    # were once taken for lost too while the suite's other JVMs kept the API
    # server from answering their heartbeats.)
    airflow.env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"] = "90"
    airflow.env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL"] = "5"
    airflow.env["AIRFLOW__CORE__PARALLELISM"] = "8"
    airflow.start()
    airflow.root = root
    try:
        for i in range(PIPELINES):
            airflow.wait_for_dag(f"fleet_{i:02d}")
        yield airflow
    finally:
        airflow.stop()


def test_a_worker_killed_mid_commit_is_retried_on_the_other_and_every_pipeline_ends_exact(celery):
    live = celery
    hold = live.root / "hold"
    hold.touch()
    names = [f"fleet_{i:02d}" for i in range(PIPELINES)]
    for name in names:
        live.unpause(name)
        live.trigger(name, {})
    workers = {name: proc.pid for name, proc in zip(live.components, live.procs) if name.startswith("celery-worker-")}
    # Each worker imported a task's modules before it forked its pool
    # (microbatch_airflow.celery_config): delta-rs, pyarrow, Spark Connect's gRPC.
    for name, pid in workers.items():
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert all(library in maps for library in ("deltalake/_internal", "grpc/_cython/cygrpc", "pyarrow/libarrow.so")), name

    def held_by_worker() -> dict[str, dict[int, str]]:
        """By worker, the batches held mid-commit: {pid: DAG id}, from each attempt's log."""
        held: dict[str, dict[int, str]] = {name: {} for name in workers}
        for log in (live.home / "logs").glob("dag_id=*/**/attempt=*.log"):
            dag_id = next(part for part in log.parts if part.startswith("dag_id=")).removeprefix("dag_id=")
            for pid in map(int, HELD.findall(log.read_text(errors="replace"))):
                for name, session in workers.items():
                    if session_of(pid) == session:
                        held[name][pid] = dag_id
        return held

    # Both workers busy: each holds batches between their two commits.
    live.wait(lambda: all(len(pids) == live.worker_concurrency for pids in held_by_worker().values()), 600,
              "both workers to hold their batches mid-commit")
    victim = held_by_worker()["celery-worker-1"]
    assert kill_session(workers["celery-worker-1"]) >= 1 + len(victim)
    hold.unlink()
    live.wait(lambda: all(session_of(pid) is None for pid in victim), 30, "the killed batches to be gone")

    for name in names:
        (run,) = live.wait_for_runs(name, 1, timeout=900)
        assert run["state"] == "success", live.logs(name)
    retried = {name for name in names if live.task_instances(name, live.runs(name)[0]["dag_run_id"])[0]["try_number"] > 1}
    # Exactly the killed worker's batches ran again, on the other worker (the only one left).
    assert retried == set(victim.values()), (retried, victim)
    assert not any(session_of(pid) == workers["celery-worker-1"] for pid in map(int, filter(str.isdigit, os.listdir("/proc"))))
    for name in names:
        lineage = assert_exact(live.root / "pipelines" / f"{name}.yaml")
        assert [row.batch_id for row in lineage] == [1], (name, lineage)
