"""End to end on real Airflow processes (api-server, scheduler, dag-processor,
triggerer; SQLite; LocalExecutor; loopback), driven through the REST API as
the UI drives it, and through `airflow backfill create` as a user types it.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.spec import load_spec
from tests.conftest import assert_exact, oracle_spec_dict, write_spec
from tests.plugins.live_airflow import LiveAirflow

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    pipelines = root / "pipelines"
    # The downstream example DAG follows clicks_per_user.yaml in the pipelines folder.
    write_spec(pipelines, oracle_spec_dict(name="clicks_per_user"), "clicks_per_user.yaml")
    yearly = oracle_spec_dict(name="yearly_clicks", schedule="@yearly", start_date="2022-01-01T00:00:00Z")
    yearly["source"]["path"] = "landing_yearly"
    yearly["state"]["path"] = "lake/yearly"
    yearly["checkpoint"] = "lake/_checkpoints/yearly"
    write_spec(pipelines, yearly, "yearly_clicks.yaml")
    waiting = oracle_spec_dict(name="waiting_clicks", wait_for_data={"poll_seconds": 2, "timeout_seconds": 90, "deferrable": True})
    waiting["source"]["path"] = "landing_waiting"
    waiting["state"]["path"] = "lake/waiting"
    waiting["checkpoint"] = "lake/_checkpoints/waiting"
    write_spec(pipelines, waiting, "waiting_clicks.yaml")
    airflow = LiveAirflow(root / "home", pipelines)
    airflow.env["MICROBATCH_FAULT_POINT"] = "after_state_commit"
    airflow.env["MICROBATCH_FAULT_ARM_FILE"] = str(root / "arm-fault")
    airflow.start()
    airflow.root = root
    try:
        for dag_id in ("clicks_per_user", "clicks_per_user_downstream", "yearly_clicks", "waiting_clicks"):
            airflow.wait_for_dag(dag_id)
        yield airflow
    finally:
        airflow.stop()


def _committed(spec_file: Path) -> list:
    spec = load_spec(spec_file)
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    return sorted((r for r in rows if r.status == RowStatus.COMMITTED), key=lambda r: (r.epoch, r.batch_id))


def test_trigger_with_params_commits_and_emits_an_asset_event(live):
    spec_file = live.root / "pipelines" / "clicks_per_user.yaml"
    write_wave(spec_file.parent / "landing", 0, files=3, records_per_file=100)
    live.unpause("clicks_per_user_downstream")
    live.unpause("clicks_per_user")
    run_id = live.trigger("clicks_per_user", {"max_files": 2})
    (run,) = live.wait_for_runs("clicks_per_user", 1)
    assert run["state"] == "success", live.logs()
    summary = live.xcom("clicks_per_user", run_id)
    assert summary["status"] == "committed" and len(summary["inputs"]) == 2  # the param capped the batch
    assert_exact(spec_file, drained=False)
    downstream = live.wait_for_runs("clicks_per_user_downstream", 1)
    assert downstream[0]["state"] == "success" and downstream[0]["run_type"] == "asset_triggered"
    # Read the events only now: Airflow 3.3.2's GET /assets/events answers 500
    # while a run the event created is still queued (its start_date is null).
    (event,) = [e for e in live.asset_events() if e["source_dag_id"] == "clicks_per_user"]
    assert event["extra"]["batch_id"] == 1 and event["extra"]["end_offsets"] == {"files": 2}
    assert event["extra"]["state_version"] == summary["state_version"]


def test_bad_param_is_refused_at_trigger_time(live):
    with pytest.raises(AssertionError, match="-> 400"):
        live.trigger("clicks_per_user", {"max_files": 0})


def test_task_killed_after_state_commit_is_retried_and_exact(live):
    spec_file = live.root / "pipelines" / "clicks_per_user.yaml"
    write_wave(spec_file.parent / "landing", 1, files=1, records_per_file=100)
    (live.root / "arm-fault").touch()  # the next run's first attempt dies after its state commit
    run_id = live.trigger("clicks_per_user", {})
    runs = live.wait_for_runs("clicks_per_user", 2)
    assert [r["state"] for r in runs if r["dag_run_id"] == run_id] == ["success"], live.logs()
    assert not (live.root / "arm-fault").exists(), "the fault never fired"
    (ti,) = live.task_instances("clicks_per_user", run_id)
    assert ti["try_number"] == 2  # attempt 1 was SIGKILLed, attempt 2 completed it
    summary = live.xcom("clicks_per_user", run_id)
    assert summary["status"] == "no_new_data" and summary["committed_by_earlier_attempts"] == [2]
    assert_exact(spec_file)
    assert len(_committed(spec_file)) == 2
    # Attempt 1 died before it could emit batch 2's asset event: attempt 2 sent it.
    live.wait_for_runs("clicks_per_user_downstream", 2)
    batches = sorted(e["extra"]["batch_id"] for e in live.asset_events() if e["source_dag_id"] == "clicks_per_user")
    assert batches == [1, 2]


def test_backfill_processes_each_interval_once(live):
    spec_file = live.root / "pipelines" / "yearly_clicks.yaml"
    landing = spec_file.parent / "landing_yearly"
    landing.mkdir(exist_ok=True)
    # Unpausing creates the run for the latest complete year (2025); no data yet: a no-op.
    live.unpause("yearly_clicks")
    (first,) = live.wait_for_runs("yearly_clicks", 1)
    assert first["state"] == "success"
    # Data that arrived in 2022, 2023 and 2024 (arrival time = file mtime).
    for wave, year in enumerate((2022, 2023, 2024)):
        for path in write_wave(landing, wave, files=2, records_per_file=50):
            t = datetime(year, 6, 1, tzinfo=timezone.utc).timestamp()
            os.utime(path, (t, t))
    args = ["backfill", "create", "--dag-id", "yearly_clicks", "--from-date", "2022-01-01T00:00:00+00:00",
            "--to-date", "2024-01-01T00:00:00+00:00", "--max-active-runs", "1"]
    created = live.airflow_writing(*args)
    assert created.returncode == 0, created.stderr[-3000:]
    runs = live.wait_for_runs("yearly_clicks", 4)
    assert all(r["state"] == "success" for r in runs), live.logs()
    committed = _committed(spec_file)
    # One batch per interval, each with exactly that interval's two files.
    assert [(r.batch_id, r.interval_end.year, r.records_in) for r in committed] == [(1, 2023, 100), (2, 2024, 100), (3, 2025, 100)]
    for row, wave in zip(committed, range(3)):
        assert all(f"w{wave:05d}" in f["name"] for f in row.manifest["files"])
    assert_exact(spec_file)
    # Backfilling the same range again re-runs completed intervals: all no-ops.
    live.wait_for_backfills("yearly_clicks")
    again = live.airflow_writing(*args, "--reprocess-behavior", "completed")
    # The scheduler marks backfills complete every 30 s, later under load;
    # `backfill create` refuses while it has not (seen in CI under load).
    for _ in range(90):
        if again.returncode == 0 or "AlreadyRunningBackfill" not in again.stderr:
            break
        time.sleep(2)
        again = live.airflow_writing(*args, "--reprocess-behavior", "completed")
    assert again.returncode == 0, again.stderr[-2000:]
    live.wait_for_backfills("yearly_clicks", timeout=600)  # reprocessing clears and re-runs the same runs
    runs = live.wait_for_runs("yearly_clicks", 4)
    assert all(r["state"] == "success" for r in runs), live.logs()
    for run in (r for r in runs if r["run_type"] == "backfill"):
        (ti,) = live.task_instances("yearly_clicks", run["dag_run_id"])
        assert ti["try_number"] == 2, f"{run['dag_run_id']} was not re-run"
        outcome = live.xcom("yearly_clicks", run["dag_run_id"])
        assert outcome["status"] == "no_new_data" and "already covered" in outcome["message"]
    assert len(_committed(spec_file)) == 3
    assert_exact(spec_file)


def test_sensor_defers_until_data_lands_then_soft_fails_on_timeout(live):
    spec_file = live.root / "pipelines" / "waiting_clicks.yaml"
    live.unpause("waiting_clicks")
    run_id = live.trigger("waiting_clicks", {})

    def sensor_state(rid: str) -> str | None:
        tis = {t["task_id"]: t for t in live.task_instances("waiting_clicks", rid)}
        return tis.get("wait_for_data", {}).get("state")

    live.wait(lambda: sensor_state(run_id) == "deferred", 120, "the sensor to defer")  # no worker slot held
    write_wave(spec_file.parent / "landing_waiting", 0, files=1, records_per_file=40)
    (run,) = live.wait_for_runs("waiting_clicks", 1, timeout=240)
    assert run["state"] == "success", live.logs()
    assert live.xcom("waiting_clicks", run_id)["status"] == "committed"
    assert_exact(spec_file)
    # Nothing new: the sensor times out (90 s) and soft-fails, so the batch is skipped.
    second = live.trigger("waiting_clicks", {})
    live.wait_for_runs("waiting_clicks", 2, timeout=400)
    states = {t["task_id"]: t["state"] for t in live.task_instances("waiting_clicks", second)}
    assert states == {"wait_for_data": "skipped", "run_batch": "skipped"}
