"""The commit protocol in one process: batches, replays, rewind, dry runs, no-data runs."""

from __future__ import annotations

import os
import shutil

from spark_jobs.clickstream import write_wave
from spark_jobs.delta_io import open_table
from spark_jobs.fencing import STATE_FENCE, Position
from spark_jobs.ledger import COMMITTED, PLANNED, REWOUND, OffsetLedger
from spark_jobs.protocol import RunOptions, rewind, run_batch, status
from spark_jobs.spec import load_spec
from tests.conftest import assert_exact, run_cli


def _land_and_run(spec, compute, waves: int, **wave_args) -> None:
    """One batch per wave of files."""
    landing = spec.source_path
    for wave in range(waves):
        write_wave(landing, wave, **wave_args)
        run_batch(spec, compute_factory=compute)


def test_batches_are_exact_and_ledger_joins(spec_path, compute):
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    for wave in range(3):
        write_wave(landing, wave, files=2, records_per_file=300, users=50, bad_every=37)
        outcome = run_batch(spec, compute_factory=compute)
        assert outcome.status == "committed" and outcome.batch_id == wave + 1
        assert outcome.records_in == 600
        assert outcome.records_quarantined == 2 * (300 // 37)
    lineage = assert_exact(spec_path)
    assert len(lineage) == 3
    assert run_batch(spec, compute_factory=compute).status == "no_new_data"


def test_caps_split_a_backlog_into_batches(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=5, records_per_file=10)
    sizes = []
    while (outcome := run_batch(spec, RunOptions(max_files=2), compute_factory=compute)).status == "committed":
        sizes.append(len(outcome.files))
    assert sizes == [2, 2, 1]
    assert_exact(spec_path)


def test_dry_run_commits_nothing(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=10)
    outcome = run_batch(spec, RunOptions(dry_run=True), compute_factory=compute)
    assert outcome.status == "dry_run" and len(outcome.files) == 2 and outcome.batch_id == 1
    assert not (spec_path.parent / "lake").exists()


def test_rewind_then_replay_is_exact_in_a_new_epoch(spec_path, compute):
    spec = load_spec(spec_path)
    _land_and_run(spec, compute, 3, files=1, records_per_file=200, users=30)
    before = assert_exact(spec_path)
    outcome = rewind(spec, 1)
    assert outcome.epoch == 1 and outcome.batch_id == 1
    # Right after the rewind, state equals the oracle for batch 1's files only.
    assert_exact(spec_path, drained=False)
    assert status(spec).end_offsets == before[0].end_offsets
    replayed = run_batch(spec, compute_factory=compute)
    assert (replayed.epoch, replayed.batch_id) == (1, 2)
    assert replayed.start_offsets == {"files": 1} and replayed.end_offsets == {"files": 3}
    lineage = assert_exact(spec_path)
    assert [(r.epoch, r.batch_id) for r in lineage] == [(0, 1), (1, 2)]
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    assert [(r.epoch, r.batch_id) for r in rows if r.status == REWOUND] == [(1, 1)]
    # The old epoch's history stays for audit.
    assert {(r.epoch, r.batch_id) for r in rows if r.status == COMMITTED} >= {(0, 2), (0, 3)}


def test_rewind_to_zero_empties_state_and_replays_everything(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=50)
    run_batch(spec, compute_factory=compute)
    rewind(spec, 0)
    assert_exact(spec_path, drained=False)  # empty state, empty lineage
    run_batch(spec, compute_factory=compute)
    assert_exact(spec_path)


def test_planned_range_is_reused_after_a_crash_before_commit(spec_path, compute):
    """A replay reads exactly the planned files even if more have landed."""
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=2, records_per_file=20)
    result = run_cli("run", str(spec_path), env={"MICROBATCH_FAULT_POINT": "after_plan"})
    assert "MICROBATCH-FAULT-POINT-HIT after_plan" in result.stderr
    write_wave(landing, 1, files=2, records_per_file=20)
    replay = run_batch(spec, compute_factory=compute)
    assert replay.batch_id == 1 and len(replay.files) == 2
    assert all("w00000" in name for name in replay.files)
    assert run_batch(spec, compute_factory=compute).batch_id == 2
    assert_exact(spec_path)


def test_ledger_row_repaired_after_crash_between_state_and_ledger(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=20)
    result = run_cli("run", str(spec_path), env={"MICROBATCH_FAULT_POINT": "after_state_commit"})
    assert "MICROBATCH-FAULT-POINT-HIT after_state_commit" in result.stderr
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    assert [r.status for r in view.rows] == [PLANNED]
    assert Position.decode(open_table(spec.state_path).transaction_version(STATE_FENCE)) == Position(0, 1)
    assert "next run will record it" in status(spec).note
    assert run_batch(spec, compute_factory=compute).status == "no_new_data"
    committed = [r for r in OffsetLedger(spec.ledger_path, spec.name).load().rows if r.status == COMMITTED]
    assert len(committed) == 1 and committed[0].records_in == 20 and committed[0].state_version == 1
    assert_exact(spec_path)


def test_no_new_data_starts_no_jvm(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    run_batch(spec, compute_factory=compute)
    # With no Java reachable, starting Spark would fail: exit 0 proves it never started.
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not shutil.which("java", path=p))
    env = {"JAVA_HOME": "/nonexistent", "PATH": path}
    result = run_cli("run", str(spec_path), env=env)
    assert result.returncode == 0, result.stderr
    assert "no_new_data: no new data (pipeline at batch 1 (epoch 0))" in result.stdout
    result = run_cli("run", str(spec_path), "--until", "2000-01-01T00:00:00Z", env=env)
    assert "this interval is already covered" in result.stdout


def test_batch_with_every_record_quarantined_still_commits(spec_path, compute):
    """An empty MERGE makes no Delta commit; the fence must move anyway."""
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=20)
    run_batch(spec, compute_factory=compute)
    (landing / "all-bad.json").write_text("not json\n[1]\n")
    outcome = run_batch(spec, compute_factory=compute)
    assert outcome.status == "committed" and outcome.batch_id == 2
    assert outcome.records_in == 2 and outcome.records_quarantined == 2 and outcome.keys_updated == 0
    write_wave(landing, 1, files=1, records_per_file=20)
    assert run_batch(spec, compute_factory=compute).batch_id == 3  # the pipeline goes on
    assert_exact(spec_path)


def test_rewind_to_zero_of_an_empty_state_still_moves_the_fence(spec_path, compute):
    """DELETE on a table with no rows makes no Delta commit; the rewind must still fence."""
    spec = load_spec(spec_path)
    (spec_path.parent / "landing" / "all-bad.json").write_text("not json\n")
    assert run_batch(spec, compute_factory=compute).keys_updated == 0  # state exists, empty
    outcome = rewind(spec, 0)
    assert (outcome.epoch, outcome.batch_id) == (1, 0)
    assert Position.decode(open_table(spec.state_path).transaction_version(STATE_FENCE)) == Position(1, 0)
    replay = run_batch(spec, compute_factory=compute)
    assert (replay.epoch, replay.batch_id, replay.records_quarantined) == (1, 1, 1)
    assert_exact(spec_path)


def test_rewind_to_before_an_earlier_rewind_point(spec_path, compute):
    spec = load_spec(spec_path)
    _land_and_run(spec, compute, 4, files=1, records_per_file=30)
    rewind(spec, 3)
    rewind(spec, 1)  # before the first rewind's point: epoch 0 is cut at batch 1, not 3
    assert_exact(spec_path, drained=False)
    replay = run_batch(spec, compute_factory=compute)
    assert replay.start_offsets == {"files": 1} and replay.end_offsets == {"files": 4}
    assert_exact(spec_path)


def test_rewind_recovers_a_state_table_behind_the_ledger(spec_path, compute):
    import pyarrow as pa
    import pytest
    from deltalake import write_deltalake

    from spark_jobs.errors import StateBehindLedgerError
    from spark_jobs.fencing import commit_properties

    spec = load_spec(spec_path)
    _land_and_run(spec, compute, 3, files=1, records_per_file=30)
    # Someone moves the state's fence back (as replacing the table would).
    table = open_table(spec.state_path)
    empty = pa.schema(table.schema().to_arrow()).empty_table()
    write_deltalake(table, empty, mode="append", commit_properties=commit_properties(STATE_FENCE, Position(0, 1), {}))
    with pytest.raises(StateBehindLedgerError, match="microbatch rewind"):
        run_batch(spec, compute_factory=compute)
    rewind(spec, 1)  # the way out the message names
    run_batch(spec, compute_factory=compute)
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
        assert run_batch(load_spec(path), compute_factory=compute).status == "committed"
    for path in paths:
        assert_exact(path)
        assert run_batch(load_spec(path), compute_factory=compute).status == "no_new_data"
