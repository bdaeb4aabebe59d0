"""A replay reads what was planned, a stuck batch has a way out, and status
tells the truth (issue 11, sections 6 and 7). JVM-free: the pure-Arrow compute
runs the real protocol on real Delta tables."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone

import pytest

from spark_jobs.cli import main
from spark_jobs.core import faults
from spark_jobs.core.inspect import status
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import EXIT_TERMINAL, SourceChangedError
from tests.conftest import assert_exact, crash_at
from tests.spark_jobs.arrow_compute import ArrowCompute


def _run(spec, **options):
    return run_batch(spec, RunOptions(run_id="test", **options), ArrowCompute)


def _plan_then_crash(spec) -> None:
    """A run that records its plan and dies before reading (as a kill after step 2)."""
    with crash_at("after_plan"):
        _run(spec)


def test_a_planned_file_rewritten_before_the_replay_is_refused_by_name(spec_path, capsys):
    """Reproduced: the replay read the new content, and a bad record ended up in
    neither the state nor the quarantine."""
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    [path] = write_wave(landing, 0, files=1, records_per_file=30, bad_every=7)
    _plan_then_crash(spec)
    path.write_text(path.read_text() + '{"event_id": "late", "user_id": "u9", "amount": 1.0, "ts": "2026-01-01T00:00:00+00:00"}\n')
    with pytest.raises(SourceChangedError, match=rf"{path.name} .* was rewritten \(planned: .* bytes") as info:
        _run(spec)
    assert "Put the planned file back" in str(info.value) and "--to-batch K" in str(info.value)
    assert main(["-q", "run", str(spec_path)]) == EXIT_TERMINAL
    assert "was rewritten" in capsys.readouterr().err
    # The way out with no state table yet: a rewind to 0 (recorded in the ledger alone).
    assert "was rewritten" in (status(spec).note or "")
    assert rewind(spec, 0, run_id="test-rewind").epoch == 1
    outcome = _run(spec)
    assert (outcome.status, outcome.epoch, outcome.batch_id) == ("committed", 1, 1)
    assert_exact(spec_path)


def test_a_stuck_batch_whose_file_is_gone_is_shown_and_rewind_gets_out(spec_path):
    """Reproduced: a planned batch whose file was deleted failed every run,
    status showed "1 file waiting" and no note, and rewind refused."""
    spec = load_spec(spec_path)
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=20)
    assert _run(spec).status == "committed"
    [gone] = write_wave(landing, 1, files=1, records_per_file=20)
    _plan_then_crash(spec)
    gone.unlink()
    with pytest.raises(SourceChangedError, match=f"{gone.name} .* is gone"):
        _run(spec, max_files=1)
    st = status(spec)
    assert "is gone since this batch was planned" in (st.note or "")
    assert st.lag is not None and st.lag.count == 0
    rewind(spec, 1, run_id="test-rewind")  # the last committed batch: the stuck plan no longer applies
    write_wave(landing, 2, files=1, records_per_file=20)
    assert _run(spec).status == "committed"
    lineage = assert_exact(spec_path)
    assert [(r.epoch, r.batch_id) for r in lineage] == [(0, 1), (1, 2)]


def test_rewind_to_the_head_without_a_pending_plan_is_still_refused(spec_path):
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=5)
    spec = load_spec(spec_path)
    assert _run(spec).status == "committed"
    from spark_jobs.errors import RewindError

    with pytest.raises(RewindError, match="no pending plan; nothing to rewind"):
        rewind(spec, 1, run_id="test-rewind")


def test_files_dated_in_the_future_are_counted_apart_and_a_bounded_run_says_why_it_skips_them(spec_path, caplog):
    """Reproduced: a file dated 2027 showed as waiting while every scheduled run
    said "interval already covered"."""
    spec = load_spec(spec_path)
    [future] = write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=5)
    later = datetime(2030, 1, 1, tzinfo=timezone.utc).timestamp()
    os.utime(future, (later, later))
    lag = status(spec).lag
    assert lag is not None and (lag.count, lag.future) == (1, 1)
    assert "dated in the future" in lag.describe()
    now = datetime.now(timezone.utc)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        outcome = _run(spec, interval_end=now)
    assert outcome.status == "no_new_data"
    assert "1 file(s) waiting are dated in the future" in caplog.text
    assert _run(spec).status == "committed"  # a manual run takes it
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    assert [r.status for r in rows if r.status is RowStatus.COMMITTED] == [RowStatus.COMMITTED]


def test_a_state_at_the_origin_agrees_only_with_a_ledger_only_rewind(spec_path):
    """A replaced (unfenced) state after an ordinary rewind to 0 is not the ledger's (found by review)."""
    import shutil

    import pyarrow as pa
    from deltalake import write_deltalake

    from spark_jobs.errors import StateBehindLedgerError

    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    assert _run(spec).status == "committed"
    rewind(spec, 0, run_id="test-rewind")
    shutil.rmtree(spec.state_path)
    write_deltalake(spec.state_path, pa.table({"user_id": ["u1"], "events": pa.array([1], pa.int64())}))
    with pytest.raises(StateBehindLedgerError):
        _run(spec)


def test_a_run_planned_before_a_ledger_only_rewind_does_not_commit(spec_path):
    """Nothing fences a state never committed to: the run finds the rewind in the ledger (found by review)."""
    spec = load_spec(spec_path)
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)

    def rewind_meanwhile(point: str) -> None:
        if point == "after_plan":
            faults.set_hook(None)
            assert rewind(spec, 0, run_id="test-rewind").epoch == 1

    faults.set_hook(rewind_meanwhile)
    try:
        outcome = _run(spec)
    finally:
        faults.set_hook(None)
    assert outcome.status == "already_committed" and "rewound" in outcome.message
    outcome = _run(spec)
    assert (outcome.status, outcome.epoch, outcome.batch_id) == ("committed", 1, 1)
    assert_exact(spec_path)
