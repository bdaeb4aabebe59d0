"""Fences under real concurrency: processes racing on tables that do not exist yet.

Regression test: the first fenced write used to create the table, and a
second writer that found the table already there appended its own row from a
snapshot that already held the winner's, so both landed. Processes are
spawned (delta-rs's runtime is not fork-safe) and released together by a
barrier.
"""

from __future__ import annotations

import multiprocessing as mp

import pyarrow as pa

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.fencing import STATE_FENCE, Position
from spark_jobs.core.ledger import LedgerRow, OffsetLedger, RowStatus
from spark_jobs.core.spec import load_spec
from tests.conftest import commit_updates

RACERS = 6


def _plan(ledger_path: str, barrier, results) -> None:
    ledger = OffsetLedger(ledger_path, "clicks")
    view = ledger.load()
    barrier.wait()
    row = LedgerRow(0, 1, RowStatus.PLANNED, pipeline="clicks", start_offsets={"files": 0}, end_offsets={"files": 1})
    results.put(ledger.append(view, row, "microbatch.plan"))


def _commit_state(spec_file: str, barrier, results) -> None:
    from spark_jobs.core.delta_io import is_commit_conflict
    from spark_jobs.core.state import StateTable

    state = StateTable(load_spec(spec_file))
    updates = pa.table({"k": ["a"], "n": pa.array([1], pa.int64())})
    barrier.wait()
    table = state.open() or state.create(updates)
    if state.position(table) >= Position(0, 1):
        results.put("saw it committed")
        return
    try:
        commit_updates(state, table, updates, Position(0, 1))
        results.put("committed")
    except Exception as exc:
        results.put("conflict" if is_commit_conflict(exc) else repr(exc))


def _create(base: str, rounds: int, barrier, results) -> None:
    """Race to create `rounds` new tables, one per barrier release."""
    from spark_jobs.core.delta_io import ensure_table

    for i in range(rounds):
        barrier.wait()
        results.put(ensure_table(f"{base}/t{i}", pa.schema([("n", pa.int64())])).version())


def racing_creators_make_one_create_commit(base: str, rounds: int = 8) -> None:
    """Shared by the S3 test: every racer sees version 0 and no table has a version 1."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_create, args=(base, rounds, barrier, results)) for _ in range(RACERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    versions = [results.get(timeout=5) for _ in range(RACERS * rounds)]
    assert versions == [0] * (RACERS * rounds), versions
    assert all(open_table(f"{base}/t{i}").version() == 0 for i in range(rounds))


def _race(target, *args) -> list:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for _ in range(RACERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [results.get(timeout=5) for _ in procs]


def test_racing_planners_on_a_new_ledger_append_one_row(tmp_path):
    path = str(tmp_path / "offsets")
    outcomes = _race(_plan, path)
    assert outcomes.count(True) == 1, outcomes
    rows = read_all(open_table(path)).to_pylist()
    assert len(rows) == 1


def test_racing_creators_make_one_create_commit(tmp_path):
    """Regression: delta-rs retries a CREATE that lost the race as the next
    version (a second CREATE with a new table id). A fenced commit in flight
    then conflicts with that metadata change and reads as "another run won",
    and a run failed with "could not plan". Seen on S3 in CI (issue 5)."""
    racing_creators_make_one_create_commit(str(tmp_path))


def test_racing_first_state_commits_merge_once(tmp_path):
    from tests.conftest import oracle_spec_dict, write_spec

    spec = oracle_spec_dict()
    spec["state"] = {"path": "lake/state", "keys": ["k"], "merge": {"n": "sum"}}
    spec_file = write_spec(tmp_path, spec)
    outcomes = _race(_commit_state, str(spec_file))
    assert outcomes.count("committed") == 1, outcomes
    assert set(outcomes) <= {"committed", "conflict", "saw it committed"}, outcomes
    table = open_table(str(tmp_path / "lake" / "state"))
    assert read_all(table).to_pylist() == [{"k": "a", "n": 1, "_batch_id": 1}]
    assert Position.decode(table.transaction_version(STATE_FENCE)) == Position(0, 1)


def test_ledger_compaction_keeps_rows_and_fences(tmp_path):
    from spark_jobs.core.fencing import PLAN_FENCE
    from spark_jobs.core.fencing import transaction_position
    from spark_jobs.core.ledger import COMPACT_AT_FILES, scoped

    ledger = OffsetLedger(str(tmp_path / "offsets"), "clicks")
    for batch in range(1, COMPACT_AT_FILES + 2):
        row = LedgerRow(0, batch, RowStatus.PLANNED, pipeline="clicks", start_offsets={"files": batch - 1}, end_offsets={"files": batch})
        assert ledger.append(ledger.load(), row, PLAN_FENCE)
    table = open_table(ledger.path)
    assert len(table.file_uris()) > COMPACT_AT_FILES
    assert ledger.compact()
    table = open_table(ledger.path)
    assert len(table.file_uris()) == 1
    view = ledger.load()
    assert sorted(r.batch_id for r in view.rows) == list(range(1, COMPACT_AT_FILES + 2))
    assert transaction_position(view.table, scoped(PLAN_FENCE, "clicks")) == Position(0, COMPACT_AT_FILES + 1)
    # The fence still refuses a replayed append after compaction.
    again = LedgerRow(0, 5, RowStatus.PLANNED, pipeline="clicks", start_offsets={"files": 4}, end_offsets={"files": 5})
    assert not ledger.append(view, again, PLAN_FENCE)
    assert not ledger.compact()  # nothing left to compact
