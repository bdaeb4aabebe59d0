"""`dag.test()` runs real batches (Spark + Delta) through the operator."""

from __future__ import annotations

import pytest

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.spec import load_spec
from tests.conftest import ROOT, assert_exact, oracle_spec_dict, write_spec


@pytest.fixture
def dag_for(monkeypatch):
    """The pipeline's DAG as Airflow parses it (dag.test() re-parses the DAG folder)."""

    def get(spec_path):
        from airflow.dag_processing.dagbag import DagBag

        monkeypatch.setenv("MICROBATCH_PIPELINES_DIR", str(spec_path.parent))
        return DagBag(dag_folder=str(ROOT / "dags")).dags[load_spec(spec_path).name]

    return get


def _ti(run, task_id="run_batch"):
    return next(ti for ti in run.get_task_instances() if ti.task_id == task_id)


def test_dag_test_runs_a_batch_and_the_ledger_advances(spec_path, spark, airflow_db, dag_for):
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=100)
    run = dag_for(spec_path).test()
    assert run.state == "success"
    spec = load_spec(spec_path)
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    committed = [r for r in rows if r.status == RowStatus.COMMITTED]
    assert len(committed) == 1 and committed[0].run_id == run.run_id and committed[0].records_in == 200
    assert_exact(spec_path)
    # Nothing new: still a success, and the ledger does not move.
    assert dag_for(spec_path).test().state == "success"
    assert len(OffsetLedger(spec.ledger_path, spec.name).load().rows) == len(rows)


def test_a_batch_over_its_quarantine_limit_commits_announces_and_fails_without_retry(tmp_path, spark, airflow_db, dag_for):
    """Issue 65: a batch that quarantined records ended green with an INFO
    line. Past the spec's limit it still commits and `run_batch` sends its
    asset event (with the counts: Airflow sends events only with a task's
    success), then the run's `check_quarantine` task fails on its first
    try; with `warn` the run succeeds and its summary says so."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    path = write_spec(tmp_path, oracle_spec_dict(quarantine={"max_fraction": 0.05}))
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=100, bad_every=10)
    dag = dag_for(path)
    assert [t.task_id for t in dag.get_task("run_batch").downstream_list] == ["check_quarantine"]
    run = dag.test()
    assert run.state == "failed"
    assert _ti(run).state == "success"
    check = _ti(run, "check_quarantine")
    assert check.state == "failed" and check.try_number == 1
    spec = load_spec(path)
    (row,) = [r for r in OffsetLedger(spec.ledger_path, spec.name).load().rows if r.status == RowStatus.COMMITTED]
    assert row.batch_id == 1 and row.records_quarantined == 10, "the batch committed, its bad records kept"
    assert_exact(path)
    with create_session() as session:
        extras = [e.extra for e in session.query(AssetEvent).filter(AssetEvent.source_run_id == run.run_id).all()]
    (extra,) = extras
    assert extra["batch_id"] == 1 and extra["records_quarantined"] == 10 and extra["records_in"] >= 100
    assert "over quarantine.max_fraction (0.05: " in extra["quarantine_over_limit"]
    assert "over quarantine.max_fraction" in _ti(run).xcom_pull(task_ids="run_batch")["quarantine_over_limit"]
    # With `warn` (a free change: no refusal), the next such batch succeeds and its summary says so.
    write_spec(tmp_path, oracle_spec_dict(quarantine={"max_fraction": 0.05, "on_exceed": "warn"}))
    write_wave(tmp_path / "landing", 1, files=1, records_per_file=100, bad_every=10)
    dag = dag_for(path)
    assert [t.task_id for t in dag.tasks] == ["run_batch"]
    run = dag.test()
    assert run.state == "success"
    assert "over quarantine.max_fraction" in _ti(run).xcom_pull(task_ids="run_batch")["quarantine_over_limit"]


def test_dry_run_commits_nothing(spec_path, spark, airflow_db, dag_for):
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=10)
    run = dag_for(spec_path).test(run_conf={"dry_run": True})
    assert run.state == "success"
    assert not (spec_path.parent / "lake").exists()


def test_bad_param_fails_without_retry(spec_path, spark, airflow_db, dag_for):
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    assert dag_for(spec_path).test().state == "success"
    run = dag_for(spec_path).test(run_conf={"rewind_to_batch": 7})  # only batch 1 exists
    assert run.state == "failed"
    ti = _ti(run)
    assert ti.state == "failed" and ti.try_number == 1


def test_rewind_param_then_processes(spec_path, spark, airflow_db, dag_for):
    landing = spec_path.parent / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=1, records_per_file=50)
        assert dag_for(spec_path).test().state == "success"
    run = dag_for(spec_path).test(run_conf={"rewind_to_batch": 1})
    assert run.state == "success"
    lineage = assert_exact(spec_path)
    assert [(r.epoch, r.batch_id) for r in lineage] == [(0, 1), (1, 2)]


def test_the_maintenance_dag_maintains_the_pipeline(tmp_path, airflow_db, monkeypatch):
    """A spec with `airflow.maintenance_schedule` gets its own DAG running `microbatch maintain`."""
    from airflow.dag_processing.dagbag import DagBag

    from spark_jobs.core.protocol import RunOptions, run_batch
    from tests.conftest import oracle_spec_dict, write_spec
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec_path = write_spec(tmp_path, oracle_spec_dict(maintenance={"keep_batches": 1}, airflow={"maintenance_schedule": "@daily"}))
    spec = load_spec(spec_path)
    for wave in range(3):
        write_wave(spec_path.parent / "landing", wave, files=1, records_per_file=20)
        assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
    monkeypatch.setenv("MICROBATCH_PIPELINES_DIR", str(tmp_path))
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    dag = bag.dags["clicks_maintenance"]
    assert "maintenance" in dag.tags and [t.task_id for t in dag.tasks] == ["maintain"]
    run = dag.test()
    assert run.state == "success"
    from spark_jobs.core.inspect import status

    assert status(spec).oldest_rewindable == 3
    assert_exact(spec_path)


def test_a_kafka_source_takes_its_settings_and_secrets_from_an_airflow_connection(tmp_path, spark, airflow_db, dag_for, monkeypatch, capfd):
    """The spec names a broker that does not answer and no secret; the
    connection (the apache-kafka provider's type, its extra the settings)
    names the real one. The secret reaches librdkafka, not XCom, logs or tables."""
    import json

    import yaml

    from tests.spark_jobs.sources.test_kafka import events, produce, spec_file, start_cluster, stop_cluster

    secret = "conn-secret-7d1e93aa"  # noqa: S105 - a marker to search for
    server, servers = start_cluster()
    try:
        produce(servers, "conn-clicks", events(0, 40))
        path = spec_file(tmp_path, "127.0.0.1:1", "conn-clicks")
        spec = yaml.safe_load(path.read_text())
        spec["airflow"] = {"kafka_conn_id": "kafka_clicks"}
        path.write_text(yaml.safe_dump(spec))
        extra = {"bootstrap.servers": servers, "client.id": "microbatch-test", "sasl.password": secret}
        monkeypatch.setenv("AIRFLOW_CONN_KAFKA_CLICKS", json.dumps({"conn_type": "kafka", "extra": extra}))
        run = dag_for(path).test()
        assert run.state == "success"
        ti = _ti(run)
        summary = ti.xcom_pull(task_ids="run_batch")
        assert summary["status"] == "committed" and summary["records_in"] == 40
        assert secret not in json.dumps(summary, default=str)
        out, err = capfd.readouterr()
        assert secret not in out + err
        for f in tmp_path.rglob("*"):
            assert not f.is_file() or f.suffix == ".yaml" or secret.encode() not in f.read_bytes(), f"secret in {f}"
    finally:
        stop_cluster(server)


def test_unknown_run_parameters_fail_naming_the_known_ones(spec_path, airflow_db, dag_for):
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=10)
    run = dag_for(spec_path).test(run_conf={"max_file": 2})
    ti = _ti(run)
    assert run.state == "failed" and ti.try_number == 1, "not retried"
    assert not (spec_path.parent / "lake").exists(), "nothing read or written"


def test_rewind_only_rewinds_and_stops_and_says_so(spec_path, spark, airflow_db, dag_for):
    landing = spec_path.parent / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=1, records_per_file=50)
        assert dag_for(spec_path).test().state == "success"
    run = dag_for(spec_path).test(run_conf={"rewind_to_batch": 1, "rewind_only": True})
    assert run.state == "success"
    summary = _ti(run).xcom_pull(task_ids="run_batch")
    assert summary["rewound_to_batch"] == 1 and summary["batch_id"] == 1
    spec = load_spec(spec_path)
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    assert view.position.batch_id == 1 and view.position.epoch == 1, "rewound, and nothing processed after it"
    # Then the recipe: the next run recomputes what followed batch 1.
    assert dag_for(spec_path).test().state == "success"
    assert_exact(spec_path)


@pytest.mark.parametrize("run_type", ["backfill", "scheduled"])
def test_a_rewind_in_a_backfill_or_scheduled_run_is_refused_before_anything(spec_path, run_type):
    """Every run of a backfill would apply it: K=0 over dates before the data emptied the state, green."""
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException

    from microbatch_airflow.operators import MicroBatchOperator

    operator = MicroBatchOperator(task_id="run_batch", spec_path=str(spec_path))
    context = {
        "params": {"rewind_to_batch": 0},
        "dag_run": SimpleNamespace(conf={"rewind_to_batch": 0}, run_type=run_type),
        "run_id": f"{run_type}__x",
        "ti": SimpleNamespace(try_number=1),
    }
    with pytest.raises(AirflowFailException, match="rewind_to_batch is refused in"):
        operator.execute(context)
    assert not (spec_path.parent / "lake").exists()


def test_the_example_downstream_dag_counts_each_batch_once():
    """Airflow lists an alias-added event under the asset and the alias."""
    from types import SimpleNamespace

    from microbatch_airflow.assets import new_batches

    first = SimpleNamespace(extra={"pipeline": "clicks", "epoch": 0, "batch_id": 1, "state_version": 1})
    second = SimpleNamespace(extra={"pipeline": "clicks", "epoch": 0, "batch_id": 2, "state_version": 2})
    events = {"asset": [first, second], "alias": [first, second]}
    assert [e["batch_id"] for e in new_batches(events)] == [1, 2]
    source = (ROOT / "dags" / "clicks_per_user_downstream.py").read_text()
    assert "new_batches(triggering_asset_events)" in source


def test_the_dag_docs_show_the_spec(spec_path, airflow_db, dag_for):
    dag = dag_for(spec_path)
    assert "```yaml" in dag.doc_md and "keys `user_id`" in dag.doc_md and spec_path.read_text().strip() in dag.doc_md


def test_stopping_the_task_stops_the_run_at_its_next_boundary(spec_path, airflow_db):
    """Airflow's task runner calls `on_kill` on SIGTERM (a task marked failed)."""
    from microbatch_airflow.operators import MicroBatchOperator
    from spark_jobs.core import shutdown
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.errors import Terminated, is_retryable

    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    MicroBatchOperator(task_id="run_batch", spec_path=str(spec_path)).on_kill()
    try:
        with pytest.raises(Terminated) as caught:
            run_batch(load_spec(spec_path), RunOptions(run_id="stopped"), compute_factory=lambda: None)
        assert is_retryable(caught.value)
    finally:
        shutdown._requested.clear()
    assert not (spec_path.parent / "lake" / "state").exists(), "stopped before anything of the batch was written"


def test_runs_that_do_nothing_end_skipped_with_their_summary(spec_path, spark, airflow_db, dag_for):
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    done = dag_for(spec_path).test()
    assert _ti(done).state == "success"
    idle = dag_for(spec_path).test()
    ti = _ti(idle)
    assert ti.state == "skipped" and idle.state == "success"
    assert ti.xcom_pull(task_ids="run_batch")["status"] == "no_new_data"
    dry = dag_for(spec_path).test(run_conf={"dry_run": True})
    assert _ti(dry).state == "skipped"


def test_a_retry_of_a_rewind_only_run_does_not_process(spec_path):
    """Its earlier attempt rewound and died: the retry must not rewind again, nor go on to process."""
    from types import SimpleNamespace

    from microbatch_airflow.operators import MicroBatchOperator
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.rewind import rewind
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    for wave in range(2):
        write_wave(spec_path.parent / "landing", wave, files=1, records_per_file=20)
        assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
    rewind(spec, 1, run_id="manual__rewind")  # the first attempt, before it died
    write_wave(spec_path.parent / "landing", 2, files=1, records_per_file=20)
    conf = {"rewind_to_batch": 1, "rewind_only": True}
    context = {
        "params": conf,
        "dag_run": SimpleNamespace(conf=conf, run_type="manual"),
        "run_id": "manual__rewind",
        "ti": SimpleNamespace(try_number=2),
    }
    summary = MicroBatchOperator(task_id="run_batch", spec_path=str(spec_path)).execute(context)
    assert summary["status"] == "rewound" and summary["rewound_to_batch"] == 1
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    assert (view.position.epoch, view.position.batch_id) == (1, 1), "neither rewound twice nor processed"
