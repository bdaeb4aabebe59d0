"""Merge rules and multi-column keys against a real Delta table (no Spark needed)."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
import pytest

from spark_jobs.core.commits import CommitKind, CommitMetadata
from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.errors import TransformError
from spark_jobs.core.fencing import STATE_FENCE, Position
from spark_jobs.core.spec import load_spec
from tests.conftest import commit_updates, oracle_spec_dict, write_spec


def _spec(tmp_path, keys, merge):
    spec = oracle_spec_dict()
    spec["state"] = {"path": "lake/state", "keys": keys, "merge": merge}
    return load_spec(write_spec(tmp_path, spec))


def _rows(spec, keys):
    rows = read_all(open_table(spec.state_path)).to_pylist()
    return {tuple(r[k] for k in keys): r for r in rows}


def test_each_merge_rule(tmp_path):
    from spark_jobs.core.state import StateTable

    merge = {"s": "sum", "lo": "min", "hi": "max", "f": "first", "l": "last"}
    spec = _spec(tmp_path, ["k"], merge)
    state = StateTable(spec)
    first = pa.table({"k": ["a", "b", "c"], "s": [1, 2, None], "lo": [5, 5, None], "hi": [5, 5, 5], "f": ["x", None, "x"], "l": ["x", "x", "x"]})
    commit_updates(state, state.create(first), first, Position(0, 1))
    second = pa.table({"k": ["a", "b", "c", "d"], "s": [10, None, 3, 4], "lo": [3, 9, 1, 4], "hi": [9, 1, None, 4], "f": ["y", "y", "y", "y"], "l": ["y", None, "y", "y"]})
    version, keys_updated = commit_updates(state, state.open(), second, Position(0, 2))
    assert keys_updated == 4
    rows = _rows(spec, ["k"])
    assert {k[0]: r["s"] for k, r in rows.items()} == {"a": 11, "b": 2, "c": 3, "d": 4}
    assert {k[0]: r["lo"] for k, r in rows.items()} == {"a": 3, "b": 5, "c": 1, "d": 4}
    assert {k[0]: r["hi"] for k, r in rows.items()} == {"a": 9, "b": 5, "c": 5, "d": 4}
    # first keeps the existing value (the batch's only where there was none)
    assert {k[0]: r["f"] for k, r in rows.items()} == {"a": "x", "b": "y", "c": "x", "d": "y"}
    # last takes the batch's value, null included
    assert {k[0]: r["l"] for k, r in rows.items()} == {"a": "y", "b": None, "c": "y", "d": "y"}
    assert {k[0]: r["_batch_id"] for k, r in rows.items()} == {"a": 2, "b": 2, "c": 2, "d": 2}
    table = open_table(spec.state_path)
    assert Position.decode(table.transaction_version(STATE_FENCE)) == Position(0, 2)
    assert table.version() == version


def test_multi_column_keys(tmp_path):
    from spark_jobs.core.state import StateTable

    spec = _spec(tmp_path, ["country", "user_id"], {"n": "sum", "seen": "max"})
    state = StateTable(spec)
    t1 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    t2 = datetime(2026, 1, 2, tzinfo=timezone.utc)
    first = pa.table({"country": ["de", "fr"], "user_id": ["u1", "u1"], "n": [1, 1], "seen": [t1, t1]})
    commit_updates(state, state.create(first), first, Position(0, 1))
    commit_updates(state, state.open(), pa.table({"country": ["de", "de"], "user_id": ["u1", "u2"], "n": [5, 1], "seen": [t2, t1]}), Position(0, 2))
    rows = _rows(spec, ["country", "user_id"])
    assert {k: r["n"] for k, r in rows.items()} == {("de", "u1"): 6, ("fr", "u1"): 1, ("de", "u2"): 1}
    assert rows[("de", "u1")]["seen"] == t2


def test_batch_with_a_column_the_state_lacks_is_refused(tmp_path):
    from spark_jobs.core.state import StateTable

    spec = _spec(tmp_path, ["k"], {"n": "sum"})
    state = StateTable(spec)
    first = pa.table({"k": ["a"], "n": [1]})
    commit_updates(state, state.create(first), first, Position(0, 1))
    with pytest.raises(TransformError, match="column 'n' is STRING, which `sum` cannot add"):
        commit_updates(state, state.open(), pa.table({"k": ["a"], "n": ["not a number"]}), Position(0, 2))
    spec = _spec(tmp_path / "last", ["k"], {"n": "last"})
    state = StateTable(spec)
    commit_updates(state, state.create(first), first, Position(0, 1))
    with pytest.raises(TransformError, match="do not fit the state table's types"):
        commit_updates(state, state.open(), pa.table({"k": ["a"], "n": ["not a number"]}), Position(0, 2))


def test_find_commit_looks_past_later_commits(tmp_path):
    """Another writer's commits after ours (an OPTIMIZE, say) do not hide it."""
    from deltalake import write_deltalake

    from spark_jobs.core.state import StateTable

    spec = _spec(tmp_path, ["k"], {"n": "sum"})
    state = StateTable(spec)
    first = pa.table({"k": ["a"], "n": [1]})
    version, _ = commit_updates(state, state.create(first), first, Position(0, 1))
    for i in range(20):  # more than the first search windows
        write_deltalake(spec.state_path, pa.table({"k": [f"x{i}"], "n": [0], "_batch_id": [0]}), mode="append")
    found = state.find_commit(state.open(), Position(0, 1))
    assert found is not None and found.version == version
    assert state.find_commit(state.open(), Position(0, 2)) is None


def test_a_restore_that_commits_nothing_does_not_take_a_concurrent_commit_for_its_own(tmp_path):
    """Emptying a state with no data files makes no delta-rs commit. If a batch
    commits right then, the restore must still move the fence itself (and lose
    to that batch), not report the batch's version as its own."""
    from deltalake import write_deltalake

    from spark_jobs.core.delta_io import is_commit_conflict
    from spark_jobs.core.fencing import commit_properties, transaction_position
    from spark_jobs.core.state import StateTable

    spec = _spec(tmp_path, ["user_id"], {"events": "sum"})
    state = StateTable(spec)
    table = state.create(pa.table({"user_id": pa.array([], pa.string()), "events": pa.array([], pa.int64())}))
    empty = pa.schema(table.schema().to_arrow()).empty_table()
    checked = open_table(spec.state_path)  # the snapshot the rewind checked
    delete = checked.delete

    def delete_while_a_batch_commits(**kwargs):
        metrics = delete(**kwargs)  # nothing to delete: no commit
        write_deltalake(open_table(spec.state_path), empty, mode="append",
                        commit_properties=commit_properties(STATE_FENCE, Position(0, 1), {}))
        return metrics

    checked.delete = delete_while_a_batch_commits
    with pytest.raises(Exception) as info:
        state.restore(checked, None, CommitMetadata(kind=CommitKind.REWIND, pipeline=spec.name, position=Position(1, 0), start_offsets={}, end_offsets={}, run_id="test"))
    assert is_commit_conflict(info.value)
    assert transaction_position(open_table(spec.state_path), STATE_FENCE) == Position(0, 1)


def test_find_commit_on_a_handle_older_than_the_table_gives_the_commits_own_version(tmp_path):
    """Issue 46, item 1: delta-rs 1.6.6's `history()` numbers entries down
    from the handle's version (delta-rs#4488), so on a handle opened before a
    later commit the batch's commit came back one version too low."""
    from deltalake import DeltaTable

    from spark_jobs.core.state import StateTable

    spec = _spec(tmp_path, ["k"], {"n": "sum"})
    state = StateTable(spec)
    first = pa.table({"k": ["a"], "n": [1]})
    commit_updates(state, state.create(first), first, Position(0, 1))
    version, _ = commit_updates(state, state.open(), pa.table({"k": ["a"], "n": [2]}), Position(0, 2))
    stale = state.open()
    DeltaTable(spec.state_path).alter.set_table_properties({"delta.logRetentionDuration": "interval 31 days"})
    found = state.find_commit(stale, Position(0, 2))
    assert found is not None and found.version == version == stale.version()
    assert state.outside_changes(stale, version - 1) == []


def test_a_decimal_key_past_a_float_s_digits_is_merged_once(tmp_path):
    """Issue 62's DECIMAL(38,0) key, on the driver's MERGE: the files'
    statistics of such a key pass through a float and are rounded, and a
    MERGE that pruned files by them skipped the file holding a returning key
    and stored it twice (`state._bounded_by_statistics`). The type matrix
    (engine/test_state_write_types.py, every way of writing) runs it in
    `make soak`; this is its guard in `make test`."""
    from decimal import Decimal

    from spark_jobs.core.state import StateTable

    spec = _spec(tmp_path, ["k"], {"n": "sum"})
    state = StateTable(spec)
    key = pa.decimal128(38, 0)
    nines, eights, long = Decimal("9" * 38), Decimal("9" * 37 + "8"), Decimal("12345678901234567890123456789012345678")
    batches = [[nines, long], [nines, eights, Decimal(1)], [Decimal(1), eights, nines, long]]
    for batch, keys in enumerate(batches, start=1):
        updates = pa.table({"k": pa.array(keys, key), "n": [1] * len(keys)})
        table = state.create(updates) if batch == 1 else state.open()
        commit_updates(state, table, updates, Position(0, batch))
    rows = read_all(open_table(spec.state_path)).to_pylist()
    assert sorted(r["k"] for r in rows) == sorted({nines, eights, long, Decimal(1)}), "a key is in the state more than once"
    assert {r["k"]: r["n"] for r in rows} == {nines: 3, eights: 2, long: 2, Decimal(1): 2}
