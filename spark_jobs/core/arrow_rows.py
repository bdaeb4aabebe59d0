"""A batch's rows merged into a state's rows, and a data file's Delta
statistics, in pyarrow alone: the MERGE's rules (`state.merge_expression`)
as Spark's SQL computes them.

Shared by the executors' tasks (`spark_jobs.engine.spark_files`, which
pickle this module by value: an executor needs pyarrow, not this package,
so each function imports what it needs itself) and the job's own
merge-on-read (`spark_jobs.core.merge_on_read`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["MAX_STAT_CHARS", "FileStats", "apply_rule", "in_schema", "match_key", "matches", "merged_rows"]

#: Longer strings get no min/max statistics (readers then read the file: always right).
MAX_STAT_CHARS = 256


def merged_rows(old: pa.Table, updates: pa.Table, keys: list[str], rules: dict[str, str], batch_column: str) -> tuple[pa.Table, pa.Array]:
    """`old` (a state file's rows) with `updates` merged in by the MERGE's
    rules, in `old`'s schema and order, and the indexes of the updates'
    rows it took. A key of the updates is in `old` once at most."""
    import pyarrow as pa
    import pyarrow.compute as pc

    taken = matches(old, updates, keys)
    hit = pc.is_valid(taken)
    columns = []
    for field in old.schema:
        t = old.column(field.name)
        if field.name in keys or field.name not in updates.column_names:
            columns.append(t)
            continue
        s = updates.column(field.name).take(taken)
        value = s if field.name == batch_column else apply_rule(rules[field.name], t, s, field.type)
        columns.append(pc.if_else(hit, value, t).cast(field.type))
    return pa.Table.from_arrays(columns, schema=old.schema), pc.drop_null(taken)


def matches(old: pa.Table, updates: pa.Table, keys: list[str]) -> pa.Array:
    """For each row of `old`, the index of the update with its key (null:
    none). One key column: a hash lookup (`index_in`), a tenth of the cost
    of a join and the sort back into the file's order (measured on a file of
    8.7M keys); more: a join of the keys and row numbers (pyarrow's join
    takes no nested column, so the values are taken by row number after)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if len(keys) == 1:
        return pc.index_in(match_key(old, keys[0]), value_set=match_key(updates, keys[0])).cast(pa.int64())
    left = pa.table([*(match_key(old, k) for k in keys), pa.array(range(old.num_rows), pa.int64())], names=[*keys, "__microbatch_old"])
    right = pa.table([*(match_key(updates, k) for k in keys), pa.array(range(updates.num_rows), pa.int64())], names=[*keys, "__microbatch_new"])
    pairs = left.join(right, keys=keys, join_type="left outer", use_threads=False)
    return pairs.take(pc.sort_indices(pairs.column("__microbatch_old"))).column("__microbatch_new").combine_chunks()


def in_schema(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """`rows` in the state's schema: a column they lack is null (a file
    written before it was added; a batch's new keys, as a MERGE inserts them)."""
    import pyarrow as pa

    return pa.table(
        [rows.column(f.name).cast(f.type) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type) for f in schema],
        schema=schema,
    )


def match_key(table: pa.Table, name: str) -> pa.Array:
    """A key column as the MERGE's equality compares it: a float -0.0 is
    the key 0.0 (Spark's and DataFusion's `=`; a lookup by value would
    tell them apart). Only for matching: the file keeps its own."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    if pa.types.is_floating(column.type):
        column = pc.if_else(pc.equal(column, pa.scalar(0, column.type)), pa.scalar(0, column.type), column)
    return column


def apply_rule(rule: str, t: pa.ChunkedArray, s: pa.ChunkedArray, kind: pa.DataType) -> pa.ChunkedArray:
    """A merge rule (`state.merge_expression`) in pyarrow, as Spark's SQL
    computes it: a null on either side gives the other, a sum that does not
    fit the column fails (the overflow check let none through), and for
    `min`/`max` a NaN is larger than any number."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if rule == "sum":
        if pa.types.is_decimal128(kind):
            # A DECIMAL's sum comes a digit wider (past DECIMAL(38) only in 256 bits); cast back, which fails as the column would.
            wide = pa.decimal256(kind.precision, kind.scale)
            return pc.coalesce(pc.add_checked(t.cast(wide), s.cast(wide)).cast(kind), t, s)
        return pc.coalesce(pc.add_checked(t, s).cast(kind), t, s)
    if rule in ("min", "max"):
        smaller = pc.less(s, t) if rule == "min" else pc.greater(s, t)
        if pa.types.is_floating(kind):
            nan_t, nan_s = pc.fill_null(pc.is_nan(t), False), pc.fill_null(pc.is_nan(s), False)
            smaller = pc.or_(smaller, pc.and_(nan_t, pc.invert(nan_s))) if rule == "min" else pc.or_(smaller, pc.and_(nan_s, pc.invert(nan_t)))
        chosen = pc.if_else(pc.fill_null(smaller, False), s, t)
        return pc.if_else(pc.is_null(t), s, pc.if_else(pc.is_null(s), t, chosen))
    if rule == "first":
        return pc.coalesce(t, s)
    if rule == "last":
        return s
    raise ValueError(f"unknown merge rule {rule!r}")


class FileStats:
    """A file's Delta statistics, from the rows written into it: exact
    bounds (what the overflow check and the readers' pruning rely on)."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.records = 0
        self.low: dict[str, Any] = {}
        self.high: dict[str, Any] = {}
        self.nulls: dict[str, int] = {}
        self.unbounded: set[str] = set()
        #: Floating-point columns holding an infinity or a NaN (the overflow check refuses them).
        self.nonfinite: set[str] = set()

    def add(self, batch: pa.RecordBatch) -> None:
        import pyarrow.compute as pc

        self.records += batch.num_rows
        for field in self.schema:
            column = batch.column(batch.schema.get_field_index(field.name))
            if not _flat(field.type):
                continue
            self.nulls[field.name] = self.nulls.get(field.name, 0) + column.null_count
            if not _bounded(field.type) or field.name in self.unbounded:
                continue
            if _floating(field.type) and not pc.all(pc.fill_null(pc.is_finite(column), True)).as_py():
                self.unbounded.add(field.name)  # NaN sorts nowhere, and JSON has no infinity: no bounds
                self.nonfinite.add(field.name)
                continue
            found = pc.min_max(column)
            try:
                low, high = found["min"].as_py(), found["max"].as_py()
            except (OverflowError, ValueError):
                # A date or time outside Python's years 1 to 9999, which
                # Spark holds: no bounds (a reader then reads the file).
                self.unbounded.add(field.name)
                continue
            if low is None:
                continue
            self.low[field.name] = low if field.name not in self.low else min(self.low[field.name], low)
            self.high[field.name] = high if field.name not in self.high else max(self.high[field.name], high)

    def bounds(self) -> str:
        """Exact bounds of the numeric columns (decimals as text), for the
        overflow check: Delta's statistics carry decimals through a float."""
        import json

        import pyarrow as pa

        exact = {
            f.name: [str(self.low[f.name]), str(self.high[f.name])]
            for f in self.schema
            if f.name in self.low and f.name not in self.unbounded and (pa.types.is_integer(f.type) or pa.types.is_decimal(f.type) or pa.types.is_floating(f.type))
        }
        return json.dumps(exact)

    def json(self) -> str:
        import json

        low, high = {}, {}
        for field in self.schema:
            name = field.name
            if name in self.unbounded or name not in self.low:
                continue
            pair = (_stat_value(field.type, self.low[name], up=False), _stat_value(field.type, self.high[name], up=True))
            if None not in pair:
                low[name], high[name] = pair
        return json.dumps({"numRecords": self.records, "minValues": low, "maxValues": high, "nullCount": self.nulls})


def _flat(t: pa.DataType) -> bool:
    import pyarrow as pa

    return not pa.types.is_nested(t)


def _floating(t: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_floating(t)


def _bounded(t: pa.DataType) -> bool:
    """Types whose min/max statistics this writer gives (as delta-rs does, but
    for naive timestamps, whose text form the readers disagree on)."""
    import pyarrow as pa

    return (
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_string(t)
        or pa.types.is_large_string(t) or pa.types.is_date32(t) or pa.types.is_boolean(t)
        or (pa.types.is_timestamp(t) and t.tz is not None)
    )


def _stat_value(t: pa.DataType, value: Any, *, up: bool) -> Any:
    """A bound as Delta's statistics JSON spells it (None: give none).

    Timestamps are kept to the millisecond, as Delta's are: a lower bound
    rounded down, an upper one up, so that they still bound the values."""
    import datetime
    import decimal

    import pyarrow as pa

    if pa.types.is_timestamp(t):
        whole = value.replace(microsecond=value.microsecond // 1000 * 1000)
        if up and whole != value:
            if whole.replace(tzinfo=None) >= datetime.datetime.max - datetime.timedelta(milliseconds=1):
                return None  # the last millisecond of year 9999: no upper bound to give
            whole += datetime.timedelta(milliseconds=1)
        utc = whole.astimezone(datetime.timezone.utc)
        # The year in four digits (strftime's %Y gives year 1 as "1"), as Delta spells it.
        return f"{utc.year:04d}-" + utc.strftime("%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    if pa.types.is_date32(t):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        # As delta-rs writes them: through a float, which the overflow check allows for.
        return float(value)
    if isinstance(value, str):
        return value if len(value) <= MAX_STAT_CHARS else None
    return value
