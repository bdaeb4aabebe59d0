"""The commit protocol in one process: batches, replays, rewind, dry runs, no-data runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.core.delta_io import open_table
from spark_jobs.core.fencing import STATE_FENCE, Position
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.inspect import status
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from tests.conftest import assert_exact, run_cli


def _land_and_run(spec, compute, waves: int, **wave_args) -> None:
    """One batch per wave of files."""
    landing = spec.source_path
    for wave in range(waves):
        write_wave(landing, wave, **wave_args)
        run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)


def test_batches_are_exact_and_ledger_joins(spec_path, compute):
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    for wave in range(3):
        write_wave(landing, wave, files=2, records_per_file=300, users=50, bad_every=37)
        outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
        assert outcome.status == "committed" and outcome.batch_id == wave + 1
        assert outcome.records_in == 600
        assert outcome.records_quarantined == 2 * (300 // 37)
    lineage = assert_exact(spec_path)
    assert len(lineage) == 3
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).status == "no_new_data"


def test_caps_split_a_backlog_into_batches(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=5, records_per_file=10)
    sizes = []
    while (outcome := run_batch(spec, RunOptions(run_id="test", max_files=2), compute_factory=compute)).status == "committed":
        sizes.append(len(outcome.inputs))
    assert sizes == [2, 2, 1]
    assert_exact(spec_path)


def test_dry_run_commits_nothing(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=10)
    outcome = run_batch(spec, RunOptions(run_id="test", dry_run=True), compute_factory=compute)
    assert outcome.status == "dry_run" and len(outcome.inputs) == 2 and outcome.batch_id == 1
    assert not (spec_path.parent / "lake").exists()


def test_rewind_then_replay_is_exact_in_a_new_epoch(spec_path, compute):
    spec = load_spec(spec_path)
    _land_and_run(spec, compute, 3, files=1, records_per_file=200, users=30)
    before = assert_exact(spec_path)
    outcome = rewind(spec, 1, run_id="test-rewind")
    assert outcome.epoch == 1 and outcome.batch_id == 1
    # Right after the rewind, state equals the oracle for batch 1's files only.
    assert_exact(spec_path, drained=False)
    assert status(spec).end_offsets == before[0].end_offsets
    replayed = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert (replayed.epoch, replayed.batch_id) == (1, 2)
    assert replayed.start_offsets == {"files": 1} and replayed.end_offsets == {"files": 3}
    lineage = assert_exact(spec_path)
    assert [(r.epoch, r.batch_id) for r in lineage] == [(0, 1), (1, 2)]
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    assert [(r.epoch, r.batch_id) for r in rows if r.status == RowStatus.REWOUND] == [(1, 1)]
    # The old epoch's history stays for audit.
    assert {(r.epoch, r.batch_id) for r in rows if r.status == RowStatus.COMMITTED} >= {(0, 2), (0, 3)}


def test_rewind_to_zero_empties_state_and_replays_everything(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=50)
    run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    rewind(spec, 0, run_id="test-rewind")
    assert_exact(spec_path, drained=False)  # empty state, empty lineage
    run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert_exact(spec_path)


def test_planned_range_is_reused_after_a_crash_before_commit(spec_path, compute, on_connect):
    """A replay reads exactly the planned files even if more have landed."""
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=2, records_per_file=20)
    result = run_cli("run", str(spec_path), env={"MICROBATCH_FAULT_POINT": "after_plan"})
    assert "MICROBATCH-FAULT-POINT-HIT after_plan" in result.stderr
    write_wave(landing, 1, files=2, records_per_file=20)
    replay = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert replay.batch_id == 1 and len(replay.inputs) == 2
    assert all("w00000" in name for name in replay.inputs)
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).batch_id == 2
    assert_exact(spec_path)


def test_ledger_row_repaired_after_crash_between_state_and_ledger(spec_path, compute, on_connect):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=20)
    result = run_cli("run", str(spec_path), env={"MICROBATCH_FAULT_POINT": "after_state_commit"})
    assert "MICROBATCH-FAULT-POINT-HIT after_state_commit" in result.stderr
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    assert [r.status for r in view.rows] == [RowStatus.PLANNED]
    assert Position.decode(open_table(spec.state_path).transaction_version(STATE_FENCE)) == Position(0, 1)
    assert "next run will record it" in status(spec).note
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).status == "no_new_data"
    committed = [r for r in OffsetLedger(spec.ledger_path, spec.name).load().rows if r.status == RowStatus.COMMITTED]
    assert len(committed) == 1 and committed[0].records_in == 20 and committed[0].state_version == 1
    assert_exact(spec_path)


def test_no_new_data_starts_no_jvm(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    # With no Java reachable, starting Spark would fail: exit 0 proves it never started.
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not shutil.which("java", path=p))
    env = {"JAVA_HOME": "/nonexistent", "PATH": path}
    result = run_cli("run", str(spec_path), env=env)
    assert result.returncode == 0, result.stderr
    assert "no_new_data: no new data (pipeline at batch 1 (epoch 0))" in result.stdout
    result = run_cli("run", str(spec_path), "--until", "2000-01-01T00:00:00Z", env=env)
    assert "this interval is already covered: batch 1 (epoch 0) read what had arrived by" in result.stdout


def test_an_interval_nothing_arrived_in_says_so(spec_path, compute):
    from datetime import datetime, timezone

    spec = load_spec(spec_path)
    (path,) = write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    later = datetime(2030, 1, 1, tzinfo=timezone.utc).timestamp()
    os.utime(path, (later, later))  # it arrives after the interval
    start, end = datetime(2029, 1, 1, tzinfo=timezone.utc), datetime(2029, 1, 2, tzinfo=timezone.utc)
    outcome = run_batch(spec, RunOptions(run_id="test", interval_start=start, interval_end=end), compute_factory=compute)
    assert outcome.status == "no_new_data"
    assert outcome.message == "nothing new arrived in the interval 2029-01-01T00:00:00+00:00 to 2029-01-02T00:00:00+00:00 (pipeline at batch 0 (epoch 0))"


def test_batch_with_every_record_quarantined_still_commits(spec_path, compute):
    """An empty MERGE makes no Delta commit; the fence must move anyway."""
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=20)
    run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    (landing / "all-bad.json").write_text("not json\n[1]\n")
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert outcome.status == "committed" and outcome.batch_id == 2
    assert outcome.records_in == 2 and outcome.records_quarantined == 2 and outcome.keys_updated == 0
    write_wave(landing, 1, files=1, records_per_file=20)
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).batch_id == 3  # the pipeline goes on
    assert_exact(spec_path)


def test_rewind_to_zero_of_an_empty_state_still_moves_the_fence(spec_path, compute):
    """DELETE on a table with no rows makes no Delta commit; the rewind must still fence."""
    spec = load_spec(spec_path)
    (spec_path.parent / "landing" / "all-bad.json").write_text("not json\n")
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).keys_updated == 0  # state exists, empty
    outcome = rewind(spec, 0, run_id="test-rewind")
    assert (outcome.epoch, outcome.batch_id) == (1, 0)
    assert Position.decode(open_table(spec.state_path).transaction_version(STATE_FENCE)) == Position(1, 0)
    replay = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert (replay.epoch, replay.batch_id, replay.records_quarantined) == (1, 1, 1)
    assert_exact(spec_path)


def test_rewind_to_before_an_earlier_rewind_point(spec_path, compute):
    spec = load_spec(spec_path)
    _land_and_run(spec, compute, 4, files=1, records_per_file=30)
    rewind(spec, 3, run_id="test-rewind")
    rewind(spec, 1, run_id="test-rewind")  # before the first rewind's point: epoch 0 is cut at batch 1, not 3
    assert_exact(spec_path, drained=False)
    replay = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert replay.start_offsets == {"files": 1} and replay.end_offsets == {"files": 4}
    assert_exact(spec_path)


def test_rewind_recovers_a_state_table_behind_the_ledger(spec_path, compute):
    import pyarrow as pa
    import pytest
    from deltalake import write_deltalake

    from spark_jobs.errors import StateBehindLedgerError
    from spark_jobs.core.fencing import commit_properties

    spec = load_spec(spec_path)
    _land_and_run(spec, compute, 3, files=1, records_per_file=30)
    # Someone moves the state's fence back (as replacing the table would).
    table = open_table(spec.state_path)
    empty = pa.schema(table.schema().to_arrow()).empty_table()
    write_deltalake(table, empty, mode="append", commit_properties=commit_properties(STATE_FENCE, Position(0, 1), {}))
    with pytest.raises(StateBehindLedgerError, match="microbatch rewind"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    rewind(spec, 1, run_id="test-rewind")  # the way out the message names
    run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert_exact(spec_path)


def test_two_pipelines_can_share_a_checkpoint_folder(tmp_path, compute):
    from tests.conftest import oracle_spec_dict, write_spec

    paths = []
    for name in ("first", "second"):
        spec = oracle_spec_dict(name=name, checkpoint="lake/_checkpoints/shared")
        spec["source"]["path"] = f"landing_{name}"
        spec["state"]["path"] = f"lake/{name}"
        paths.append(write_spec(tmp_path, spec, f"{name}.yaml"))
        write_wave(tmp_path / f"landing_{name}", 0, files=1, records_per_file=40, bad_every=7)
    for path in paths:
        assert run_batch(load_spec(path), RunOptions(run_id="test"), compute_factory=compute).status == "committed"
    for path in paths:
        assert_exact(path)
        assert run_batch(load_spec(path), RunOptions(run_id="test"), compute_factory=compute).status == "no_new_data"


# -- state and ledger that do not belong together (JVM-free: ArrowCompute) ----------


def _arrow_batches(spec, waves: int) -> None:
    from tests.spark_jobs.arrow_compute import ArrowCompute

    for wave in range(waves):
        write_wave(spec.source_path, wave, files=1, records_per_file=40, users=10, bad_every=9)
        assert run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute).status == "committed"


def test_lost_checkpoint_is_refused_instead_of_rereading_earlier_batches(spec_path):
    """A state three batches ahead of an empty ledger: recording only its last
    commit would make the next run re-read batches 1 and 2."""
    import pytest

    from spark_jobs.errors import StateLedgerMismatchError
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    _arrow_batches(spec, 3)
    shutil.rmtree(spec.checkpoint_path)
    state_version = open_table(spec.state_path).version()
    with pytest.raises(StateLedgerMismatchError, match="does not follow batch 0 .* new checkpoint"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    assert open_table(spec.state_path).version() == state_version
    assert not os.path.exists(spec.ledger_path)  # nothing written


def test_state_of_another_pipeline_is_refused(tmp_path, spec_path):
    import pytest
    import yaml

    from spark_jobs.errors import StateLedgerMismatchError
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    _arrow_batches(spec, 1)
    # A second pipeline pointed at the same state table, with its own checkpoint.
    other = yaml.safe_load(spec_path.read_text())
    other.update(name="other", checkpoint="lake/_checkpoints/other")
    other_path = spec_path.parent / "other.yaml"
    other_path.write_text(yaml.safe_dump(other))
    with pytest.raises(StateLedgerMismatchError, match="committed by pipeline 'clicks'"):
        run_batch(load_spec(other_path), RunOptions(run_id="test"), compute_factory=ArrowCompute)


def test_deleted_state_says_to_use_a_new_checkpoint(spec_path):
    import pytest

    from spark_jobs.errors import RewindError, StateBehindLedgerError
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    _arrow_batches(spec, 2)
    shutil.rmtree(spec.state_path)
    with pytest.raises(StateBehindLedgerError, match="no state table.*new checkpoint"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    with pytest.raises(RewindError, match="new checkpoint"):
        rewind(spec, 0, run_id="test-rewind")


def test_manual_restore_of_the_state_is_detected_and_rewind_repairs_it(spec_path):
    """Delta's RESTORE leaves the fence where it was: only the history shows it."""
    import pytest

    from spark_jobs.errors import StateChangedOutsideError
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    _arrow_batches(spec, 3)
    table = open_table(spec.state_path)
    table.optimize.compact()  # maintenance is fine
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute).status == "no_new_data"
    restored_to = [r for r in OffsetLedger(spec.ledger_path, spec.name).load().rows if r.batch_id == 1 and r.status == RowStatus.COMMITTED][0]
    open_table(spec.state_path).restore(restored_to.state_version)
    write_wave(spec.source_path, 9, files=1, records_per_file=40, users=10)
    with pytest.raises(StateChangedOutsideError, match=r"version \d+ \(RESTORE\).*microbatch rewind"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    rewind(spec, 3, run_id="test-rewind")  # back to what batch 3 committed, undoing the RESTORE
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute).status == "committed"
    assert_exact(spec_path)


def test_a_merge_column_renamed_outside_the_job_is_refused(spec_path):
    """Reproduced: RENAME COLUMN counted as maintenance; the next batch re-added
    the column as null and its sums restarted. A rename is a change outside the
    job. (delta-rs cannot rename a column: the commit is written as delta-spark
    writes one, its schema renamed.)"""
    import json

    import pytest

    from spark_jobs.errors import StateChangedOutsideError
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    _arrow_batches(spec, 1)
    log = Path(spec.state_path) / "_delta_log"
    commits = sorted(log.glob("*.json"))
    metadata = next(a["metaData"] for f in reversed(commits) for a in map(json.loads, f.read_text().splitlines()) if "metaData" in a)
    schema = json.loads(metadata["schemaString"])
    for field in schema["fields"]:
        if field["name"] == "amount":
            field["name"] = "amount_eur"
    metadata["schemaString"] = json.dumps(schema)
    version = int(commits[-1].stem) + 1
    info = {"timestamp": 1, "operation": "RENAME COLUMN", "operationParameters": {"oldColumnPath": "amount", "newColumnPath": "amount_eur"}}
    (log / f"{version:020d}.json").write_text(json.dumps({"commitInfo": info}) + "\n" + json.dumps({"metaData": metadata}) + "\n")
    write_wave(spec.source_path, 9, files=1, records_per_file=40, users=10)
    with pytest.raises(StateChangedOutsideError, match=rf"version {version} \(RENAME COLUMN\)"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)


def test_batch_that_cannot_fit_the_state_fails_before_quarantining(spec_path, monkeypatch):
    """The quarantine write is fenced per batch: if it happened before a type
    error, a replay after fixing the spec would not quarantine again."""
    import pyarrow as pa
    import pytest

    from spark_jobs.core.delta_io import read_all
    from spark_jobs.errors import TransformError
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    _arrow_batches(spec, 1)
    quarantined = read_all(open_table(spec.quarantine_path)).num_rows
    write_wave(spec.source_path, 1, files=1, records_per_file=40, users=10, bad_every=9)
    real = ArrowCompute._transform

    def amount_as_text(parsed):  # a transform whose `amount` no longer casts to DOUBLE
        out = real(parsed)
        return out.set_column(out.schema.get_field_index("amount"), "amount", pa.array(["x"] * out.num_rows))

    monkeypatch.setattr(ArrowCompute, "_transform", staticmethod(amount_as_text))
    with pytest.raises(TransformError, match="is STRING, which `sum` cannot add"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    assert read_all(open_table(spec.quarantine_path)).num_rows == quarantined
    monkeypatch.setattr(ArrowCompute, "_transform", staticmethod(real))
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute).status == "committed"
    assert_exact(spec_path)


def test_outside_change_during_a_run_is_not_merged_over(spec_path):
    """A DELETE landing between a run's reconcile and its state commit would be
    hidden for good once the run merged on top of it."""
    import pytest

    from spark_jobs.core import faults
    from spark_jobs.errors import StateChangedOutsideError
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    _arrow_batches(spec, 1)
    write_wave(spec.source_path, 1, files=1, records_per_file=40, users=10)

    def delete_after_read(point: str) -> None:
        if point == "after_read":
            open_table(spec.state_path).delete("user_id = 'user000001'")

    faults.set_hook(delete_after_read)
    try:
        with pytest.raises(StateChangedOutsideError, match=r"\(DELETE\)"):
            run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    finally:
        faults.set_hook(None)
    rewind(spec, 1, run_id="test-rewind")
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute).status == "committed"
    assert_exact(spec_path)


def test_a_stale_view_of_the_ledger_is_read_again_not_refused(spec_path):
    """Two events landing between reconcile's ledger read and its state read
    leave the state two events ahead of what it read: a race, not a foreign ledger."""
    from spark_jobs.core.pipeline import Pipeline
    from spark_jobs.core.protocol import reconcile

    spec = load_spec(spec_path)
    _arrow_batches(spec, 3)
    p = Pipeline(spec)
    stale, fresh = p.ledger.load(), p.ledger.load
    rewind(spec, 2, run_id="test-rewind")
    rewind(spec, 1, run_id="test-rewind")
    reads = iter([stale])
    p.ledger.load = lambda: next(reads, None) or fresh()
    assert reconcile(p).position == Position(2, 1)


def test_sigterm_after_the_state_commit_still_reports_the_batch_committed(spec_path):
    from spark_jobs.core import faults, shutdown
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=1, records_per_file=40, users=10)
    faults.set_hook(lambda point: shutdown.request() if point == "after_state_commit" else None)
    try:
        outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    finally:
        faults.set_hook(None)
        shutdown._requested.clear()
    assert outcome.status == "committed"
    assert_exact(spec_path)


def test_ledger_compaction_failing_never_fails_a_committed_run(spec_path, monkeypatch, caplog):
    from spark_jobs.core import ledger
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    monkeypatch.setattr(ledger, "COMPACT_AT_FILES", 1)

    def broken_open(*args, **kwargs):
        raise OSError("storage unavailable")

    write_wave(spec.source_path, 0, files=1, records_per_file=40, users=10)
    real_compact = ledger.OffsetLedger.compact

    def compact_with_broken_storage(self):
        monkeypatch.setattr(ledger.OffsetLedger, "snapshot", broken_open)
        return real_compact(self)

    monkeypatch.setattr(ledger.OffsetLedger, "compact", compact_with_broken_storage)
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute).status == "committed"
    assert "not compacted this time (storage unavailable)" in caplog.text


def test_a_commit_landing_while_step_5_looks_up_the_batch_does_not_shift_its_recorded_version(spec_path, compute, monkeypatch):
    """Issue 46, item 1: a table property set on the state between step 5's
    open and its look-up of the batch's commit made the ledger record batch
    3 under version 2 (delta-rs#4488); `rewind --to-batch 3` then restored
    batch 2's state and batch 3's records left the state for good."""
    from deltalake import DeltaTable

    from spark_jobs.core.state import StateTable
    from tests.conftest import assert_versions_carry_batches

    spec = load_spec(spec_path)
    landing = spec.source_path
    _land_and_run(spec, compute, 2, files=1, records_per_file=50, users=10)
    write_wave(landing, 2, files=1, records_per_file=50, users=10)
    find_commit = StateTable.find_commit
    fired = []

    def a_property_change_lands_first(self, table, position):
        if position.batch_id == 3 and not fired:
            fired.append(position)
            DeltaTable(self.path).alter.set_table_properties({"delta.logRetentionDuration": "interval 31 days"})
        return find_commit(self, table, position)

    monkeypatch.setattr(StateTable, "find_commit", a_property_change_lands_first)
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).status == "committed"
    monkeypatch.undo()
    assert fired
    assert_versions_carry_batches(spec_path)
    write_wave(landing, 3, files=1, records_per_file=50, users=10)
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).batch_id == 4
    result = run_cli("rewind", str(spec_path), "--to-batch", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r.batch_id for r in assert_exact(spec_path, drained=False)] == [1, 2, 3]


def test_a_run_that_plans_and_commits_while_reconcile_looks_is_no_broken_checkpoint(spec_path, compute):
    """Issue 46, item 7: another run planned and committed batch 2 (and died
    before its ledger row) between this run's ledger read and its state open.
    Its plan is not in the view read first, so the state looked like another
    pipeline's (`StateLedgerMismatchError`, exit 2, no Airflow retry). The
    ledger moved meanwhile: reconcile looks again and records the batch."""
    from spark_jobs.core.pipeline import Pipeline
    from spark_jobs.core.protocol import reconcile
    from tests.conftest import crash_at

    spec = load_spec(spec_path)
    _land_and_run(spec, compute, 1, files=1, records_per_file=50, users=10)
    write_wave(spec.source_path, 1, files=1, records_per_file=50, users=10)
    pipeline = Pipeline(spec)
    open_state = pipeline.state.open
    raced = []

    def another_run_commits_first():
        if not raced:
            raced.append(True)
            with crash_at("after_state_commit"):
                run_batch(spec, RunOptions(run_id="other"), compute_factory=compute)
        return open_state()

    pipeline.state.open = another_run_commits_first
    view = reconcile(pipeline)
    assert raced and view.position == Position(0, 2)
    assert_exact(spec_path)
