"""A batch merged into a state file's rows in pyarrow (`arrow_rows.merged_rows`: an
executors' writing task's merge, and the job's merge-on-read)
against delta-rs's MERGE with the same rules
(`state.merge_expression`), on real Delta tables in `tmp_path`: every
rule, with nulls on either side, NaNs, DECIMAL(38) sums, strings and
timestamps; keys coming back and keys new. No Spark: the task's function
is called here as a task would call it."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from spark_jobs.core.delta_io import read_all
from spark_jobs.core.state import merge_expression
from spark_jobs.core.arrow_rows import merged_rows

RULES = {"total": "sum", "money": "sum", "low": "min", "high": "max", "name": "min", "seen": "max", "first": "first", "last": "last"}
SCHEMA = pa.schema([
    ("k", pa.string()), ("total", pa.int64()), ("money", pa.decimal128(38, 2)), ("low", pa.float64()), ("high", pa.float64()),
    ("name", pa.string()), ("seen", pa.timestamp("us", tz="UTC")), ("first", pa.string()), ("last", pa.string()), ("_batch_id", pa.int64()),
])


def _at(hour: int | None) -> datetime | None:
    return None if hour is None else datetime(2026, 11, 28, hour, tzinfo=timezone.utc)


OLD = pa.table({
    "k": ["a", "b", "c", "d", "e"],
    "total": [1, None, 3, 4, 5],
    "money": [Decimal("1.25"), Decimal("2.00"), None, Decimal("4.00"), Decimal("5.00")],
    "low": [1.0, math.nan, None, 4.0, -0.5],
    "high": [1.0, 2.0, math.nan, None, 5.0],
    "name": ["m", None, "c", "d", "e"],
    "seen": [_at(1), None, _at(3), _at(4), _at(5)],
    "first": [None, "b0", "c0", "d0", "e0"],
    "last": ["a0", "b0", None, "d0", "e0"],
    "_batch_id": [1, 1, 1, 1, 1],
}, schema=SCHEMA)

UPDATES = pa.table({
    "k": ["d", "a", "x", "b", "c"],
    "total": [10, 20, 30, 40, None],
    "money": [None, Decimal("0.75"), Decimal("9.99"), Decimal("1.01"), Decimal("3.50")],
    "low": [None, 0.5, 7.0, 1.0, math.nan],
    "high": [3.0, math.nan, 8.0, None, 1.0],
    "name": ["a", "z", "x", "q", None],
    "seen": [_at(9), _at(0), _at(2), _at(6), None],
    "first": ["d1", "a1", "x1", None, "c1"],
    "last": [None, "a1", "x1", "b1", "c1"],
    "_batch_id": [2, 2, 2, 2, 2],
}, schema=SCHEMA)


def _rows(table: pa.Table) -> dict[str, dict]:
    def same(value):
        return "NaN" if isinstance(value, float) and math.isnan(value) else value

    return {r["k"]: {c: same(v) for c, v in r.items()} for r in table.to_pylist()}


def test_a_file_merged_where_it_stands_holds_what_delta_rs_s_merge_would(tmp_path):
    path = str(tmp_path / "state")
    write_deltalake(path, OLD)
    table = DeltaTable(path)
    updates = {f'"{c}"': merge_expression(c, rule) for c, rule in RULES.items()}
    updates['"_batch_id"'] = 's."_batch_id"'
    (
        table.merge(UPDATES, predicate='t."k" = s."k"', source_alias="s", target_alias="t")
        .when_matched_update(updates=updates)
        .when_not_matched_insert(updates={f'"{c}"': f's."{c}"' for c in SCHEMA.names})
        .execute()
    )
    merged, taken = merged_rows(OLD, UPDATES, ["k"], RULES, "_batch_id")
    assert merged.schema == SCHEMA
    assert sorted(taken.to_pylist()) == [0, 1, 3, 4], "every update whose key the file holds; not x's"
    expected = _rows(read_all(DeltaTable(path)))
    del expected["x"]  # an insert: written apart, by the batch's own task (`_inserter`)
    assert _rows(merged) == expected


def test_a_sum_that_does_not_fit_the_column_fails_the_task_rather_than_wrapping():
    old = OLD.set_column(1, "total", pa.array([2**62] * 5, pa.int64()))
    updates = UPDATES.set_column(1, "total", pa.array([2**62] * 5, pa.int64()))
    with pytest.raises(pa.ArrowInvalid, match="overflow"):
        merged_rows(old, updates, ["k"], RULES, "_batch_id")


def test_keys_of_two_columns_match_only_whole(tmp_path):
    """A key of two columns (joined, not looked up): ('a', 2) meets ('a', 2)
    only; ('a', 1) stays as it was and ('b', 1) is left to the insert."""
    schema = pa.schema([("k", pa.string()), ("n", pa.int32()), ("total", pa.int64()), ("_batch_id", pa.int64())])
    old = pa.table({"k": ["a", "a"], "n": [1, 2], "total": [10, 20], "_batch_id": [1, 1]}, schema=schema)
    updates = pa.table({"k": ["b", "a"], "n": [1, 2], "total": [5, 7], "_batch_id": [2, 2]}, schema=schema)
    merged, taken = merged_rows(old, updates, ["k", "n"], {"total": "sum"}, "_batch_id")
    assert merged.to_pylist() == [
        {"k": "a", "n": 1, "total": 10, "_batch_id": 1},
        {"k": "a", "n": 2, "total": 27, "_batch_id": 2},
    ]
    assert taken.to_pylist() == [1]


def test_a_float_key_minus_zero_is_the_key_zero_as_the_merge_compares_it():
    """-0.0 = 0.0 in Spark's and DataFusion's SQL: the batch's -0.0 updates
    the state's 0.0, as delta-rs's MERGE does (a lookup by value told them
    apart: found by a review); the file keeps its own key."""
    schema = pa.schema([("k", pa.float64()), ("total", pa.int64()), ("_batch_id", pa.int64())])
    old = pa.table({"k": [0.0, 1.0], "total": [1, 1], "_batch_id": [1, 1]}, schema=schema)
    updates = pa.table({"k": [-0.0], "total": [5], "_batch_id": [2]}, schema=schema)
    merged, taken = merged_rows(old, updates, ["k"], {"total": "sum"}, "_batch_id")
    assert [(r["k"], r["total"]) for r in merged.to_pylist()] == [(0.0, 6), (1.0, 1)]
    assert taken.to_pylist() == [0]
    two = pa.schema([("k", pa.float64()), ("n", pa.int32()), ("total", pa.int64()), ("_batch_id", pa.int64())])
    merged, taken = merged_rows(
        pa.table({"k": [0.0], "n": [1], "total": [1], "_batch_id": [1]}, schema=two),
        pa.table({"k": [-0.0], "n": [1], "total": [5], "_batch_id": [2]}, schema=two),
        ["k", "n"], {"total": "sum"}, "_batch_id",
    )
    assert merged.column("total").to_pylist() == [6] and taken.to_pylist() == [0]
