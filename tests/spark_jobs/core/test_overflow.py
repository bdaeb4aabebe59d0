"""Sums that outgrow their column, widening a column, and new merge columns,
against real Delta tables (no Spark needed).

delta-rs's MERGE adds in the column's own type: integers wrap, floats go to
infinity, and a decimal past its precision fails the MERGE with a ValueError
(exit 1, and every replay meets it again). Each case must instead be refused
before the state commit with `MergeOverflowError` (exit 2).
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from spark_jobs.core import widen
from spark_jobs.core.compute import QUARANTINE_COLUMNS, ComputeResult, validate_updates
from spark_jobs.core.delta_io import is_commit_conflict, open_table, read_all
from spark_jobs.core.fencing import STATE_FENCE, Position, transaction_position
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import PipelineSpec, load_spec
from spark_jobs.core.state import StateTable
from spark_jobs.errors import EXIT_TERMINAL, ConcurrentRunError, MergeOverflowError, TransformError, exit_code
from spark_jobs.sources.base import BatchRange
from tests.conftest import batch_metadata, commit_updates, oracle_spec_dict, write_spec

INT_LIMITS = {pa.int8(): 127, pa.int16(): 32767, pa.int32(): 2**31 - 1, pa.int64(): 2**63 - 1}


def _spec(tmp_path: Path, merge: dict[str, str]) -> PipelineSpec:
    spec = oracle_spec_dict()
    spec["state"] = {"path": "lake/state", "keys": ["k"], "merge": merge}
    return load_spec(write_spec(tmp_path, spec))


def _batch(values: dict[str, pa.Array], keys: tuple[str, ...] = ("a",)) -> pa.Table:
    return pa.table({"k": list(keys), **values})


def _started(tmp_path: Path, first: pa.Table, merge: dict[str, str] | None = None) -> StateTable:
    """A state whose batch 1 committed `first`."""
    state = StateTable(_spec(tmp_path, merge or {"n": "sum"}))
    commit_updates(state, state.create(first), first, Position(0, 1))
    return state


def _values(state: StateTable, column: str = "n") -> dict[str, object]:
    return {r["k"]: r[column] for r in read_all(state.open()).to_pylist()}


def _refused(state: StateTable, batch: pa.Table) -> MergeOverflowError:
    """The next batch is refused with nothing committed."""
    before = state.open().version()
    with pytest.raises(MergeOverflowError) as info:
        commit_updates(state, state.open(), batch, state.position(state.open()).next())
    assert state.open().version() == before
    assert exit_code(info.value) == EXIT_TERMINAL
    return info.value


def test_smallint_sum_past_its_range_is_refused_not_wrapped(tmp_path):
    state = _started(tmp_path, _batch({"n": pa.array([30000, 5], pa.int16())}, ("a", "b")))
    error = _refused(state, _batch({"n": pa.array([30000, 1], pa.int16())}, ("a", "b")))
    message = str(error)
    assert "{'k': 'a'}" in message and "'n'" in message and "SMALLINT" in message
    assert "30000" in message and "60000" in message  # old value, batch value, the true sum
    assert "CAST(sum(" in message  # the remedy
    assert _values(state) == {"a": 30000, "b": 5}


@pytest.mark.parametrize("arrow_type", [pa.int8(), pa.int32(), pa.int64()], ids=str)
@pytest.mark.parametrize("sign", [1, -1], ids=["up", "down"])
def test_every_integer_width_is_refused_past_its_range(tmp_path, arrow_type, sign):
    limit = INT_LIMITS[arrow_type] if sign > 0 else -INT_LIMITS[arrow_type] - 1
    state = _started(tmp_path, _batch({"n": pa.array([limit], arrow_type)}))
    error = _refused(state, _batch({"n": pa.array([sign], arrow_type)}))
    assert str(limit + sign) in str(error)
    assert _values(state) == {"a": limit}


@pytest.mark.parametrize("arrow_type", [pa.float32(), pa.float64()], ids=str)
def test_float_sum_to_infinity_is_refused(tmp_path, arrow_type):
    big = 3e38 if arrow_type == pa.float32() else 1.7e308
    state = _started(tmp_path, _batch({"n": pa.array([big], arrow_type)}))
    assert "inf" in str(_refused(state, _batch({"n": pa.array([big], arrow_type)})))


def test_decimal_sum_past_its_precision_is_refused_not_a_value_error(tmp_path):
    decimal = pa.decimal128(8, 2)
    state = _started(tmp_path, _batch({"n": pa.array([Decimal("999999.99")], decimal)}))
    error = _refused(state, _batch({"n": pa.array([Decimal("0.01")], decimal)}))
    assert "999999.99" in str(error) and "1000000.00" in str(error) and "DECIMAL(8,2)" in str(error)


@pytest.mark.parametrize("sign", [1, -1], ids=["up", "down"])
def test_decimal_sum_beyond_64_bits_is_refused_though_its_statistics_are_clamped(tmp_path, sign):
    """Reproduced: delta-rs writes the min/max statistics of a DECIMAL value
    beyond 2^63 clamped to the int64 range. The check trusted that bound and
    file pruning hid the row, so the MERGE failed with a raw ValueError (exit 1)."""
    decimal = pa.decimal128(38, 0)
    big = sign * (10**38 - 10**20)
    state = _started(tmp_path, _batch({"n": pa.array([Decimal(big), Decimal(sign * 10**25)], decimal)}, ("a", "b")))
    error = _refused(state, _batch({"n": pa.array([Decimal(sign * 10**21)], decimal)}))
    assert str(big) in str(error) and "DECIMAL(38,0)" in str(error)
    assert _values(state) == {"a": Decimal(big), "b": Decimal(sign * 10**25)}
    # A batch that fits still commits.
    commit_updates(state, state.open(), _batch({"n": pa.array([Decimal(sign * 10**19)], decimal)}), state.position(state.open()).next())
    assert _values(state)["a"] == Decimal(big + sign * 10**19)


@pytest.mark.parametrize(
    ("decimal", "start", "add"),
    [
        (pa.decimal128(18, 2), Decimal("9999999999999998.99"), Decimal("1.01")),
        (pa.decimal128(38, 6), Decimal("99999999999999999999999999999999.499999"), Decimal("0.500001")),
    ],
    ids=["18,2", "38,6"],
)
def test_decimal_sum_just_past_its_precision_is_refused_though_its_statistics_are_rounded(tmp_path, decimal, start, add):
    """delta-rs writes a scaled decimal's statistics through a float, rounded
    below the value (9999999999999998.99 as 9999999999999998.00): a bound
    that proved the sum safe let the MERGE fail with a raw ValueError."""
    state = _started(tmp_path, _batch({"n": pa.array([start], decimal)}))
    error = _refused(state, _batch({"n": pa.array([add], decimal)}))
    assert str(start) in str(error)
    assert _values(state) == {"a": start}


@pytest.mark.parametrize(
    ("arrow_type", "start", "add", "total"),
    [
        (pa.int16(), 30000, 2767, 32767),
        (pa.int16(), -30000, -2768, -32768),
        (pa.int64(), 2**63 - 2, 1, 2**63 - 1),
        (pa.decimal128(8, 2), Decimal("999999.98"), Decimal("0.01"), Decimal("999999.99")),
        (pa.float32(), 1.5e38, 1.5e38, pytest.approx(3e38, rel=1e-6)),
    ],
    ids=["smallint-max", "smallint-min", "bigint-max", "decimal-max", "float"],
)
def test_a_sum_that_reaches_the_limit_without_passing_it_commits(tmp_path, arrow_type, start, add, total):
    state = _started(tmp_path, _batch({"n": pa.array([start], arrow_type)}))
    commit_updates(state, state.open(), _batch({"n": pa.array([add], arrow_type)}), Position(0, 2))
    assert _values(state) == {"a": total}


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_a_non_finite_batch_value_is_refused_naming_the_column(tmp_path, bad):
    """The source cannot hold one (the quarantine refuses them): the transform overflowed."""
    state = _started(tmp_path, _batch({"amount": pa.array([1.0], pa.float32())}), {"amount": "max"})
    error = _refused(state, _batch({"amount": pa.array([bad], pa.float32())}))
    assert "'amount'" in str(error) and "{'k': 'a'}" in str(error)


def test_a_batch_that_cannot_overflow_skips_the_exact_check(tmp_path, monkeypatch):
    """The state's file statistics bound every sum: the state is not read."""
    state = _started(tmp_path, _batch({"n": pa.array(range(100), pa.int16())}, tuple(f"k{i}" for i in range(100))))

    def no_exact_check(*args, **kwargs):
        raise AssertionError("the exact check ran although the statistics bound the sum")

    monkeypatch.setattr(widen, "exact_overflow", no_exact_check)
    commit_updates(state, state.open(), _batch({"n": pa.array([7], pa.int16())}, ("k3",)), Position(0, 2))
    assert _values(state)["k3"] == 10


def test_a_sum_near_the_limit_takes_the_exact_check_which_decides_per_key(tmp_path, monkeypatch):
    calls = []
    exact = widen.exact_overflow
    monkeypatch.setattr(widen, "exact_overflow", lambda *a, **kw: calls.append(1) or exact(*a, **kw))
    state = _started(tmp_path, _batch({"n": pa.array([10, 32000, 30000], pa.int16())}, ("a", "b", "c")))
    # The statistics cannot rule out 32000 + 3000, but "b" gets the negative value.
    commit_updates(state, state.open(), _batch({"n": pa.array([3000, -3000], pa.int16())}, ("a", "b")), Position(0, 2))
    assert len(calls) == 1 and _values(state) == {"a": 3010, "b": 29000, "c": 30000}
    error = _refused(state, _batch({"n": pa.array([1, 2767, 2768], pa.int16())}, ("a", "b", "c")))
    assert len(calls) == 2 and "{'k': 'c'}" in str(error) and "32768" in str(error)


def test_missing_statistics_fall_back_to_the_exact_check(tmp_path):
    state = StateTable(_spec(tmp_path, {"n": "sum"}))
    first = _batch({"n": pa.array([30000], pa.int16())})
    table = state.create(first)
    table.alter.set_table_properties({"delta.dataSkippingNumIndexedCols": "0"})
    commit_updates(state, state.open(), first, Position(0, 1))
    stats = pa.table(state.open().get_add_actions(flatten=True))
    assert "max.n" not in stats.column_names or stats.column("max.n").null_count == stats.num_rows
    _refused(state, _batch({"n": pa.array([30000], pa.int16())}))


def test_widening_a_column_keeps_every_total_exact(tmp_path):
    """The documented way forward: cast the sum wider in the transform; the
    state column is widened in one commit before the batch merges."""
    keys = tuple(f"k{i}" for i in range(50))
    state = _started(tmp_path, _batch({"n": pa.array([30000 - i for i in range(50)], pa.int16())}, keys))
    fenced_at = state.open().version()
    _refused(state, _batch({"n": pa.array([30000], pa.int16())}, ("k0",)))
    # The fix: the transform returns INT now; batch 2 is replayed.
    wide = _batch({"n": pa.array([30000, 1], pa.int32())}, ("k0", "new"))
    version, _ = commit_updates(state, state.open(), wide, Position(0, 2))
    table = state.open()
    assert pa.schema(table.schema().to_arrow()).field("n").type == pa.int32()
    values = _values(state)
    assert values == {**{k: 30000 - i for i, k in enumerate(keys)}, "k0": 60000, "new": 1}
    # The widening is ours: it moved no fence and is not a change made outside.
    assert transaction_position(table, STATE_FENCE) == Position(0, 2)
    assert state.outside_changes(table, fenced_at) == []
    found = state.find_commit(table, Position(0, 2))
    assert found is not None and found.version == version
    assert [h["operation"] for h in table.history(2)] == ["MERGE", "WRITE"]
    # Later batches in the narrow type are cast up to the wide column.
    commit_updates(state, state.open(), _batch({"n": pa.array([7], pa.int16())}, ("k0",)), Position(0, 3))
    assert _values(state)["k0"] == 60007


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        (pa.int8(), pa.int64(), 100),
        (pa.float32(), pa.float64(), 1.5),
        (pa.decimal128(8, 2), pa.decimal128(12, 2), Decimal("999999.99")),
        (pa.decimal128(8, 2), pa.decimal128(12, 4), Decimal("999999.99")),
        (pa.int64(), pa.decimal128(38, 0), 2**63 - 1),
    ],
    ids=str,
)
def test_each_widening_keeps_the_values(tmp_path, old, new, value):
    state = _started(tmp_path, _batch({"n": pa.array([value], old)}))
    commit_updates(state, state.open(), _batch({"n": pa.array([value], new)}, ("b",)), Position(0, 2))
    assert pa.schema(state.open().schema().to_arrow()).field("n").type == new
    assert _values(state) == {"a": value, "b": value}


def test_a_narrowing_type_still_fails_as_a_transform_error(tmp_path):
    state = _started(tmp_path, _batch({"n": pa.array([1], pa.int32())}))
    with pytest.raises(TransformError, match="do not fit the state table's types"):
        commit_updates(state, state.open(), _batch({"n": pa.array([1.5], pa.float64())}), Position(0, 2))
    assert pa.schema(state.open().schema().to_arrow()).field("n").type == pa.int32()


def test_two_runs_widening_at_once_lose_nothing(tmp_path):
    state = _started(tmp_path, _batch({"n": pa.array([30000], pa.int16())}))
    wide = _batch({"n": pa.array([30000], pa.int32())})
    first, second = state.open(), state.open()
    state.align(first, wide)
    with pytest.raises(ConcurrentRunError, match="run again"):
        state.align(second, wide)
    assert _values(state) == {"a": 30000}
    commit_updates(state, state.open(), wide, Position(0, 2))
    assert _values(state) == {"a": 60000}


def test_a_widening_from_a_snapshot_older_than_an_optimize_is_refused(tmp_path):
    """delta-rs lets an overwrite from a stale snapshot land over an OPTIMIZE,
    keeping both copies of every row: the widening must land on the very
    version it read, or not at all."""
    state = _started(tmp_path, _batch({"n": pa.array([30000], pa.int16())}))
    write_deltalake(state.path, pa.table({"k": ["b"], "n": pa.array([1], pa.int16()), "_batch_id": [1]}), mode="append")
    stale = state.open()
    DeltaTable(state.path).optimize.compact()
    with pytest.raises(ConcurrentRunError):
        state.align(stale, _batch({"n": pa.array([1], pa.int32())}))
    assert sorted(_values(state).items()) == [("a", 30000), ("b", 1)]
    assert read_all(state.open()).num_rows == 2


def test_a_batch_merged_from_a_snapshot_before_a_widening_fails(tmp_path):
    state = _started(tmp_path, _batch({"n": pa.array([30000], pa.int16())}))
    stale = state.open()
    narrow = state.align(stale, _batch({"n": pa.array([1], pa.int16())}))
    state.align(state.open(), _batch({"n": pa.array([1], pa.int32())}))
    with pytest.raises(Exception) as info:
        state.commit_batch(stale, narrow, batch_metadata(state.spec.name, Position(0, 2)))
    assert is_commit_conflict(info.value)
    assert _values(state) == {"a": 30000}


def test_a_new_merge_column_is_added_with_nulls_for_old_rows(tmp_path):
    _started(tmp_path, _batch({"n": pa.array([1, 2], pa.int64())}, ("a", "b")))
    state = StateTable(_spec(tmp_path, {"n": "sum", "m": "sum", "tag": "last"}))  # the spec gains merge columns
    fenced_at = state.open().version()
    batch = _batch(
        {
            "n": pa.array([10, 1], pa.int64()),
            "m": pa.array([5, 6], pa.int32()),
            "tag": pa.array(["x", "y"], pa.large_string()),
        },
        ("a", "c"),
    )
    updates = state.align(state.open(), batch)
    # Step 4 merges on a freshly opened table.
    state.commit_batch(state.open(), updates, batch_metadata(state.spec.name, Position(0, 2)))
    rows = {r["k"]: r for r in read_all(state.open()).to_pylist()}
    merged = {k: (r["n"], r["m"], r["tag"]) for k, r in rows.items()}
    assert merged == {"a": (11, 5, "x"), "b": (2, None, None), "c": (1, 6, "y")}
    schema = pa.schema(state.open().schema().to_arrow())
    assert (schema.field("m").type, schema.field("tag").type) == (pa.int32(), pa.string())
    assert state.outside_changes(state.open(), fenced_at) == []
    assert "ADD COLUMN" in [h["operation"] for h in state.open().history(2)]


def test_a_column_without_a_merge_rule_is_still_refused(tmp_path):
    state = _started(tmp_path, _batch({"n": pa.array([1], pa.int64())}))
    with pytest.raises(TransformError, match="is not in the state table"):
        commit_updates(state, state.open(), _batch({"n": pa.array([1], pa.int64()), "x": [1]}), Position(0, 2))
    assert "x" not in state.open().schema().to_arrow().names


# -- through the protocol ----------------------------------------------------------------


class _FixedCompute:
    """A `Compute` whose transform result is whatever the test sets, plus one bad record."""

    reads_at_once = 1

    def __init__(self, updates: pa.Table) -> None:
        self.updates = updates

    def start(self) -> None:
        """No engine to start."""

    def check(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False) -> None:
        """Every result is set by the test."""

    def process(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False) -> ComputeResult:
        record = {"file": [batch.manifest.uris[0]], "line": [2], "raw": ["{"], "reason": ["malformed"]}
        bad = pa.table(record, schema=QUARANTINE_COLUMNS)
        return ComputeResult(validate_updates(spec, self.updates), bad, 2)

    def close(self) -> None:
        """Nothing to release."""


def test_an_overflowing_batch_exits_2_writes_nothing_and_replays_after_widening(tmp_path):
    spec = _spec(tmp_path, {"n": "sum"})
    landing = Path(spec.source_path)
    compute = _FixedCompute(_batch({"n": pa.array([30000], pa.int16())}))

    def run(name: str):
        (landing / name).write_text('{"user_id": "u"}\n{\n')
        return run_batch(spec, RunOptions(run_id="test"), compute_factory=lambda: compute)

    assert run("1.json").status == "committed"
    state = StateTable(spec)
    before = state.open().version()
    quarantine = spec.quarantine_path
    quarantined = read_all(open_table(quarantine)).num_rows
    with pytest.raises(MergeOverflowError) as info:
        run("2.json")
    assert exit_code(info.value) == EXIT_TERMINAL
    assert state.open().version() == before  # nothing committed ...
    assert read_all(open_table(quarantine)).num_rows == quarantined  # ... nor quarantined
    compute.updates = _batch({"n": pa.array([30000], pa.int32())})  # the fix: a wider sum
    replay = run_batch(spec, RunOptions(run_id="test"), compute_factory=lambda: compute)
    assert (replay.status, replay.batch_id) == ("committed", 2)
    assert _values(state) == {"a": 60000}
    assert read_all(open_table(quarantine)).num_rows == quarantined + 1
    assert run("3.json").status == "committed"  # the next run finds no change made outside
    assert _values(state) == {"a": 90000}
    # A rewind to before the widening brings the narrow column back; the replay widens it again.
    rewind(spec, 1, run_id="test-rewind")
    assert pa.schema(state.open().schema().to_arrow()).field("n").type == pa.int16()
    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=lambda: compute).status == "committed"
    assert _values(state) == {"a": 60000}  # files 2 and 3 in one batch, which adds 30000 here
