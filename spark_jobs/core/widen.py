"""When a sum outgrows its column: refuse the merge that would overflow it,
and tell which column types hold more.

delta-rs's MERGE adds ``t.n + s.n`` in the column's own type. Integers wrap
(SMALLINT 30,000 + 30,000 commits -5,536), floats overflow to infinity, and
a decimal past its precision fails the MERGE itself with a ValueError that
every replay meets again. `check_merge` proves before the state commit that
no sum leaves its column's range, and refuses the batch with
`MergeOverflowError` otherwise. The way forward is a wider type in the
transform; `widens` says which types count as wider, and the state table
takes them on (`spark_jobs.core.state.StateTable.align`).

The check costs next to nothing when nothing can overflow. A batch's values
set thresholds: a state value above ``limit - (the batch's largest value)``
(or below the mirror threshold) is the only kind that can overflow. Delta
keeps each data file's min and max per column in the table's log, so when
no file's range reaches a threshold the batch goes through without a row of
the state being read. Otherwise (sums near the limit, files without
statistics) `exact_overflow` reads the state rows past the thresholds, a
filter Delta prunes files by, and computes the batch's keys' sums exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol
from decimal import Decimal
from fractions import Fraction

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, QueryBuilder

from spark_jobs.core.delta_io import arrow
from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec
from spark_jobs.core.sql_text import datafusion_identifier as _q
from spark_jobs.errors import MergeOverflowError

__all__ = ["check_merge", "exact_overflow", "sql_type", "value_range", "widens"]

#: Largest finite float32 and float64.
_FLOAT_MAX = {32: Fraction(3.4028234663852886e38), 64: Fraction(1.7976931348623157e308)}
_SQL_NAMES = {
    pa.int8(): "TINYINT",
    pa.int16(): "SMALLINT",
    pa.int32(): "INT",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
    pa.string(): "STRING",
    pa.large_string(): "STRING",
    pa.string_view(): "STRING",
    pa.binary(): "BINARY",
    pa.large_binary(): "BINARY",
    pa.date32(): "DATE",
    pa.null(): "VOID",
}
#: Where `exact_overflow` adds integers and decimals: 40 digits hold any
#: DECIMAL(38, s) or BIGINT value, and Arrow gives their sum one digit more.
_EXACT_PRECISION = 40
#: Float thresholds are moved this much (relatively) towards zero before
#: they reach SQL: DataFusion may round a literal to FLOAT when comparing
#: it with a FLOAT column (2**-24), and the filter must never drop a row
#: that can overflow. The exact check decides about the extra rows.
_FLOAT_SLACK = 1 - 2**-20


def value_range(column_type: pa.DataType) -> tuple[Fraction, Fraction] | None:
    """The smallest and largest value a column of this type holds; None if it is not a number."""
    if pa.types.is_signed_integer(column_type):
        top = 2 ** (column_type.bit_width - 1)
        return Fraction(-top), Fraction(top - 1)
    if pa.types.is_floating(column_type) and column_type.bit_width in _FLOAT_MAX:
        return -_FLOAT_MAX[column_type.bit_width], _FLOAT_MAX[column_type.bit_width]
    if pa.types.is_decimal(column_type):
        top = Fraction(10**column_type.precision - 1, 10**column_type.scale)
        return -top, top
    return None


def widens(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether `new` holds every value of `old` exactly, and more.

    TINYINT < SMALLINT < INT < BIGINT, FLOAT < DOUBLE, an integer type < a
    DECIMAL with as many integer digits, and a DECIMAL < one with at least
    as many integer and fraction digits. Never across integers and floats:
    a DOUBLE does not hold every BIGINT, and a DECIMAL no float.
    """
    if old == new:
        return False
    if pa.types.is_floating(old) or pa.types.is_floating(new):
        return pa.types.is_float32(old) and pa.types.is_float64(new)
    old_range, new_range = value_range(old), value_range(new)
    if old_range is None or new_range is None or (pa.types.is_decimal(old) and not pa.types.is_decimal(new)):
        return False
    return _scale(new) >= _scale(old) and new_range[0] <= old_range[0] and old_range[1] <= new_range[1]


def sql_type(column_type: pa.DataType) -> str:
    """The Spark SQL name of a column type, as users write it in the transform."""
    t = column_type
    if pa.types.is_decimal(t):
        return f"DECIMAL({t.precision},{t.scale})"
    if pa.types.is_timestamp(t):
        return "TIMESTAMP" if t.tz is not None else "TIMESTAMP_NTZ"
    if pa.types.is_time(t):
        return "TIME"
    if pa.types.is_duration(t):
        return "INTERVAL DAY TO SECOND"  # what Spark's day-time intervals become in Arrow
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"ARRAY<{sql_type(t.value_type)}>"
    if pa.types.is_map(t):
        return f"MAP<{sql_type(t.key_type)}, {sql_type(t.item_type)}>"
    if pa.types.is_struct(t):
        return f"STRUCT<{', '.join(f'{t.field(i).name}: {sql_type(t.field(i).type)}' for i in range(t.num_fields))}>"
    return _SQL_NAMES.get(t, str(t).upper())


#: A column's smallest and largest value, None where unknown.
Range = tuple[Fraction, Fraction] | None

#: The int64 range, to which delta-rs clamps the statistics of decimals beyond it.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


#: How far delta-rs's statistics of a decimal may be from its values, relative
#: to their size: they are written through a 64-bit float (a DECIMAL(18,2)
#: 9999999999999998.99 is stored as 9999999999999998.00).
_DECIMAL_STATS_SLACK = Fraction(1, 10**14)


def _approximate_statistics(column_type: pa.DataType) -> bool:
    """Whether a column's file statistics only approximate its values: a
    decimal's go through a float (rounded), and beyond 64 bits are clamped."""
    return pa.types.is_decimal(column_type)


@dataclass(frozen=True)
class SumCheck:
    """One sum column of a batch: its type in the merge, and which state values it would overflow.

    A state value above `above` overflows with the batch's largest value, one
    below `below` with its smallest; None where no state value can (a batch
    with no positive value cannot push any sum up).
    """

    column: str
    type: pa.DataType
    above: Fraction | None
    below: Fraction | None

    @classmethod
    def of(cls, updates: BatchValues, column: str) -> SumCheck | None:
        """The check for `column`, or None when the batch cannot overflow it (not a number, all null)."""
        column_type = updates.type(column)
        limits = value_range(column_type)
        extremes = updates.range(column) if limits is not None else None
        if limits is None or extremes is None:
            return None
        low, high = extremes
        return cls(
            column,
            column_type,
            above=limits[1] - high if high > 0 else None,
            below=limits[0] - low if low < 0 else None,
        )

    def within(self, state_range: tuple[Fraction, Fraction] | None) -> bool:
        """Whether every state value in `state_range` (None: unknown) is safe from this batch."""
        if state_range is None:
            return False
        low, high = state_range
        return (self.above is None or high <= self.above) and (self.below is None or low >= self.below)

    def candidates(self) -> list[str]:
        """SQL conditions that hold for every state value this batch may overflow.

        A decimal's file statistics only approximate it (`state_ranges`): a
        plain comparison would let DataFusion skip the very files that hold
        the values, so its conditions are written in a form the pruning
        cannot read (`(...) IS TRUE`; a test pins that it still finds them).
        This query runs only when the statistics could not prove the batch
        safe.
        """
        column = _q(self.column)
        found = []
        if self.above is not None:
            found.append(f"{column} > {self._literal(self.above)}")
        if self.below is not None:
            found.append(f"{column} < {self._literal(self.below)}")
        if _approximate_statistics(self.type):
            found = [f"({condition}) IS TRUE" for condition in found]
        return found

    def overflows(self, state: pa.ChunkedArray, batch: pa.ChunkedArray) -> tuple[pa.ChunkedArray, pa.ChunkedArray]:
        """Per row: whether state + batch leaves the column's range, and the true sum."""
        if pa.types.is_floating(self.type):
            # As the MERGE adds, in the column's type: only an infinity made of
            # finite values is an overflow (an inf already in the state is not this batch's).
            total = pc.add(state.cast(self.type), batch.cast(self.type))
            mask = pc.and_(pc.is_inf(total), pc.and_(pc.is_finite(state), pc.is_finite(batch)))
        else:
            exact = pa.decimal256(_EXACT_PRECISION, _scale(self.type))
            total = pc.add(state.cast(exact), batch.cast(exact))
            low, high = (pa.scalar(_decimal(v, exact.scale), exact) for v in value_range(self.type))
            mask = pc.or_(pc.less(total, low), pc.greater(total, high))
        return pc.fill_null(mask, False), total

    def _literal(self, value: Fraction) -> str:
        if pa.types.is_integer(self.type):
            return str(int(value))
        if pa.types.is_decimal(self.type):
            return f"CAST('{_decimal(value, self.type.scale):f}' AS DECIMAL(38, {self.type.scale}))"
        return repr(float(value) * _FLOAT_SLACK)


@dataclass(frozen=True)
class Overflow:
    """A key whose merged value would not fit its column."""

    column: str
    type: pa.DataType
    key: dict[str, Any]
    old: Any
    new: Any
    total: Any

    def error(self, spec: PipelineSpec) -> MergeOverflowError:
        low, high = (_text(v, self.type) for v in value_range(self.type))
        return MergeOverflowError(
            f"pipeline {spec.name}: merging this batch would overflow the state column {self.column!r} "
            f"({sql_type(self.type)}, {low} to {high}) for key {self.key}: the state holds {self.old} and "
            f"the batch adds {self.new}, a sum of {self.total}. Nothing was committed. "
            + _remedy(self.type, self.column),
            pipeline=spec.name,
            path=spec.state_path,
        )


class BatchValues(Protocol):
    """A batch's values as the overflow check reads them: rows in memory
    (`ArrowValues`), or files the executors wrote (`staged.StagedValues`),
    whose statistics answer the first questions without reading them."""

    @property
    def names(self) -> list[str]: ...

    def type(self, column: str) -> pa.DataType: ...

    def range(self, column: str) -> tuple[Fraction, Fraction] | None:
        """The column's smallest and largest value (None: all null)."""

    def non_finite(self, column: str, keys: list[str]) -> tuple[dict[str, Any], Any] | None:
        """A key whose value of the floating-point `column` is an infinity or a NaN, and the value."""

    def rows(self, columns: list[str], keys: list[str], wanted: pa.Table) -> pa.Table:
        """The batch's `columns` of the rows whose keys are among `wanted`'s (in `keys`' order)."""


class ArrowValues:
    """A batch's values in memory."""

    def __init__(self, updates: pa.Table) -> None:
        self.updates = updates

    @property
    def names(self) -> list[str]:
        return self.updates.column_names

    def type(self, column: str) -> pa.DataType:
        return self.updates.schema.field(column).type

    def range(self, column: str) -> tuple[Fraction, Fraction] | None:
        extremes = pc.min_max(self.updates.column(column))
        if extremes["max"].as_py() is None:
            return None
        return Fraction(extremes["min"].as_py()), Fraction(extremes["max"].as_py())

    def non_finite(self, column: str, keys: list[str]) -> tuple[dict[str, Any], Any] | None:
        values = self.updates.column(column)
        bad = pc.fill_null(pc.invert(pc.is_finite(values)), False)
        if not pc.any(bad).as_py():
            return None
        row = pc.index(bad, True).as_py()
        return {k: self.updates.column(k)[row].as_py() for k in keys}, values[row].as_py()

    def rows(self, columns: list[str], keys: list[str], wanted: pa.Table) -> pa.Table:
        return self.updates.select(columns)


def check_merge(
    spec: PipelineSpec, table: DeltaTable, updates: pa.Table | BatchValues, folded_sql: str | None = None, fold_files: frozenset[str] = frozenset()
) -> None:
    """Refuse, with `MergeOverflowError`, a batch whose merge into `table`'s
    snapshot would commit a wrapped integer, a decimal past its precision, or
    an infinity or NaN.

    `updates` are in the types the merge will use (`StateTable.align`'s);
    state columns may still be narrower. Only `sum` can overflow: min, max,
    first and last pick one of two values that both fit.

    An appended state (`folded_sql`: the query folding its rows over
    ``state``) holds partial rows: a key's value is the sum of at most one
    row of its last fold's files (`fold_files`: one row per key among them)
    and of up to `rows_per_key` rows of the other files; the files'
    statistics bound both. Only when that cannot prove the batch safe are the
    keys' values folded here, which reads the whole state.
    """
    if isinstance(updates, pa.Table):
        updates = ArrowValues(updates)
    _refuse_non_finite(spec, updates)
    in_state = set(pa.schema(table.schema().to_arrow()).names)
    checks = []
    for column, rule in spec.state.merge.items():
        # A column new to the state holds only nulls there: nothing to add to.
        if rule == "sum" and column in in_state and column in updates.names:
            check = SumCheck.of(updates, column)
            if check is not None:
                checks.append(check)
    if not checks:
        return
    columns = [c.column for c in checks]
    actions = arrow(table.get_add_actions(flatten=True))
    if folded_sql is None:
        ranges = column_ranges(actions, columns)
    else:
        in_fold = pc.is_in(actions.column("path"), pa.array(sorted(fold_files), pa.string()))
        base, partial = actions.filter(in_fold), actions.filter(pc.invert(in_fold))
        ranges = {c: _sum_range(b, p, rows_per_key(partial)) for (c, b), p in
                  zip(column_ranges(base, columns).items(), column_ranges(partial, columns).values())}
    unproven = [c for c in checks if not c.within(ranges[c.column])]
    if unproven:
        found = exact_overflow(table, updates, list(spec.state.keys), unproven, rows=f"({folded_sql}) AS folded" if folded_sql else "state")
        if found is not None:
            raise found.error(spec)


def _sum_range(base: Range, partial: Range, most: int) -> Range:
    """Where a sum of one row in `base` and up to `most` rows in `partial` lies (None: unknown)."""
    if base is None or partial is None:
        return None
    return (min(base[0], 0) + most * min(partial[0], 0), max(base[1], 0) + most * max(partial[1], 0))


def state_ranges(table: DeltaTable, columns: list[str]) -> dict[str, Range]:
    """Each column's smallest and largest value in the snapshot, from the
    data files' statistics in the log (no data read); see `column_ranges`."""
    return column_ranges(arrow(table.get_add_actions(flatten=True)), columns)


def column_ranges(actions: pa.Table, columns: list[str]) -> dict[str, Range]:
    """Each column's smallest and largest value in the files `actions` adds
    (a snapshot's add actions, flattened); None where a file has no
    statistics (a column added after it was written, statistics turned off).

    A column holding no value gets (0, 0): it adds nothing to any sum, and
    every `SumCheck` threshold lets zero through.
    """
    ranges: dict[str, tuple[Fraction, Fraction] | None] = {}
    for column in columns:
        names = [f"min.{column}", f"max.{column}", f"null_count.{column}", "num_records"]
        if actions.num_rows == 0:
            ranges[column] = (Fraction(0), Fraction(0))
            continue
        if not set(names) <= set(actions.column_names):
            ranges[column] = None
            continue
        lows, highs, nulls, records = (actions.column(name) for name in names)
        # A file of nulls only has no min or max, and nothing to add to.
        valued = pc.invert(pc.fill_null(pc.equal(nulls, records), False))
        lows, highs = lows.filter(valued), highs.filter(valued)
        if lows.null_count or highs.null_count:
            ranges[column] = None
        elif len(lows) == 0:
            ranges[column] = (Fraction(0), Fraction(0))
        else:
            low, high = pc.min(lows).as_py(), pc.max(highs).as_py()
            # A float state may hold an inf or NaN from before overflows were refused.
            finite = not isinstance(low, float) or (math.isfinite(low) and math.isfinite(high))
            if finite and _approximate_statistics(lows.type):
                # delta-rs writes a decimal's statistics through a float, and
                # clamped to the int64 range: a bound there may stand for any
                # value beyond it; elsewhere, widen by the float's rounding.
                if low <= _INT64_MIN or high >= _INT64_MAX:
                    ranges[column] = None
                    continue
                unit = Fraction(1, 10**lows.type.scale)
                low = Fraction(low) - abs(Fraction(low)) * _DECIMAL_STATS_SLACK - unit
                high = Fraction(high) + abs(Fraction(high)) * _DECIMAL_STATS_SLACK + unit
            ranges[column] = (Fraction(low), Fraction(high)) if finite else None
    return ranges


def rows_per_key(actions: pa.Table) -> int:
    """At most how many rows the files `actions` adds hold for one key of an
    appended state: no more than they hold, and no more than the batches
    their rows come from (all the rows of one key carry distinct batch ids:
    a batch appends a key once, and a fold leaves its one row the id of the
    key's latest batch, before any appended since)."""
    if actions.num_rows == 0:
        return 0
    rows = pc.sum(actions.column("num_records")).as_py() or 0
    names = (f"min.{BATCH_COLUMN}", f"max.{BATCH_COLUMN}")
    if not set(names) <= set(actions.column_names):
        return rows
    lows, highs = (actions.column(n) for n in names)
    if lows.null_count or highs.null_count:
        return rows
    return min(rows, pc.max(highs).as_py() - pc.min(lows).as_py() + 1)


def exact_overflow(
    table: DeltaTable, updates: pa.Table | BatchValues, keys: list[str], checks: list[SumCheck], rows: str = "state"
) -> Overflow | None:
    """The first of the batch's keys whose merged sum leaves its column's
    range, computed exactly; None if there is none. `rows`: the state's rows
    as SQL over ``state`` (an appended state's, folded).

    Reads only the state rows past a check's threshold (DataFusion prunes
    files by their statistics) and joins them with the batch here: delta-rs's
    `QueryBuilder` queries Delta tables only, not the batch in memory.
    """
    conditions = [condition for check in checks for condition in check.candidates()]
    if not conditions:
        return None
    columns = [*keys, *(c.column for c in checks)]
    sql = f"SELECT {', '.join(_q(c) for c in columns)} FROM {rows} WHERE {' OR '.join(conditions)}"
    candidates = arrow(QueryBuilder().register("state", table).execute(sql).read_all())
    if candidates.num_rows == 0:
        return None
    # Positional names, so that no column name can clash in the join.
    key_names = [f"k{i}" for i in range(len(keys))]
    values = ArrowValues(updates) if isinstance(updates, pa.Table) else updates
    batch = values.rows(columns, keys, candidates.select(keys)).rename_columns([*key_names, *(f"b{i}" for i in range(len(checks)))])
    state = candidates.rename_columns([*key_names, *(f"s{i}" for i in range(len(checks)))])
    # DataFusion may hand keys back in another layout (a string view): the join needs one type.
    state = state.cast(pa.schema([*list(batch.schema)[: len(keys)], *list(state.schema)[len(keys) :]]))
    # Acero builds its hash table on the right side: the batch, not the (maybe many) candidates.
    joined = state.join(batch, keys=key_names, join_type="inner")
    for i, check in enumerate(checks):
        mask, total = check.overflows(joined.column(f"s{i}"), joined.column(f"b{i}"))
        if pc.any(mask).as_py():
            row = pc.index(mask, True).as_py()
            return Overflow(
                column=check.column,
                type=check.type,
                key={k: joined.column(n)[row].as_py() for k, n in zip(keys, key_names)},
                old=joined.column(f"s{i}")[row].as_py(),
                new=joined.column(f"b{i}")[row].as_py(),
                total=total[row].as_py(),
            )
    return None


def _refuse_non_finite(spec: PipelineSpec, updates: BatchValues) -> None:
    """Refuse an infinity or NaN in a batch's float merge column.

    The source holds only finite numbers (the quarantine refuses others), so
    such a value was made by the transform overflowing (a FLOAT sum past
    3.4e38, say); merged, it would stay in the state for good.
    """
    for column in spec.value_columns:
        if column not in updates.names or not pa.types.is_floating(updates.type(column)):
            continue
        found = updates.non_finite(column, list(spec.state.keys))
        if found is not None:
            key, value = found
            column_type = updates.type(column)
            raise MergeOverflowError(
                f"pipeline {spec.name}: the transform returned {value} in column {column!r} for key "
                f"{key}. The source holds only finite numbers (the quarantine refuses others), so a "
                f"{sql_type(column_type)} computation in the transform overflowed. Nothing was committed. "
                + _remedy(column_type, column),
                pipeline=spec.name,
                path=spec.state_path,
            )


def _remedy(column_type: pa.DataType, column: str) -> str:
    """What a user does about a column whose values outgrow `column_type`."""
    wider = _next_wider(column_type)
    if wider is None:
        return (
            f"No type holds more than {sql_type(column_type)} without losing digits: store the values on "
            "another scale in the transform (thousands, or fewer fraction digits), under a new state path "
            "and checkpoint (the pipeline then reprocesses its source)."
        )
    example = f"sum(CAST(x AS {wider}))" if wider.startswith("DECIMAL") else f"CAST(sum(x) AS {wider})"
    return (
        f"Return {column!r} from the transform as {wider} (e.g. {example}; cast before summing where the "
        "sum itself could overflow in Spark) and run again: the run widens the state column, keeping every "
        'value, and replays this batch (docs/spec.md, "When a sum outgrows its column").'
    )


def _next_wider(column_type: pa.DataType) -> str | None:
    """The Spark SQL type to suggest for a column outgrowing `column_type`, None if there is none."""
    if pa.types.is_decimal(column_type):
        return f"DECIMAL(38,{column_type.scale})" if column_type.precision < 38 else None
    if pa.types.is_floating(column_type):
        return "DOUBLE" if column_type.bit_width < 64 else None
    return "BIGINT" if column_type.bit_width < 64 else "DECIMAL(38,0)"


def _scale(column_type: pa.DataType) -> int:
    return column_type.scale if pa.types.is_decimal(column_type) else 0


def _decimal(value: Fraction, scale: int) -> Decimal:
    """`value`, a multiple of 10**-scale, as an exact Decimal (Decimal
    division would round to the context's 28 digits)."""
    units = int(value * 10**scale)
    return Decimal((0 if units >= 0 else 1, tuple(int(d) for d in str(abs(units))), -scale))


def _text(value: Fraction, column_type: pa.DataType) -> str:
    """A range limit as users read it."""
    if pa.types.is_floating(column_type):
        return repr(float(value))
    return f"{_decimal(value, _scale(column_type)):f}"
