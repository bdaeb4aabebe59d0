"""End to end on real Airflow processes (api-server, scheduler, dag-processor,
triggerer; PostgreSQL; LocalExecutor; loopback), driven through the REST API as
the UI drives it, and through `airflow backfill create` as a user types it.
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import pytest

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.spec import load_spec
from tests.conftest import ROOT, assert_exact, land_at_once, oracle_spec_dict, write_spec
from tests.plugins.live_airflow import LiveAirflow, free_port

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def live(tmp_path_factory, shared_connect):
    """The pipelines of these tests, on one live Airflow. `clicks_per_user`
    starts Spark in its tasks, as on `local[*]` (its test reads what a
    task's JVM logs); the others' tasks are thin clients of the test
    process's shared Spark Connect server, as in a fleet on a shared engine."""
    root = tmp_path_factory.mktemp("live")
    pipelines = root / "pipelines"
    # The downstream example DAG follows clicks_per_user.yaml in the pipelines folder.
    write_spec(pipelines, oracle_spec_dict(name="clicks_per_user"), "clicks_per_user.yaml")
    yearly = oracle_spec_dict(name="yearly_clicks", airflow={"schedule": "@yearly", "start_date": "2022-01-01T00:00:00Z"})
    yearly["source"]["path"] = "landing_yearly"
    yearly["state"]["path"] = "lake/yearly"
    yearly["checkpoint"] = "lake/_checkpoints/yearly"
    yearly["engine"] = {"master": shared_connect}
    write_spec(pipelines, yearly, "yearly_clicks.yaml")
    waiting = oracle_spec_dict(name="waiting_clicks", airflow={"wait_for_data": {"poll_seconds": 2, "timeout_seconds": 30, "deferrable": True}})
    waiting["source"]["path"] = "landing_waiting"
    waiting["state"]["path"] = "lake/waiting"
    waiting["checkpoint"] = "lake/_checkpoints/waiting"
    waiting["engine"] = {"master": shared_connect}
    write_spec(pipelines, waiting, "waiting_clicks.yaml")
    watched = oracle_spec_dict(name="watched_clicks", airflow={"run_on_data": {"poll_seconds": 2}})
    watched["source"]["path"] = "landing_watched"
    watched["state"]["path"] = "lake/watched"
    watched["checkpoint"] = "lake/_checkpoints/watched"
    watched["engine"] = {"master": shared_connect}
    write_spec(pipelines, watched, "watched_clicks.yaml")
    console = oracle_spec_dict(name="console_clicks", batch={"max_files": 2})
    console["source"]["path"] = "landing_console"
    console["state"]["path"] = "lake/console"
    console["checkpoint"] = "lake/_checkpoints/console"
    console["engine"] = {"master": shared_connect}
    # Event time (accepted when late: the batches and the quarantine stay what the console's tests count).
    console["event_time"] = {"column": "ts", "delay": "10 minutes", "late": "accept"}
    # Merged on read from its second batch: the console says what its readers need.
    console["state"]["deletion_vectors"] = True
    write_spec(pipelines, console, "console_clicks.yaml")
    stopped = oracle_spec_dict(name="stopped_clicks", airflow={"retries": 0})
    stopped["source"]["path"] = "landing_stopped"
    stopped["state"]["path"] = "lake/stopped"
    stopped["checkpoint"] = "lake/_checkpoints/stopped"
    stopped["engine"] = {"master": shared_connect}
    write_spec(pipelines, stopped, "stopped_clicks.yaml")
    typo = oracle_spec_dict(name="typo_clicks")
    typo["source"]["path"] = "landing_typo"
    typo["state"]["path"] = "lake/typo"
    typo["checkpoint"] = "lake/_checkpoints/typo"
    typo["engine"] = {"master": shared_connect}
    write_spec(pipelines, typo, "typo_clicks.yaml")
    # Never run: a file waits, over its lag alert's threshold (the console shows it red).
    alerting = oracle_spec_dict(name="alerting_clicks", airflow={"lag_alert": {"count": 1}})
    alerting["source"]["path"] = "landing_alerting"
    alerting["state"]["path"] = "lake/alerting"
    alerting["checkpoint"] = "lake/_checkpoints/alerting"
    alerting["engine"] = {"master": shared_connect}
    write_spec(pipelines, alerting, "alerting_clicks.yaml")
    write_wave(pipelines / "landing_alerting", 0, files=1, records_per_file=5)
    airflow = LiveAirflow(root / "home", pipelines)
    airflow.env["MICROBATCH_FAULT_POINT"] = "after_state_commit"
    airflow.env["MICROBATCH_FAULT_ARM_FILE"] = str(root / "arm-fault")
    # While this file exists, a run waits after planning (the on_kill test).
    airflow.env["MICROBATCH_HOLD_POINT"] = "after_plan"
    airflow.env["MICROBATCH_HOLD_FILE"] = str(root / "hold")
    airflow.start()
    airflow.root = root
    try:
        for dag_id in (
            "clicks_per_user", "clicks_per_user_downstream", "yearly_clicks", "waiting_clicks", "watched_clicks",
            "console_clicks", "stopped_clicks", "typo_clicks",
        ):
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
    # Spark's start-up notices no longer show as red ERROR lines: the JVM's
    # output is logged at its own level, the notices dropped.
    records = live.task_log("clicks_per_user", run_id)
    assert any("attempt=1.log" in str(r.get("event")) for r in records), records  # the log was read
    # The whole log, at INFO: the batch's summary is in it once, and the console's URL on the next line.
    events = [str(r.get("event")) for r in records]
    said = [i for i, e in enumerate(events) if "records read" in e or "committed batch" in e]
    assert len(said) == 1 and events[said[0]].startswith("clicks_per_user batch 1 (epoch 0) committed: 2 inputs, 200 records read"), said
    # Inside Airflow's frame, on the run's own page (issue 49: it opened the bare console page).
    assert events[said[0] + 1] == f"Console: http://127.0.0.1:{live.port}/dags/clicks_per_user/runs/{quote(run_id, safe='')}/plugin/microbatch-run", events
    errors = [r for r in records if str(r.get("level", "")).lower() in ("error", "critical")]
    assert errors == [], errors
    assert not any("log4j" in str(r.get("event")) or "NativeCodeLoader" in str(r.get("event")) for r in records)
    downstream = live.wait_for_runs("clicks_per_user_downstream", 1)
    assert downstream[0]["state"] == "success" and downstream[0]["run_type"] == "asset_triggered"
    # Read the events only now: Airflow 3.3.2's GET /assets/events answers 500
    # while a run the event created is still queued (its start_date is null).
    (event,) = [e for e in live.asset_events() if e["source_dag_id"] == "clicks_per_user"]
    assert event["extra"]["batch_id"] == 1 and event["extra"]["end_offsets"] == {"files": 2}
    assert event["extra"]["state_version"] == summary["state_version"]
    # The console links the batch to the run its event triggered.
    (batch,) = live.api("GET", "/microbatch/api/pipelines/clicks_per_user/batches?group=batch", user="viewer")
    assert batch["downstream_runs"] == [{"dag_id": "clicks_per_user_downstream", "run_id": downstream[0]["dag_run_id"], "state": "success"}]


def test_the_executors_workers_hold_what_a_task_imports(live):
    """Each task is forked from a LocalExecutor worker, and the workers start
    from a forkserver that imported `microbatch_airflow.task_imports`: they
    hold delta-rs, pyarrow and Spark Connect's gRPC client already, so no task
    imports them again (the test above ran a task, so workers exist)."""
    scheduler = os.getsid(live.procs[live.components.index("scheduler")].pid)  # its session: the workers' too
    workers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            # (Not by environment: a process title longer than the command
            # line is written over the environment's first bytes.)
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"airflow worker -- LocalExecutor") and os.getsid(int(pid)) == scheduler:
                workers.append((pid, Path(f"/proc/{pid}/maps").read_text()))
        except OSError:
            continue
    assert workers, "no LocalExecutor worker: run after a task ran (the test above)"
    for pid, maps in workers:
        for library in ("deltalake/_internal", "grpc/_cython/cygrpc", "pyarrow/libarrow.so"):
            assert library in maps, (pid, library)


def test_bad_param_is_refused_at_trigger_time(live):
    with pytest.raises(AssertionError, match="-> 400"):
        live.trigger("clicks_per_user", {"max_files": 0})


def test_no_trigger_form_field_is_marked_required(live):
    # The UI marks a param required (red asterisk) when its schema's type
    # excludes null; every field of the form is optional.
    params = live.api("GET", "/api/v2/dags/clicks_per_user/details")["params"]
    assert set(params) == {"max_files", "max_records", "rewind_to_batch", "rewind_only", "dry_run"}
    required = [name for name, p in params.items() if "null" not in (p["schema"]["type"] if isinstance(p["schema"]["type"], list) else [p["schema"]["type"]])]
    assert required == []
    assert params["dry_run"]["value"] is False and "boolean" in params["dry_run"]["schema"]["type"]


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
    assert summary["status"] == "no_new_data" and summary["committed_by_earlier_attempts"] == summary["events_sent_now"] == [2]
    assert_exact(spec_file)
    assert len(_committed(spec_file)) == 2
    # Attempt 1 died before it could emit batch 2's asset event: attempt 2 sent it.
    live.wait_for_runs("clicks_per_user_downstream", 2)
    batches = sorted(e["extra"]["batch_id"] for e in live.asset_events() if e["source_dag_id"] == "clicks_per_user")
    assert batches == [1, 2]


def test_a_task_marked_failed_stops_at_the_next_boundary(live):
    """Marking a running task failed in the UI: Airflow's supervisor sends
    SIGTERM, the task runner calls the operator's `on_kill`, and the run stops
    at its next protocol boundary with nothing written; the next run is exact."""
    spec_file = live.root / "pipelines" / "stopped_clicks.yaml"
    write_wave(spec_file.parent / "landing_stopped", 0, files=2, records_per_file=100)
    hold = live.root / "hold"
    hold.touch()
    try:
        live.unpause("stopped_clicks")
        run_id = live.trigger("stopped_clicks", {})

        def held() -> bool:
            try:
                records = live.task_log("stopped_clicks", run_id)
            except AssertionError:
                return False
            return any("hold after_plan" in str(r) for r in records)

        live.wait(held, 300, "the run to hold after planning")
        # The console tells a plan being run from one left behind by asking Airflow for its run.
        (planned,) = live.api("GET", "/microbatch/api/pipelines/stopped_clicks/batches?group=batch", user="viewer")
        assert (planned["batch_id"], planned["phase"], planned["run_state"], planned["in_flight"]) == (1, "pending", "running", True)
        path = f"/api/v2/dags/stopped_clicks/dagRuns/{quote(run_id)}/taskInstances/run_batch"
        live.api("PATCH", path, {"new_state": "failed"})
        live.wait(lambda: live.runs("stopped_clicks")[-1]["state"] == "failed", 120, "the run to fail")
        (left,) = live.api("GET", "/microbatch/api/pipelines/stopped_clicks/batches?group=batch", user="viewer")
        assert (left["phase"], left["run_state"], left["in_flight"]) == ("pending", "failed", False)

        def stopped() -> list[str]:
            return [str(r) for r in live.task_log("stopped_clicks", run_id)]

        live.wait(lambda: any("terminated (SIGTERM): stopped after plan" in e for e in stopped()), 60, "the stop to be logged")
        events = stopped()
        assert any("stop requested: the run stops at its next protocol boundary" in e for e in events), events
        # Stopped on its own at the boundary, before the supervisor's SIGKILL.
        assert not any("escalating" in e for e in events), events
    finally:
        hold.unlink(missing_ok=True)
    assert _committed(spec_file) == []
    assert not (spec_file.parent / "lake" / "stopped").exists()
    run_id = live.trigger("stopped_clicks", {})
    runs = live.wait_for_runs("stopped_clicks", 2)
    assert [r["state"] for r in runs if r["dag_run_id"] == run_id] == ["success"], live.logs()
    assert_exact(spec_file)


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
    created = live.airflow(*args)
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
    # One command, as a user types it: on PostgreSQL nothing makes it fail
    # half-way and want a retry (dev/postgres.py says why SQLite did).
    again = live.airflow(*args, "--reprocess-behavior", "completed")
    assert again.returncode == 0, again.stderr[-2000:]
    live.wait_for_backfills("yearly_clicks", timeout=600)  # reprocessing clears and re-runs the same runs
    runs = live.wait_for_runs("yearly_clicks", 4)
    assert all(r["state"] == "success" for r in runs), live.logs("yearly_clicks")
    assert len(live.api("GET", "/api/v2/backfills?dag_id=yearly_clicks")["backfills"]) == 2
    for run in (r for r in runs if r["run_type"] == "backfill"):
        (ti,) = live.task_instances("yearly_clicks", run["dag_run_id"])
        assert ti["try_number"] == 2, f"{run['dag_run_id']} ran {ti['try_number']} times\n{live.run_story('yearly_clicks', run['dag_run_id'], [again])}"
        outcome = live.xcom("yearly_clicks", run["dag_run_id"])
        assert outcome["status"] == "no_new_data" and "already covered" in outcome["message"]
        # Issue 49: the re-run announced its interval's batch a second time, and downstream DAGs ran twice.
        assert len(outcome["committed_by_earlier_attempts"]) == 1 and outcome["events_sent_now"] == [], outcome
        # Issue 65: it turned "skipped" in the grid, though its run produced that batch.
        assert ti["state"] == "success", ti
    assert len(_committed(spec_file)) == 3
    assert_exact(spec_file)
    announced = [(e["extra"]["epoch"], e["extra"]["batch_id"]) for e in live.asset_events() if e["source_dag_id"] == "yearly_clicks"]
    assert sorted(announced) == [(0, 1), (0, 2), (0, 3)], "each batch's asset event once"


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
    # Nothing new: the sensor times out (30 s) and soft-fails, so the batch is skipped.
    second = live.trigger("waiting_clicks", {})
    live.wait_for_runs("waiting_clicks", 2, timeout=400)
    states = {t["task_id"]: t["state"] for t in live.task_instances("waiting_clicks", second)}
    assert states == {"wait_for_data": "skipped", "run_batch": "skipped"}


def test_run_on_data_makes_no_run_until_data_lands_then_one_run_per_landing(live):
    """`airflow.run_on_data`: the triggerer's watcher, not a clock, creates the runs."""
    import time

    spec_file = live.root / "pipelines" / "watched_clicks.yaml"
    live.unpause("watched_clicks")
    time.sleep(8)  # four polls of the watcher with nothing in its folder
    assert live.runs("watched_clicks") == [], "nothing arrived: no run"
    land_at_once(spec_file.parent / "landing_watched", 0, files=2, records_per_file=30)
    (run,) = live.wait_for_runs("watched_clicks", 1, timeout=240)
    assert run["state"] == "success" and run["run_type"] == "asset_triggered", live.logs("watched_clicks")
    assert assert_exact(spec_file)[-1].batch_id == 1
    write_wave(spec_file.parent / "landing_watched", 1, files=1, records_per_file=30)
    runs = live.wait_for_runs("watched_clicks", 2, timeout=240)
    assert [r["state"] for r in runs] == ["success", "success"], live.logs("watched_clicks")
    assert assert_exact(spec_file)[-1].batch_id == 2
    time.sleep(6)
    assert len(live.runs("watched_clicks")) == 2, "each landing made one run, and the batches starting none"


def test_a_broken_spec_does_not_hide_the_other_pipelines(live):
    """In the real dag-processor: a bad YAML next to good specs is an import
    error of its own file, and every pipeline stays listed and triggerable."""
    bad = live.root / "pipelines" / "broken.yaml"
    written = datetime.now(timezone.utc)
    bad.write_text("name: broken\nsource: [unclosed\n")
    try:
        def reported() -> bool:
            errors = live.api("GET", "/api/v2/importErrors")["import_errors"]
            return any("broken.yaml" in e["stack_trace"] for e in errors)

        live.wait(reported, 120, "the broken spec's import error")
        (error,) = [e for e in live.api("GET", "/api/v2/importErrors")["import_errors"] if "broken.yaml" in e["stack_trace"]]
        assert error["filename"].endswith("microbatch_spec_errors.py") and "not valid YAML" in error["stack_trace"]

        def reparsed() -> bool:
            dag = live.api("GET", "/api/v2/dags/clicks_per_user")
            return datetime.fromisoformat(dag["last_parsed_time"]) > written

        live.wait(reparsed, 120, "the pipelines' file to be parsed again")
        dag = live.api("GET", "/api/v2/dags/clicks_per_user")
        assert dag["is_stale"] is False and dag["has_import_errors"] is False
        listed = {d["dag_id"] for d in live.api("GET", "/api/v2/dags?limit=100")["dags"]}
        assert {"clicks_per_user", "yearly_clicks", "console_clicks"} <= listed
    finally:
        bad.unlink()


def test_a_typo_in_a_live_spec_keeps_its_dag_fails_its_runs_at_once_and_the_console_keeps_its_batches(live):
    """Issue 65: `amount: summ` in a running spec made its DAG vanish within
    90 s, and the console showed no position. In the real dag-processor the
    DAG stays (from the spec's last valid version), a run fails on its first
    try with the spec's error (no retry helps), and the console shows the
    pipeline broken with its position."""
    spec_file = live.root / "pipelines" / "typo_clicks.yaml"
    write_wave(spec_file.parent / "landing_typo", 0, files=1, records_per_file=20)
    live.unpause("typo_clicks")
    live.trigger("typo_clicks", {})
    assert [r["state"] for r in live.wait_for_runs("typo_clicks", 1)] == ["success"], live.logs("typo_clicks")
    good = spec_file.read_text()
    assert "amount: sum" in good
    written = datetime.now(timezone.utc)
    spec_file.write_text(good.replace("amount: sum", "amount: summ"))
    try:
        def reported() -> bool:
            errors = live.api("GET", "/api/v2/importErrors")["import_errors"]
            return any("typo_clicks.yaml" in e["stack_trace"] for e in errors)

        live.wait(reported, 120, "the typo's import error")

        def reparsed() -> bool:
            dag = live.api("GET", "/api/v2/dags/typo_clicks")
            return datetime.fromisoformat(dag["last_parsed_time"]) > written and dag["description"].startswith("SPEC BROKEN")

        live.wait(reparsed, 120, "the pipelines' file to be parsed again, with the broken spec")
        dag = live.api("GET", "/api/v2/dags/typo_clicks")
        assert dag["is_stale"] is False and dag["is_paused"] is False
        run_id = live.trigger("typo_clicks", {})
        runs = live.wait_for_runs("typo_clicks", 2)
        assert runs[-1]["dag_run_id"] == run_id and runs[-1]["state"] == "failed"
        (task,) = live.task_instances("typo_clicks", run_id)
        assert task["state"] == "failed" and task["try_number"] == 1, "a spec's error is not retried"
        logged = " ".join(str(r) for r in live.task_log("typo_clicks", run_id))  # (the exception is in error_detail)
        assert "summ" in logged and "state.merge" in logged
        shown = live.pipelines()["typo_clicks"]
        assert shown["status"] == "broken" and shown["dag_id"] == "typo_clicks"
        assert (shown["epoch"], shown["batch_id"]) == (0, 1)
        assert "runs fail until the spec is fixed" in shown["problems"][0] and "summ" in shown["problems"][0]
    finally:
        spec_file.write_text(good)
    assert assert_exact(spec_file)[-1].batch_id == 1, "the failed run wrote nothing"


# -- the console -------------------------------------------------------------------


def _console_batches(live) -> list[dict]:
    spec_file = live.root / "pipelines" / "console_clicks.yaml"
    landing = spec_file.parent / "landing_console"
    if not _committed(spec_file):
        write_wave(landing, 0, files=2, records_per_file=50, bad_every=10)  # 10 quarantined
        write_wave(landing, 1, files=1, records_per_file=50, bad_every=10)  # 5 quarantined
        live.unpause("console_clicks")
        live.trigger("console_clicks", {})
        live.wait_for_runs("console_clicks", 1)
        live.trigger("console_clicks", {})
        runs = live.wait_for_runs("console_clicks", 2)
        assert [r["state"] for r in runs] == ["success", "success"], live.logs()
    return _committed(spec_file)


def test_console_api_shows_the_checkpoint_to_viewers_and_refuses_strangers(live):
    committed = _console_batches(live)
    assert [r.batch_id for r in committed] == [1, 2]
    with pytest.raises(AssertionError, match="-> 401"):
        live.api("GET", "/microbatch/api/pipelines", user=None)
    pipelines = live.pipelines()
    mine = pipelines["console_clicks"]
    assert mine["dag_id"] == "console_clicks" and mine["epoch"] == 0 and mine["batch_id"] == 2
    assert mine["status"] == "up to date" and mine["problems"] == []
    assert mine["state_version"] == committed[-1].state_version
    assert mine["lag"]["count"] == 0 and mine["lag"]["unit"] == "files" and mine["lag"]["oldest_age_s"] is None
    assert mine["last_committed_at"] == committed[-1].committed_at.isoformat()

    # Batches: the fields of `microbatch history --json`, newest last, read by position.
    rows = live.api("GET", "/microbatch/api/pipelines/console_clicks/batches?limit=10", user="viewer")
    assert [(r["batch_id"], r["status"]) for r in rows] == [(1, "planned"), (1, "committed"), (2, "planned"), (2, "committed")]
    assert set(rows[1]) == set(committed[0].to_dict()) | {"live", "rewound_in_epoch"}
    assert [r["live"] for r in rows] == [False, True, False, True]
    assert rows[1]["records_in"] == 100 and rows[1]["records_quarantined"] == 10 and rows[1]["waiting_after"] == 1
    assert rows[3]["waiting_after"] == 0
    (last,) = live.api("GET", "/microbatch/api/pipelines/console_clicks/batches?limit=1", user="viewer")
    assert (last["batch_id"], last["status"]) == (2, "committed")

    # Quarantine of batch 1: every malformed line, with its file and line, counted by reason.
    q = live.api("GET", "/microbatch/api/pipelines/console_clicks/quarantine?batch_id=1", user="viewer")
    assert q["total"] == 10 and sum(q["by_reason"].values()) == 10 and len(q["rows"]) == 10
    assert all(r["file"].endswith(".json") and r["line"] % 10 == 0 and r["raw"] for r in q["rows"])
    assert live.api("GET", "/microbatch/api/pipelines/console_clicks/quarantine?batch_id=2", user="viewer")["total"] == 5
    # One entry per batch: its commit (with the plan's time), what it read, its links.
    grouped = live.api("GET", "/microbatch/api/pipelines/console_clicks/batches?group=batch", user="viewer")
    assert [(b["batch_id"], b["phase"], b["live"]) for b in grouped] == [(1, "committed", True), (2, "committed", True)]
    assert grouped[0]["input_count"] == 2 and all(name.endswith(".json") for name in grouped[0]["inputs"])
    assert grouped[0]["planned_at"] and grouped[0]["arrival_to_commit_s"] >= 0
    # CSV export of every record of the filter (here: one batch).
    header, *lines = live.api_text("/microbatch/api/pipelines/console_clicks/quarantine?batch_id=1&format=csv", user="viewer").splitlines()
    assert header == "epoch,batch_id,file,line,reason,raw,quarantined_at" and len(lines) == 10
    # A lag alert turns the status red, with the reason as the problem.
    alerting = pipelines["alerting_clicks"]
    assert alerting["status"] == "lagging" and "at or over the alert threshold of 1" in alerting["problems"][0]

    # Rewind: the viewer may look but not trigger; a stranger is not let in at all.
    with pytest.raises(AssertionError, match="-> 403"):
        live.api("POST", "/microbatch/api/pipelines/console_clicks/rewind", {"batch_id": 1}, user="viewer")
    with pytest.raises(AssertionError, match="-> 401"):
        live.api("POST", "/microbatch/api/pipelines/console_clicks/rewind", {"batch_id": 1}, user=None)
    with pytest.raises(AssertionError, match="-> 409"):
        live.api("POST", "/microbatch/api/pipelines/console_clicks/rewind", {"batch_id": 7}, user="admin")

    # The admin's rewind is a DAG run like any other, triggered through Airflow's API as the admin:
    # the configured API server's, whatever Host the request names (here a closed port).
    run = live.api("POST", "/microbatch/api/pipelines/console_clicks/rewind", {"batch_id": 1}, user="admin", host=f"127.0.0.1:{free_port()}")
    assert run["conf"] == {"rewind_to_batch": 1, "rewind_only": True} and run["triggering_user_name"] == "admin"
    runs = live.wait_for_runs("console_clicks", 3)
    assert [r["state"] for r in runs if r["dag_run_id"] == run["dag_run_id"]] == ["success"], live.logs()
    assert live.xcom("console_clicks", run["dag_run_id"])["rewound_to_batch"] == 1
    newest = live.api("GET", "/microbatch/api/pipelines/console_clicks/batches?limit=10", user="viewer")[-1]
    assert (newest["epoch"], newest["batch_id"], newest["status"]) == (1, 1, "rewound")
    # The task links to its batch in the console.
    links = live.api("GET", f"/api/v2/dags/console_clicks/dagRuns/{runs[0]['dag_run_id']}/taskInstances/run_batch/links")
    assert links["extra_links"]["Micro-batch console"] == f"/dags/console_clicks/runs/{quote(runs[0]['dag_run_id'], safe='')}/plugin/microbatch-run"


def _console_replayed(live) -> list:
    """console_clicks after "Rewind here" on batch 1 and a replay: epoch 0's
    batch 2 is no longer in the state, epoch 1's batch 2 read its file again."""
    spec_file = live.root / "pipelines" / "console_clicks.yaml"
    _console_batches(live)
    spec = load_spec(spec_file)
    if not any(r.status == RowStatus.REWOUND for r in OffsetLedger(spec.ledger_path, spec.name).load().rows):
        live.api("POST", "/microbatch/api/pipelines/console_clicks/rewind", {"batch_id": 1}, user="admin")
        live.wait_for_runs("console_clicks", 3)
    if not any(r.epoch == 1 for r in _committed(spec_file)):
        live.trigger("console_clicks", {})
        runs = live.wait_for_runs("console_clicks", 4)
        assert all(r["state"] == "success" for r in runs), live.logs("console_clicks")
    return _committed(spec_file)


def test_console_page_renders_batches_charts_and_quarantine_in_chromium(live, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("needs the Debian package chromium (apt-get install chromium); `make test` installs it as root")
    from zoneinfo import ZoneInfo

    from playwright.sync_api import sync_playwright

    committed = _console_replayed(live)
    shots = ROOT / "docs" if os.environ.get("MICROBATCH_UPDATE_SCREENSHOTS") else tmp_path
    base = f"http://127.0.0.1:{live.port}"
    first_run = live.runs("console_clicks")[0]["dag_run_id"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])

        def viewer_page(width: int, height: int, *, zone: str = "Asia/Kolkata", theme: str = "light"):
            """The viewer, logged in as the UI logs in (its JWT in the session
            cookie), with Airflow's display settings where the UI keeps them."""
            context = browser.new_context(viewport={"width": width, "height": height})
            context.add_cookies([{"name": "_token", "value": live.token("viewer"), "url": base}])
            context.add_init_script(f"localStorage.setItem('timezone', JSON.stringify({zone!r})); localStorage.setItem('theme', {theme!r});")
            page = context.new_page()
            page.goto(f"{base}/microbatch/?dag_id=console_clicks&run_id={quote(first_run)}")
            page.wait_for_selector("#pipelines tr[data-name=console_clicks] .badge.up-to-date", timeout=60_000)
            page.wait_for_selector("#quarantine tbody tr")
            return page

        try:
            # Anonymous: the page asks to log in, and shows no data.
            page = browser.new_page()
            response = page.goto(f"{base}/microbatch/")
            assert response.status == 401 and "Log in" in page.content()

            page = viewer_page(1400, 1100)
            # One row per batch, newest first; the batch the rewind cut is greyed and says so.
            rows = page.locator("#batches tbody tr[data-batch]").evaluate_all("rows => rows.map(r => r.dataset.batch)")
            assert rows == ["1.2", "1.1", "0.2", "0.1"]
            dead = page.locator('#batches tr[data-batch="0.2"]')
            assert "dead" in dead.get_attribute("class") and dead.locator(".badge").inner_text() == "rewound in epoch 1"
            assert page.locator('#batches tr[data-batch="1.2"] .badge').inner_text() == "committed"
            assert page.locator('#batches tr[data-batch="1.1"] .badge').inner_text() == "rewind to 1"
            assert page.locator("#batches tr.highlight").get_attribute("data-batch") == "0.1"  # the linked run's batch
            # Charts: the live lineage only, each batch labelled; the rewound one on request, greyed.
            assert page.locator("#chart-records rect.bar").count() == 2
            assert page.locator("#chart-records text.tick").all_text_contents() == ["1", "2/e1"]
            assert page.locator("#chart-duration circle.dot").count() == 2
            page.locator("#show-rewound").check()
            assert page.locator("#chart-records rect.bar").count() == 3 and page.locator("#chart-records rect.bar.dead").count() == 1
            page.locator("#show-rewound").uncheck()
            # Quarantine: the live batches' records (10 + 5), the rewound batch's 5 on request.
            assert page.locator("#quarantine-scope").inner_text().startswith("15 record(s) in the live batches")
            assert page.locator("#quarantine tbody tr").count() == 15
            assert set(page.locator("#quarantine tbody tr td:nth-child(2)").all_inner_texts()) == {"0", "1"}  # the epoch column
            page.locator("#quarantine-all").check()
            page.wait_for_function("document.querySelector('#quarantine-scope').textContent.startsWith('20 record(s)')")
            page.locator("#quarantine-search").fill("line 999999")
            assert page.locator("#quarantine tbody tr").count() == 0
            page.locator("#quarantine-search").fill("")
            page.locator("#quarantine-all").uncheck()
            page.wait_for_function("document.querySelector('#quarantine-scope').textContent.startsWith('15 record(s)')")
            # A reason asks the API for its records.
            page.locator("#reasons button").first.click()
            page.wait_for_selector("#reasons button.active")
            page.wait_for_function("document.querySelectorAll('#quarantine tbody tr').length < 15")
            assert len(set(page.locator("#quarantine tbody tr td:nth-child(4)").all_inner_texts())) == 1
            page.locator("#reasons button.active").click()
            page.wait_for_function("document.querySelectorAll('#quarantine tbody tr').length == 15")
            assert "format=csv" in page.locator("#quarantine-csv").get_attribute("href")
            # A batch's row opens what it read, its times in Airflow's time zone on a 24-hour clock, and its links.
            page.locator('#batches tr[data-batch="1.2"]').click()
            details = page.locator('#batches tr[data-details="1.2"]')
            replay = next(r for r in committed if r.epoch == 1)
            shown = replay.committed_at.astimezone(ZoneInfo("Asia/Kolkata")).strftime("%Y-%m-%d %H:%M:%S")
            assert f"committed {shown}" in details.inner_text()
            assert details.locator("ul.inputs li").count() == 1 and ".json" in details.locator("ul.inputs li").inner_text()
            # Event time: the batch's late count and the watermark it left; the pipeline's watermark.
            watermark = replay.watermark.astimezone(ZoneInfo("Asia/Kolkata")).strftime("%Y-%m-%d %H:%M:%S")
            assert details.locator(".event-time").inner_text() == f"event time: 0 late record(s); watermark after it {watermark}"
            assert f"event time: watermark {watermark} (older records: accept)" in page.locator("#detail-source").inner_text()
            assert "state: merged on read (Delta deletion vectors: its readers need Delta 2.3 or later)" in page.locator("#detail-source").inner_text()
            log = details.locator("a", has_text="task log").get_attribute("href")
            assert log == f"{base}/dags/console_clicks/runs/{quote(replay.run_id)}/tasks/run_batch?try_number=1"
            page.screenshot(path=str(shots / "console.png"), full_page=True)
            # No rewind is offered to the newest batch, where it would change nothing (issue 49).
            assert page.locator('#batches tr[data-batch="1.2"] button.rewind').count() == 0
            assert page.locator('#batches tr[data-batch="0.1"] button.rewind').count() == 1
            # A paused DAG says so, with the way to its switch; one that runs does not.
            shown = set(page.locator("#pipelines tr.pipeline").evaluate_all("rows => rows.map(r => r.dataset.name)"))
            paused = {d["dag_id"]: d["is_paused"] for d in live.api("GET", "/api/v2/dags?tags=microbatch&limit=100")["dags"] if d["dag_id"] in shown}
            for name, is_paused in paused.items():
                note = page.locator(f"#pipelines tr[data-name={name}] a.paused")
                assert note.count() == (1 if is_paused else 0), name
            assert any(paused.values()) and not paused["console_clicks"]
            # The confirmation comes first; cancelling it triggers nothing.
            before = len(live.runs("console_clicks"))
            page.locator("button.rewind").first.click()
            assert page.locator("#rewind-dialog").is_visible()
            page.locator("#rewind-cancel").click()
            assert len(live.runs("console_clicks")) == before

            # A phone: nothing cut off (tables scroll inside the page), problems shown under their pipeline.
            page = viewer_page(390, 844)
            assert page.evaluate("document.documentElement.scrollWidth") <= 390
            problem = page.locator("#pipelines tr.problems[data-name=alerting_clicks]")
            assert problem.is_visible() and "alert threshold" in problem.inner_text()
            box = problem.bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= 390
            assert page.locator("#pipelines tr[data-name=alerting_clicks] .badge").inner_text() == "lagging"
            # The batch table's Rewind buttons are on screen, not past a sideways scroll (issue 49).
            page.locator("#pipelines tr[data-name=console_clicks]").click()
            button = page.locator('#batches tr[data-batch="0.1"] button.rewind')
            button.wait_for()
            # The console's refresh may replace the table between the wait and
            # the measure (a bounding box of None, seen once in make test):
            # the locator finds the new row on the next look.
            box = None
            for _ in range(50):
                box = button.bounding_box()
                if box is not None:
                    break
                time.sleep(0.1)
            assert box is not None and box["x"] + box["width"] <= 390, box
            # Issue 65: a batch's card read "3 22.5 s 3 days 6 3 min ago": every value has its label.
            shown = page.locator('#batches tr[data-batch="0.1"] td').evaluate_all(
                "cells => cells.filter(c => getComputedStyle(c).display !== 'none' && c.textContent.trim())"
                ".map(c => [getComputedStyle(c, '::before').content, c.textContent.trim()])"
            )
            unlabelled = [text for label, text in shown[2:] if label in ("none", "normal", "") and text != "Rewind here"]
            assert not unlabelled and len(shown) >= 8, shown  # (past the batch's name and status)
            page.screenshot(path=str(shots / "console-narrow.png"), full_page=True)

            # Airflow's dark mode.
            page = viewer_page(1400, 900, theme="dark")
            assert page.evaluate("document.documentElement.classList.contains('dark')")
            assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(26, 32, 44)"
            page.screenshot(path=str(shots / "console-dark.png"))

            # A rewind from the page (issue 49: the dialog closed, nothing else): the
            # run it triggered, linked, followed until it ends, then what it did.
            # Issue 65: low on the page, with the DAG paused: the feedback shows
            # where the user is, and says the run waits for the switch, with a
            # button that unpauses.
            live.api("PATCH", "/api/v2/dags/console_clicks", {"is_paused": True})
            context = browser.new_context(viewport={"width": 1400, "height": 600})
            context.add_cookies([{"name": "_token", "value": live.token("admin"), "url": base}])
            page = context.new_page()
            page.goto(f"{base}/microbatch/?dag_id=console_clicks")
            page.wait_for_selector("#pipelines tr[data-name=console_clicks] a.paused")
            button = page.locator('#batches tr[data-batch="0.1"] button.rewind')
            button.scroll_into_view_if_needed()
            assert page.evaluate("window.scrollY") > 300, "the button is low on the page"
            button.click()
            assert page.locator("#rewind-paused").is_visible()
            page.locator("#rewind-confirm").click()
            status = page.locator("#rewind-status")
            status.locator("a").wait_for()
            assert status.locator("a").get_attribute("href").startswith(f"{base}/dags/console_clicks/runs/")
            page.locator("#rewind-status .paused-note").wait_for(timeout=60_000)
            box = status.bounding_box()
            assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 600, box
            assert "its DAG is paused: this run waits until it is unpaused" in status.inner_text()
            page.screenshot(path=str(shots / "console-rewind-paused.png"))
            status.locator("button.unpause").click()
            page.wait_for_function("document.querySelector('#rewind-status').textContent.includes('done:')", timeout=180_000)
            assert "batch 2 of epoch 1 left the state; now epoch 2, at batch 1" in status.inner_text(), status.inner_text()
            assert status.locator(".badge").inner_text() == "success"
            page.screenshot(path=str(shots / "console-rewind.png"))

            # Inside Airflow's own UI: the nav entry's page embeds the console.
            page.goto(f"{base}/plugin/microbatch")
            page.frame_locator("iframe").locator("#pipelines tbody tr").first.wait_for()
            page.frame_locator("iframe").locator("#batches tbody tr[data-batch]").first.wait_for()
            page.screenshot(path=str(shots / "console-in-airflow.png"))
            # Where a task's log and its extra link lead: the run's own tab in Airflow, its batch opened.
            page.goto(f"{base}/dags/console_clicks/runs/{quote(first_run, safe='')}/plugin/microbatch-run")
            frame = page.frame_locator("iframe")
            frame.locator('#batches tr.highlight[data-batch="0.1"]').wait_for()
            frame.locator('#batches tr[data-details="0.1"]').wait_for()
            page.screenshot(path=str(shots / "console-run-tab.png"))
        finally:
            browser.close()
