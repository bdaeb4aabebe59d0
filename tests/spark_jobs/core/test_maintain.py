"""Maintenance and rewind (issue 11, section 4): real Delta tables, the
pure-Arrow compute, the real CLI entry point in-process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spark_jobs.cli import main
from spark_jobs.core.delta_io import open_table
from spark_jobs.core.inspect import status
from spark_jobs.core.maintain import maintain
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import RewindError, StateChangedOutsideError
from tests.conftest import assert_exact
from tests.spark_jobs.arrow_compute import ArrowCompute


def _batches(spec_path: Path, waves: range) -> None:
    spec = load_spec(spec_path)
    for wave in waves:
        write_wave(spec_path.parent / "landing", wave, files=1, records_per_file=30, users=6, bad_every=9)
        assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"


def _parquet_files(folder: str) -> int:
    return sum(1 for p in Path(folder).rglob("*.parquet") if "_delta_log" not in p.parts)


def test_rewind_after_optimize_and_vacuum_restores_the_optimized_version(spec_path):
    """Reproduced: after OPTIMIZE and VACUUM (retention 0) of the state, a
    mistaken DELETE was refused, but `rewind --to-batch 3` then failed with
    "missing file", and so did batches 2 and 1."""
    _batches(spec_path, range(3))
    spec = load_spec(spec_path)
    table = open_table(spec.state_path)
    table.optimize.compact()
    table.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
    open_table(spec.state_path).delete("events > 0")
    with pytest.raises(StateChangedOutsideError, match="--to-batch 3"):
        run_batch(spec, RunOptions(run_id="test"), ArrowCompute)
    with pytest.raises(RewindError, match=r"batch 2's state .* can no longer be restored.*rewound to: 0 and 3\.\.3"):
        rewind(spec, 2, run_id="test-rewind")
    assert rewind(spec, 3, run_id="test-rewind").batch_id == 3
    _batches(spec_path, range(3, 4))
    assert [(r.epoch, r.batch_id) for r in assert_exact(spec_path)] == [(0, 1), (0, 2), (0, 3), (1, 4)]


def test_maintain_keeps_the_last_batches_rewindable_and_bounds_the_tables(spec_path, capsys):
    _batches(spec_path, range(6))
    spec = load_spec(spec_path)
    assert main(["-q", "maintain", str(spec_path), "--keep-batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "batches 5..6 stay rewindable" in out
    # Each batch appended a small file to the ledger (two rows) and the
    # quarantine; the merged state, rewritten by each batch, is one file.
    assert int(re.search(r"  ledger: (\d+) file\(s\) compacted", out)[1]) >= 12, out
    assert int(re.search(r"  quarantine: (\d+) file\(s\) compacted", out)[1]) == 6, out
    assert "  state: nothing to compact, " in out, out
    assert main(["-q", "maintain", str(spec_path), "--keep-batches", "2"]) == 0
    again = capsys.readouterr().out
    assert "  ledger: nothing to compact, " in again and "  quarantine: nothing to compact, " in again, again
    # OPTIMIZE and VACUUM are maintenance, not outside changes: the pipeline goes on.
    _batches(spec_path, range(6, 7))
    assert status(spec).oldest_rewindable == 5
    with pytest.raises(RewindError, match="rewound to: 0 and 5..7"):
        rewind(spec, 2, run_id="test-rewind")
    rewind(spec, 5, run_id="test-rewind")
    _batches(spec_path, range(7, 8))
    assert_exact(spec_path)


def test_maintain_between_every_batch_keeps_the_protocol_exact_and_the_ledger_small(spec_path):
    """Today the ledger is compacted but never vacuumed: its dead files grow with age."""
    spec = load_spec(spec_path)
    for wave in range(6):
        _batches(spec_path, range(wave, wave + 1))
        maintain(spec, keep_batches=1)
    assert_exact(spec_path)
    # Live: one compacted file; dead: at most what the last compaction replaced (two rows a batch).
    assert _parquet_files(spec.ledger_path) <= 1 + 3
    assert _parquet_files(spec.quarantine_path) <= 1 + 2


def test_rewind_works_for_a_state_path_delta_rs_lists_percent_encoded(tmp_path):
    """delta-rs lists data files percent-encoded: `lake house/` must not read as missing (found by review)."""
    from tests.conftest import oracle_spec_dict, write_spec

    base = oracle_spec_dict()
    spec_path = write_spec(tmp_path, oracle_spec_dict(state={**base["state"], "path": "lake house/état"}))
    _batches(spec_path, range(3))
    spec = load_spec(spec_path)
    assert status(spec).oldest_rewindable == 1
    rewind(spec, 1, run_id="test-rewind")
    _batches(spec_path, range(3, 4))
    assert_exact(spec_path)


def test_lost_folds_leave_no_copies_behind_once_maintain_passes_the_window(tmp_path, capsys):
    """Issue 46, item 5: a fold that loses its race (or is killed) has
    written a full copy of the state that no commit references; delta-rs's
    VACUUM removes only files a commit removed, so five lost folds left five
    copies for good. `maintain` now removes files no commit references once
    they are older than `maintenance.untracked_files_hours`; a younger one
    may be a write on its way to its commit, and stays. Nothing a kept
    version needs goes: every kept batch still rewinds exactly."""
    import os

    from spark_jobs.core.folding import fold
    from spark_jobs.core.pipeline import Pipeline
    from tests.conftest import oracle_spec_dict, write_spec

    base = oracle_spec_dict()
    spec_path = write_spec(tmp_path, oracle_spec_dict(
        state={**base["state"], "layout": "appended", "fold_at": 10.0},  # no fold but ours
        maintenance={"keep_batches": 3, "untracked_files_hours": 1.0},
    ))
    spec = load_spec(spec_path)
    state = Pipeline(spec).state

    def files() -> set[str]:
        return {p.name for p in Path(spec.state_path).glob("*.parquet")}

    write_wave(tmp_path / "landing", 0, files=1, records_per_file=30, users=6)
    assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
    copies: list[set[str]] = []
    for wave in range(1, 6):
        stale = state.open()
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=30, users=6)
        assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
        before = files()
        assert fold(spec, stale) is None, "the fold lost its race to the batch"
        copies.append(files() - before)
    assert all(copies), "each lost fold left its copy"
    lost = set().union(*copies)
    appended_files = len(open_table(spec.state_path).file_uris())
    capsys.readouterr()
    assert main(["maintain", str(spec_path)]) == 0
    # The fold is this layout's compaction: the report counts the files it
    # replaced (a review found "nothing to compact" after a fold of six).
    out = capsys.readouterr().out
    assert f"  state: {appended_files} file(s) compacted, " in out, (appended_files, out)
    assert lost <= files(), "copies younger than the window stay: they may be writes on their way"
    for path in Path(spec.state_path).glob("*.parquet"):  # two hours pass
        then = path.stat().st_mtime - 7200
        os.utime(path, (then, then))
    assert main(["maintain", str(spec_path)]) == 0
    assert not lost & files(), "the lost folds' copies are gone"
    assert_exact(spec_path)
    for batch in (5, 4):
        assert rewind(spec, batch, run_id=f"test-{batch}").status == "rewound"
        assert [r.batch_id for r in assert_exact(spec_path, drained=False)] == list(range(1, batch + 1))


def test_a_batch_committing_during_maintain_skips_the_state_s_vacuum_and_the_report_says_so(spec_path, capsys, monkeypatch):
    """A batch that commits between the state's compaction and its VACUUM
    moves the state: the VACUUM waits for the next maintenance, and the
    report's state line says so (it was missing, while `--json` had the
    compaction's count: found by a review)."""
    import spark_jobs.core.maintain as maintain_module

    spec = load_spec(spec_path)
    for wave in range(2):
        write_wave(spec_path.parent / "landing", wave, files=1, records_per_file=30, users=6)
        assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
    readers, raced = maintain_module._readers, []

    def a_batch_lands_first(path, table):
        if not raced and path == spec.state_path:
            raced.append(1)
            write_wave(spec_path.parent / "landing", 9, files=1, records_per_file=30, users=6)
            assert run_batch(spec, RunOptions(run_id="other"), ArrowCompute).status == "committed"
        return readers(path, table)

    monkeypatch.setattr(maintain_module, "_readers", a_batch_lands_first)
    capsys.readouterr()
    assert main(["maintain", str(spec_path)]) == 0
    state_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  state: ")]
    assert raced and state_line == ["  state: nothing to compact, VACUUM skipped (the table moved meanwhile), checkpoint written"], state_line
    assert_exact(spec_path)


def test_a_rewind_goes_to_no_batch_before_the_last_removal_of_untracked_files(tmp_path):
    """A state merged on read keeps its first batch's data files (its
    batches remove none), so batch 1 stays restorable by its data files
    after `maintain`'s removal of untracked files took the vector files of
    the batches after it. A rewind could then land while those files go
    (a review's reproduction): so no rewind goes before the removal's floor,
    and `status` says so, whatever a version's files."""
    import os
    import time

    from spark_jobs.core.fencing import STATE_FENCE
    from spark_jobs.core.maintain import restorable
    from spark_jobs.core.untracked import remove_untracked
    from tests.conftest import oracle_spec_dict, write_spec

    spec_dict = oracle_spec_dict()
    spec_dict["state"] = {**spec_dict["state"], "deletion_vectors": True}
    spec_path = write_spec(tmp_path, spec_dict)
    spec = load_spec(spec_path)
    for wave in range(8):  # a big first batch, then few users coming back: batches merged on read
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=600 if wave == 0 else 12, users=400)
        assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
    lineage = {r.batch_id: r.state_version for r in status_rows(spec)}
    old = time.time() - 3 * 3600
    for path in Path(spec.state_path).rglob("*"):
        if path.is_file() and "_delta_log" not in path.parts:
            os.utime(path, (old, old))
    assert remove_untracked(open_table(spec.state_path), lineage[7], 1, [STATE_FENCE]) >= 2
    assert restorable(spec.state_path, lineage[1]) and not all(restorable(spec.state_path, lineage[b]) for b in range(2, 7))
    assert status(spec).oldest_rewindable == 7
    with pytest.raises(RewindError, match=r"batch 1's state .* can no longer be restored.*rewound to: 0 and 7\.\.8"):
        rewind(spec, 1, run_id="test-rewind")
    # A later removal keeping more (a larger keep_batches) cannot give back what this one took: the floor stays.
    (Path(spec.state_path) / "part-00000-lost-fold.snappy.parquet").write_bytes(b"PAR1")
    os.utime(Path(spec.state_path) / "part-00000-lost-fold.snappy.parquet", (old, old))
    assert remove_untracked(open_table(spec.state_path), lineage[1], 1, [STATE_FENCE]) == 1
    assert status(spec).oldest_rewindable == 7
    with pytest.raises(RewindError, match=r"rewound to: 0 and 7\.\.8"):
        rewind(spec, 3 if restorable(spec.state_path, lineage[3]) else 1, run_id="test-rewind")
    assert rewind(spec, 7, run_id="test-rewind").batch_id == 7
    write_wave(tmp_path / "landing", 8, files=1, records_per_file=12, users=400)
    assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
    assert_exact(spec_path)


def status_rows(spec):
    from spark_jobs.core.ledger import OffsetLedger

    return OffsetLedger(spec.ledger_path, spec.name).load().lineage()


def test_change_data_no_log_entry_names_is_removed_and_named_change_data_kept(tmp_path):
    """A run killed between the executors' join with its changes and its
    commit leaves change files no version names (a review's reproduction:
    `maintain` never removed them). The removal of untracked files takes
    those, once older than its window, and keeps every change file a log
    entry still names: the kept versions' and the older ones' that
    downstreams may still read."""
    import os
    import shutil
    import time

    from spark_jobs.core.fencing import STATE_FENCE
    from spark_jobs.core.untracked import remove_untracked
    from tests.conftest import oracle_spec_dict, write_spec

    spec_dict = oracle_spec_dict()
    spec_dict["state"] = {**spec_dict["state"], "change_feed": True}
    spec = load_spec(write_spec(tmp_path, spec_dict))
    for wave in range(4):  # users coming back: delta-rs's MERGE writes change files
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=200, users=40)
        assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"
    folder = Path(spec.state_path) / "_change_data"
    named = sorted(p.name for p in folder.iterdir())
    assert len(named) >= 3
    orphan = folder / "cdc-orphan-of-a-killed-run.snappy.parquet"
    shutil.copy(folder / named[0], orphan)
    old = time.time() - 3 * 3600
    for path in Path(spec.state_path).rglob("*"):
        if path.is_file() and "_delta_log" not in path.parts:
            os.utime(path, (old, old))
    latest = open_table(spec.state_path).version()
    assert remove_untracked(open_table(spec.state_path), latest, 1, [STATE_FENCE]) >= 1  # (and the data files the MERGEs replaced)
    assert sorted(p.name for p in folder.iterdir()) == named, "only the change file no entry names went"
    table = open_table(spec.state_path)
    assert table.load_cdf(starting_version=1, ending_version=latest).read_all().num_rows > 0
