"""DAG parsing: the examples import cleanly, broken specs become readable import errors."""

from __future__ import annotations

import time
import uuid

import pytest
import yaml

from tests.conftest import ROOT, oracle_spec_dict, write_spec


def _dagbag(monkeypatch, folder=None):
    from airflow.dag_processing.dagbag import DagBag

    if folder is not None:
        monkeypatch.setenv("MICROBATCH_PIPELINES_DIR", str(folder))
    return DagBag(dag_folder=str(ROOT / "dags"))


def test_example_dags_import_without_errors(monkeypatch):
    monkeypatch.delenv("MICROBATCH_PIPELINES_DIR", raising=False)
    start = time.perf_counter()
    bag = _dagbag(monkeypatch)
    seconds = time.perf_counter() - start
    print(f"parsed {len(bag.dag_ids)} DAGs in {seconds:.3f} s")  # a figure, not an assert
    assert bag.import_errors == {}
    assert {"clicks_per_user", "clicks_per_user_downstream", "clicks_per_domain"} <= set(bag.dag_ids)
    dag = bag.dags["clicks_per_user"]
    assert dag.max_active_runs == 1
    assert "microbatch" in dag.tags
    assert "Events, amount and last activity per user." in dag.doc_md
    from microbatch_airflow.operators import RUN_PARAMS

    assert set(dag.params.keys()) == set(RUN_PARAMS), "the trigger form offers exactly what a run accepts"
    assert [t.task_id for t in dag.tasks] == ["run_batch"]


def test_schedule_gets_real_data_intervals(tmp_path, monkeypatch):
    airflow = {"schedule": "0 * * * *", "catchup": True, "start_date": "2026-01-01T00:00:00Z",
               "wait_for_data": {"poll_seconds": 5, "timeout_seconds": 60, "deferrable": True}}
    spec = oracle_spec_dict(airflow=airflow)
    write_spec(tmp_path, spec, "clicks.yaml")
    bag = _dagbag(monkeypatch, tmp_path)
    dag = bag.dags["clicks"]
    assert type(dag.timetable).__name__ == "CronDataIntervalTimetable"
    assert dag.catchup is True
    sensor = dag.get_task("wait_for_data")
    assert sensor.timeout == 60 and sensor.soft_fail and sensor.deferrable
    assert [t.task_id for t in sensor.downstream_list] == ["run_batch"]
    # Without `deferrable` in the spec, Airflow's [operators] default_deferrable decides (False unless set).
    write_spec(tmp_path, {**spec, "airflow": {"wait_for_data": {"poll_seconds": 5}}}, "clicks.yaml")
    assert _dagbag(monkeypatch, tmp_path).dags["clicks"].get_task("wait_for_data").deferrable is False


def test_retries_come_from_the_spec_then_default_args_then_two(tmp_path):
    from datetime import timedelta

    from microbatch_airflow.dag_factory import build_dag
    from spark_jobs.core.spec import load_spec

    plain = load_spec(write_spec(tmp_path / "a", oracle_spec_dict()))
    task = build_dag(plain).get_task("run_batch")
    assert (task.retries, task.retry_delay) == (2, timedelta(seconds=10))
    task = build_dag(plain, default_args={"retries": 5, "retry_delay": timedelta(minutes=3)}).get_task("run_batch")
    assert (task.retries, task.retry_delay) == (5, timedelta(minutes=3))
    own = load_spec(write_spec(tmp_path / "b", oracle_spec_dict(airflow={"retries": 0, "retry_delay_seconds": 45})))
    task = build_dag(own, default_args={"retries": 5}).get_task("run_batch")
    assert (task.retries, task.retry_delay) == (0, timedelta(seconds=45))


def test_old_airflow_fields_say_where_they_moved(tmp_path):
    from spark_jobs.core.spec import load_spec
    from spark_jobs.errors import SpecError

    old = oracle_spec_dict(schedule="@hourly", wait_for_data={"poll_seconds": 5}, engine={"airflow_conn_id": "spark"})
    path = write_spec(tmp_path, old)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert "field `schedule`: moved to `airflow.schedule`" in message
    assert "field `wait_for_data`: moved to `airflow.wait_for_data`" in message
    assert "field `engine.airflow_conn_id`: moved to `airflow.spark_conn_id`" in message
    assert "line " in message


def test_a_bad_airflow_block_is_a_broken_spec_naming_line_and_field(tmp_path, monkeypatch):
    write_spec(tmp_path, oracle_spec_dict(name="good"), "good.yaml")
    write_spec(tmp_path, oracle_spec_dict(name="bad", airflow={"schedule": "every hour", "retrys": 3}), "bad.yaml")
    bag = _dagbag(monkeypatch, tmp_path)
    assert "good" in bag.dag_ids and "bad" not in bag.dag_ids
    (error,) = [e for f, e in bag.import_errors.items() if f.endswith("microbatch_spec_errors.py")]
    assert "bad.yaml" in error
    assert "field `airflow.schedule`: 'every hour' is not a cron expression" in error
    assert "field `airflow.retrys`: is not a known field" in error


def test_broken_spec_is_an_import_error_and_other_dags_still_load(tmp_path, monkeypatch):
    write_spec(tmp_path, oracle_spec_dict(name="good"), "good.yaml")
    bad = oracle_spec_dict(name="bad")
    bad["state"]["merge"]["events"] = "avg"
    write_spec(tmp_path, bad, "bad.yaml")
    (tmp_path / "worse.yaml").write_text("name: [unclosed\n")
    bag = _dagbag(monkeypatch, tmp_path)
    assert "good" in bag.dag_ids
    assert "bad" not in bag.dag_ids
    (path, message), = bag.import_errors.items()
    # Reported by a file that defines no DAG: the dag-processor stales every DAG of a file with an import error.
    assert path.endswith("microbatch_spec_errors.py")
    assert "2 pipeline spec(s) could not be loaded" in message
    assert str(tmp_path / "bad.yaml") in message and "field `state.merge`" in message and "'avg'" in message
    assert str(tmp_path / "worse.yaml") in message and "not valid YAML" in message


def test_a_spec_broken_after_a_valid_parse_keeps_its_dag_and_schedule_and_its_runs_fail_at_once(tmp_path, monkeypatch):
    """Issue 65: a typo in a live spec made its DAG vanish, and a scheduled
    pipeline stopped without one failed task. Its DAG is now built from the
    spec's last valid version, in the full parse and in a task's parse, and
    the run loads the file afresh and fails without a retry."""
    from airflow.sdk.exceptions import AirflowFailException

    from microbatch_airflow.dag_factory import dags_from_folder

    airflow = {"schedule": "0 * * * *", "start_date": "2026-01-01T00:00:00Z"}
    path = write_spec(tmp_path, oracle_spec_dict(name="hourly", airflow=airflow), "hourly.yaml")
    assert "hourly" in _dagbag(monkeypatch, tmp_path).dag_ids  # a parse keeps it valid
    good = path.read_text()
    path.write_text(good.replace("events: sum", "events: summ"))
    bag = _dagbag(monkeypatch, tmp_path)
    dag = bag.dags["hourly"]
    assert type(dag.timetable).__name__ == "CronDataIntervalTimetable" and dag.timetable.expression == "0 * * * *"
    assert dag.description.startswith("SPEC BROKEN") and "'summ'" in dag.doc_md
    (error,) = bag.import_errors.values()
    assert "field `state.merge`" in error and "keeps its DAG" in error
    # A task's parse (Airflow names the DAG) finds it too.
    assert list(dags_from_folder(tmp_path, only="hourly")) == ["hourly"]
    task = dag.get_task("run_batch")
    with pytest.raises(AirflowFailException, match="summ"):  # fails at once: no retry helps
        task._spec()
    # An upgrade of the code (the kept specs' key) while the spec is broken: its last valid text is parsed again.
    from microbatch_airflow import spec_cache

    monkeypatch.setattr(spec_cache, "_code_version", lambda: "upgraded")
    assert _dagbag(monkeypatch, tmp_path).dags["hourly"].description.startswith("SPEC BROKEN")
    # A typo in the `airflow:` block alone fails the run at once too (found by the review: it was retried).
    path.write_text(good.replace("0 * * * *", "every hour"))
    bag = _dagbag(monkeypatch, tmp_path)
    assert bag.dags["hourly"].description.startswith("SPEC BROKEN")
    with pytest.raises(AirflowFailException, match="airflow.schedule"):
        bag.dags["hourly"].get_task("run_batch")._spec()
    # Fixed, it is the file's spec again; a spec that never loaded has no DAG.
    path.write_text(good)
    (tmp_path / "never.yaml").write_text(yaml.safe_dump(oracle_spec_dict(name="never", checkpoint="lake/_c/never")).replace("events: sum", "events: summ"))
    bag = _dagbag(monkeypatch, tmp_path)
    assert not bag.dags["hourly"].description.startswith("SPEC BROKEN")
    assert "never" not in bag.dag_ids


def test_the_example_downstream_stays_while_its_upstreams_spec_is_broken(tmp_path, monkeypatch):
    """Found by the review of issue 65: a typo in clicks_per_user's spec made
    the example downstream DAG's file an import error (it loaded the spec)."""
    path = write_spec(tmp_path, oracle_spec_dict(name="clicks_per_user"), "clicks_per_user.yaml")
    assert "clicks_per_user_downstream" in _dagbag(monkeypatch, tmp_path).dag_ids
    path.write_text(path.read_text().replace("events: sum", "events: summ"))
    bag = _dagbag(monkeypatch, tmp_path)
    assert {"clicks_per_user", "clicks_per_user_downstream"} <= set(bag.dag_ids)
    assert [f for f in bag.import_errors if not f.endswith("microbatch_spec_errors.py")] == []


def test_duplicate_pipeline_names_are_reported(tmp_path, monkeypatch):
    write_spec(tmp_path, oracle_spec_dict(name="same"), "a.yaml")
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(oracle_spec_dict(name="same")))
    bag = _dagbag(monkeypatch, tmp_path)
    assert "same" in bag.dag_ids
    assert "names must be unique" in next(iter(bag.import_errors.values()))


def test_a_pipeline_named_as_another_pipelines_maintenance_dag_is_refused(tmp_path, monkeypatch):
    """Reproduced: pipeline `x_maintenance` and the maintenance DAG of pipeline
    `x` shared a DAG id and overwrote each other."""
    x = oracle_spec_dict(name="x", airflow={"maintenance_schedule": "@daily"})
    write_spec(tmp_path, x, "x.yaml")
    other = oracle_spec_dict(name="x_maintenance", checkpoint="lake/_checkpoints/other")
    write_spec(tmp_path, other, "x_maintenance.yaml")
    bag = _dagbag(monkeypatch, tmp_path)
    assert {"x", "x_maintenance"} <= set(bag.dag_ids)
    assert [t.task_id for t in bag.dags["x_maintenance"].tasks] == ["maintain"], "the maintenance DAG keeps its id"
    (error,) = [e for f, e in bag.import_errors.items() if f.endswith("microbatch_spec_errors.py")]
    assert "x_maintenance.yaml" in error and "is the DAG id of pipeline 'x''s maintenance DAG" in error
    assert "rename this pipeline" in error


def test_a_pipeline_reading_another_pipelines_state_is_scheduled_on_its_asset(monkeypatch):
    """The example chain: clicks_per_domain's Delta source is clicks_per_user's state."""
    monkeypatch.delenv("MICROBATCH_PIPELINES_DIR", raising=False)
    bag = _dagbag(monkeypatch)
    chained = bag.dags["clicks_per_domain"]
    assert type(chained.timetable).__name__ == "AssetTriggeredTimetable"
    assert [a.name for a in chained.timetable.asset_condition.objects] == ["microbatch.clicks_per_user.state"]
    assert type(bag.dags["clicks_per_user"].timetable).__name__ == "CronDataIntervalTimetable"


def test_run_on_data_schedules_the_dag_on_its_source_watcher_and_refuses_a_clock_beside_it(tmp_path, monkeypatch):
    write_spec(tmp_path, oracle_spec_dict(airflow={"run_on_data": {"poll_seconds": 5, "refire_seconds": 120}}), "clicks.yaml")
    both = oracle_spec_dict(name="both", airflow={"run_on_data": {}, "schedule": "@hourly"})
    write_spec(tmp_path, both, "both.yaml")
    waiting = oracle_spec_dict(name="waiting", airflow={"run_on_data": {}, "wait_for_data": {}})
    write_spec(tmp_path, waiting, "waiting.yaml")
    bag = _dagbag(monkeypatch, tmp_path)
    dag = bag.dags["clicks"]
    (asset,) = dag.timetable.asset_condition.objects
    (watcher,) = asset.watchers
    assert asset.name == "microbatch.clicks.new_data" and watcher.trigger.serialize() == (
        "microbatch_airflow.triggers.NewDataEventTrigger",
        {"spec_path": str(tmp_path / "clicks.yaml"), "poll_seconds": 5.0, "refire_seconds": 120.0, "kafka_conn_id": None},
    )
    assert [t.task_id for t in dag.tasks] == ["run_batch"]
    (errors,) = bag.import_errors.values()
    assert "both.yaml" in errors and "field `airflow.run_on_data`: a pipeline runs either on a clock" in errors
    assert "waiting.yaml" in errors and "`airflow.wait_for_data` has nothing to wait for" in errors
    assert {"both", "waiting"}.isdisjoint(bag.dag_ids)


def write_plain_kept_and_chained(folder) -> None:
    """Three specs in `folder`: a plain pipeline, one with a maintenance DAG
    (`kept`), and one chained to `kept`'s state."""
    write_spec(folder, oracle_spec_dict(name="plain", checkpoint="lake/_checkpoints/plain"), "plain.yaml")
    kept = oracle_spec_dict(name="kept", airflow={"maintenance_schedule": "@daily"}, checkpoint="lake/_checkpoints/kept")
    kept["state"]["path"] = "lake/kept"
    write_spec(folder, kept, "kept.yaml")
    chained = {
        "name": "chained",
        "source": {"type": "delta", "path": "lake/kept"},
        "transform": "SELECT user_id, events FROM batch",
        "state": {"path": "lake/chained", "keys": ["user_id"], "merge": {"events": "sum"}},
        "checkpoint": "lake/_checkpoints/chained",
    }
    write_spec(folder, chained, "chained.yaml")


def _parsed_as_a_task(monkeypatch, folder, dag_id: str | None, cache=None):
    """`dags/microbatch_pipelines.py` parsed as Airflow's task runner parses
    it (its parsing context naming `dag_id`; None: as the dag-processor does),
    and which specs that parse loaded. `cache`: the folder of kept specs
    (`spec_cache`), by default a new one: nothing kept from other parses."""
    from airflow.dag_processing.dagbag import DagBag

    from microbatch_airflow import spec_cache

    loaded: list[str] = []
    real = spec_cache.load_spec

    def counting(path, **kwargs):
        loaded.append(str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(spec_cache, "load_spec", counting)
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(cache or folder / ".cache" / uuid.uuid4().hex))
    monkeypatch.setenv("MICROBATCH_PIPELINES_DIR", str(folder))
    if dag_id is None:
        monkeypatch.delenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", raising=False)
    else:
        monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", dag_id)
    bag = DagBag(dag_folder=str(ROOT / "dags" / "microbatch_pipelines.py"))
    assert bag.import_errors == {}
    return bag, loaded


def test_a_task_process_in_a_folder_of_1000_specs_loads_only_its_own(tmp_path, monkeypatch):
    """Issue 48: every task process built every pipeline's DAG to find its
    own (2.3-3.4 CPU-s at 200 specs, on every batch). With Airflow's parsing
    context it loads one spec; the dag-processor still loads them all."""
    for i in range(1000):
        spec = oracle_spec_dict(name=f"p{i:04d}", checkpoint=f"lake/_checkpoints/p{i:04d}")
        spec["state"]["path"] = f"lake/state_{i:04d}"
        (tmp_path / f"p{i:04d}.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "landing").mkdir()
    start = time.perf_counter()
    bag, loaded = _parsed_as_a_task(monkeypatch, tmp_path, "p0500")
    print(f"a task's parse of a folder of 1000 specs: {time.perf_counter() - start:.2f} s")  # a figure, not an assert
    assert bag.dag_ids == ["p0500"]
    assert loaded == [str(tmp_path / "p0500.yaml")]


def test_the_dag_a_task_builds_is_the_one_the_dag_processor_builds(tmp_path, monkeypatch):
    """The DAG built alone serializes exactly as in the full parse: a plain
    pipeline, one with a maintenance DAG, a pipeline chained to another's
    state (its schedule is the upstream's asset), and a name beside another
    pipeline's maintenance DAG id (refused either way)."""
    from airflow.serialization.serialized_objects import DagSerialization

    (tmp_path / "landing").mkdir()
    write_plain_kept_and_chained(tmp_path)
    clash = oracle_spec_dict(name="kept_maintenance", checkpoint="lake/_checkpoints/clash")
    clash["state"]["path"] = "lake/clash"
    write_spec(tmp_path, clash, "zz_clash.yaml")
    full, every = _parsed_as_a_task(monkeypatch, tmp_path, None)
    assert sorted(full.dag_ids) == ["chained", "kept", "kept_maintenance", "plain"]
    assert len(every) == 4
    for dag_id in full.dag_ids:
        alone, loaded = _parsed_as_a_task(monkeypatch, tmp_path, dag_id)
        assert alone.dag_ids == [dag_id]
        assert DagSerialization.to_dict(alone.dags[dag_id]) == DagSerialization.to_dict(full.dags[dag_id]), dag_id
        # The files that mention the names deciding it; a chained pipeline
        # then loads them all (its own kept from the first look: `spec_cache`).
        assert len(loaded) == {"chained": 4, "kept": 3, "kept_maintenance": 3}.get(dag_id, 1), (dag_id, loaded)
    alone, _ = _parsed_as_a_task(monkeypatch, tmp_path, "kept_maintenance")
    assert [t.task_id for t in alone.dags["kept_maintenance"].tasks] == ["maintain"], "the maintenance DAG, not the clash"


def test_a_task_builds_what_the_full_parse_builds_where_a_quick_look_would_not(tmp_path, monkeypatch):
    """Found by trying to break the parsing context's path: a `name:` line
    inside a quoted description, beside a duplicate of the real name; and a
    maintenance DAG id two clashes deep. The task builds what the full
    parse builds, or nothing where it builds nothing."""
    from airflow.serialization.serialized_objects import DagSerialization

    (tmp_path / "landing").mkdir()
    real = oracle_spec_dict(name="real", checkpoint="lake/_checkpoints/a")
    del real["description"]
    # A quoted description over three lines, the second at column 0.
    (tmp_path / "a.yaml").write_text('description: "Events per user\nname: fake\n  and more"\n' + yaml.safe_dump(real, sort_keys=False))
    twin = oracle_spec_dict(name="real", checkpoint="lake/_checkpoints/b")
    twin["state"]["path"] = "lake/b"
    write_spec(tmp_path, twin, "b.yaml")
    p = oracle_spec_dict(name="p", airflow={"maintenance_schedule": "@daily"}, checkpoint="lake/_checkpoints/p")
    p["state"]["path"] = "lake/p"
    write_spec(tmp_path, p, "p.yaml")
    pm = oracle_spec_dict(name="p_maintenance", airflow={"maintenance_schedule": "@daily"}, checkpoint="lake/_checkpoints/pm")
    pm["state"]["path"] = "lake/pm"
    write_spec(tmp_path, pm, "pm.yaml")
    full, _ = _parsed_as_a_task(monkeypatch, tmp_path, None)
    assert sorted(full.dag_ids) == ["p", "p_maintenance", "real"]
    assert full.dags["real"].tasks[0].spec_path.endswith("a.yaml")
    for dag_id in ["real", "p", "p_maintenance", "p_maintenance_maintenance"]:
        alone, _ = _parsed_as_a_task(monkeypatch, tmp_path, dag_id)
        if dag_id in full.dag_ids:
            assert alone.dag_ids == [dag_id]
            assert DagSerialization.to_dict(alone.dags[dag_id]) == DagSerialization.to_dict(full.dags[dag_id]), dag_id
        else:
            assert alone.dag_ids == [], dag_id



def test_a_parse_leaves_the_objects_it_found_frozen_as_they_were(tmp_path, monkeypatch):
    """Airflow's dag-processor freezes its objects before it forks a parse
    (copy-on-write); a parse must not unfreeze them. Where nothing was
    frozen, nothing stays frozen after."""
    import gc

    from microbatch_airflow.dag_factory import dags_from_folder

    write_spec(tmp_path, oracle_spec_dict(name="plain"), "plain.yaml")
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / ".cache"))
    assert gc.get_freeze_count() == 0
    dags_from_folder(tmp_path)
    assert gc.get_freeze_count() == 0
    unfrozen = []
    unfreeze = gc.unfreeze
    monkeypatch.setattr(gc, "unfreeze", lambda: unfrozen.append(True) or unfreeze())
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert dags_from_folder(tmp_path)
        assert not unfrozen
        # (A frozen object the parse lets go of, such as a replaced cache
        # entry, leaves the count: a few, not all of them.)
        assert frozen - 1000 < gc.get_freeze_count() <= frozen + 1000
    finally:
        unfreeze()
