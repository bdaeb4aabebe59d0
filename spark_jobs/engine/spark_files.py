"""A Delta table's data files, written and read on Spark's executors.

Each task of a `write_files` job streams its partition's rows into one
Parquet file in the table's folder (a local folder, or an S3 prefix through
boto3), works out the file's Delta statistics from the rows it wrote, and
returns one small row: the file's name, size, record count and statistics.
The job's process collects those rows (one per file, never the data) and
commits them to the table itself, with delta-rs, in one commit that carries
the fence and the commit metadata (`spark_jobs.core.staged`): delta-spark's
writers work the same way (executors write the files, the driver commits
the log), without delta-spark in the job's session.

A task that fails or is killed may leave a file no commit names; no reader
reads it (a snapshot reads the files its log names), and `maintain`
removes it after a day (`spark_jobs.core.untracked`). A task retried by
Spark writes a new file under a new name; only the attempt that succeeded
is returned, so only its file is committed.

`rewrite_files` rewrites some of a merged state's files with a small batch
merged in, each file by one task with pyarrow (no row crosses into the
JVM); `write_table` writes rows already in the job's process the same way.

`read_files` is the other direction: a snapshot's files (a fold's input, the
files a merge rewrites, a batch's written files checked for duplicate keys)
read by the executors with pyarrow, local or on S3, into a DataFrame; the
job's sessions read no Delta table through delta-spark or Hadoop's S3A (for
their start-up cost, docs/architecture.md), and the tables this project
writes have no deletion vectors or column mapping, so a snapshot is exactly
its files. A column a file lacks (added to the table after it) reads as null.

The functions below run on executors, which need pyarrow (and boto3 for S3)
but not this package: the module is pickled by value, as
`spark_jobs.engine.s3_read` is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from spark_jobs.core.staged import CAST_FAILED, Staged, StagedFile

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["MAX_READ_TASKS", "read_files", "rewrite_files", "write_files", "write_table", "writing", "written"]

#: What each task returns: one row per file it wrote.
WRITTEN = "path STRING, size BIGINT, records BIGINT, stats STRING, nonfinite STRING, bounds STRING"
#: Longer strings get no min/max statistics (readers then read the file: always right).
MAX_STAT_CHARS = 256
#: At most this many read tasks (one file each below it).
MAX_READ_TASKS = 64


def write_files(
    frame: DataFrame, root: str, schema: pa.Schema, client: dict[str, Any], rename: tuple[str, dict[str, str]] | None = None
) -> tuple[StagedFile, ...]:
    """Write `frame`'s rows, cast to `schema`, as Parquet files in the
    folder `root` (a local path or an ``s3://`` prefix), one file per
    partition with rows; returns what was written (nothing for no rows).

    `client` is the S3 client's settings (`storage.s3.client_settings`),
    unused for a local folder. `rename`: a column of local file URIs, and
    the planned URI of each file by its decoded path (Spark spells a local
    file its own way). The job is one Spark action; what comes back to this
    process is one short row a file."""
    return written(writing(frame, root, schema, client, rename).toArrow())


def writing(
    frame: DataFrame, root: str, schema: pa.Schema, client: dict[str, Any], rename: tuple[str, dict[str, str]] | None = None
) -> DataFrame:
    """The job `write_files` runs, not yet run: for a caller that reads the
    observed metrics of the plan it runs (`written` reads its result)."""
    _pickle_by_value()
    return frame.mapInArrow(_writer(root, schema, client, rename), WRITTEN)


def written(result: pa.Table) -> tuple[StagedFile, ...]:
    """The files a `writing` job wrote, from its result."""
    columns = [result.column(c).to_pylist() for c in ("path", "size", "records", "stats", "nonfinite", "bounds")]
    return tuple(
        StagedFile(path, size, records, stats, tuple(json.loads(nonfinite)), bounds)
        for path, size, records, stats, nonfinite, bounds in zip(*columns)
    )


def read_files(spark: SparkSession, root: str, paths: list[str], schema: pa.Schema, client: dict[str, Any]) -> DataFrame:
    """The rows of the data files `paths` (relative to the table's folder
    `root`) as a DataFrame of `schema`, read by the executors."""
    from pyspark.sql.pandas.types import from_arrow_schema

    _pickle_by_value()
    spark_schema = from_arrow_schema(schema)
    if not paths:
        return spark.createDataFrame([], spark_schema)
    frame = spark.createDataFrame([(p,) for p in paths], "path STRING")
    frame = frame.repartition(max(1, min(len(paths), MAX_READ_TASKS)))
    return frame.mapInArrow(_reader(root, schema, client), spark_schema)


def rewrite_files(
    spark: SparkSession, root: str, schema: pa.Schema, client: dict[str, Any], paths: list[str],
    updates: Staged, keys: list[str], rules: dict[str, str], batch_column: str,
) -> tuple[StagedFile, ...]:
    """A merged state's files `paths` (in `root`) rewritten with a small
    batch merged in: `updates` is the batch's files (one row a key, in the
    state's types; a state column they lack keeps its values, or is null
    for a new key; in the same store, `client` reaching both), `rules` each
    value column's merge rule (`state.merge_expression`'s), `batch_column`
    the column that takes the batch's id where a key is touched.

    Each task reads the batch's files and some of the state's, one file at
    a time, joins it with the batch on `keys` and writes it again, all with
    pyarrow: no row crosses into the JVM or this process. A batch's key the
    state's files do not hold is then written, by one more task, into a
    file of its own (a key is in one file of a merged state at most). What
    comes back here is one row a file written, and the indexes of the
    batch's rows each rewritten file took."""
    _pickle_by_value()
    folder, batch_paths = updates.root, [f.path for f in updates.files]
    frame = spark.createDataFrame([(p,) for p in paths], "path STRING").repartition(max(1, min(len(paths), MAX_READ_TASKS)))
    result = frame.mapInArrow(
        _rewriter(root, schema, client, (folder, batch_paths, updates.schema), keys, rules, batch_column), f"{WRITTEN}, matched ARRAY<BIGINT>"
    ).toArrow()
    files = written(result)
    taken = {i for rows in result.column("matched").to_pylist() for i in rows}
    if len(taken) == updates.rows:  # returning keys only: nothing to insert
        return files
    inserted = spark.createDataFrame([(0,)], "task INT").coalesce(1).mapInArrow(
        _inserter(root, schema, client, folder, batch_paths, sorted(taken)), WRITTEN
    ).toArrow()
    return files + written(inserted)


def write_table(rows: pa.Table, root: str, schema: pa.Schema, client: dict[str, Any]) -> tuple[StagedFile, ...]:
    """Rows already in this process written as one data file in `root`,
    cast to `schema`, by the writing tasks' own code (so with the same
    statistics): for a small batch whose merge the executors make."""
    import pyarrow as pa

    out = list(_writer(root, schema, client, None)(iter(rows.to_batches())))
    return written(pa.Table.from_batches(out)) if out else ()


def _pickle_by_value() -> None:
    import sys

    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _writer(
    root: str, schema: pa.Schema, client: dict[str, Any], rename: tuple[str, dict[str, str]] | None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import json
        import os
        import tempfile
        import uuid

        import pyarrow as pa
        import pyarrow.parquet as pq

        name = f"part-{uuid.uuid4()}-c000.snappy.parquet"
        s3 = root.startswith("s3://")
        if s3:
            handle, local = tempfile.mkstemp(suffix=".parquet")
            os.close(handle)
        else:
            os.makedirs(root, exist_ok=True)
            local = os.path.join(root, name)
        stats = _Stats(schema)
        writer = None
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                batch = _cast(_renamed(batch, rename) if rename else batch, schema)
                if writer is None:
                    writer = pq.ParquetWriter(local, schema, compression="snappy", coerce_timestamps="us", allow_truncated_timestamps=False)
                writer.write_batch(batch)
                stats.add(batch)
            if writer is None:
                return
            writer.close()
            writer = None
            size = os.path.getsize(local)
            if s3:
                _upload(client, local, f"{root.rstrip('/')}/{name}")
        finally:
            if writer is not None:
                writer.close()
            if s3 and os.path.exists(local):
                os.unlink(local)
        row = {
            "path": name, "size": size, "records": stats.records, "stats": stats.json(),
            "nonfinite": json.dumps(sorted(stats.nonfinite)), "bounds": stats.bounds(),
        }
        yield pa.RecordBatch.from_pylist(
            [row],
            schema=pa.schema([(n, pa.int64() if n in ("size", "records") else pa.string()) for n in row]),
        )

    return write


def _reader(root: str, schema: pa.Schema, client: dict[str, Any]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for path in batch.column(0).to_pylist():
                yield from _file_batches(root, path, schema, client)

    return read


def _file_batches(root: str, path: str, schema: pa.Schema, client: dict[str, Any]) -> Iterator[pa.RecordBatch]:
    """The rows of the data file `path` (relative to `root`) in `schema`: a
    column the file lacks (added to the table after it) as nulls."""
    import io
    from urllib.parse import unquote

    import pyarrow as pa
    import pyarrow.parquet as pq

    location = f"{root.rstrip('/')}/{unquote(path)}"
    if location.startswith("s3://"):
        bucket, _, key = location.split("://", 1)[1].partition("/")
        import boto3

        body = boto3.session.Session().client("s3", **client).get_object(Bucket=bucket, Key=key)["Body"].read()
        source = pq.ParquetFile(io.BytesIO(body))
    else:
        source = pq.ParquetFile(location)
    present = set(source.schema_arrow.names)
    for part in source.iter_batches(columns=[f.name for f in schema if f.name in present]):
        columns = [
            part.column(part.schema.get_field_index(f.name)).cast(f.type) if f.name in present else pa.nulls(part.num_rows, f.type)
            for f in schema
        ]
        yield pa.RecordBatch.from_arrays(columns, schema=schema)


def _file_table(root: str, paths: list[str], schema: pa.Schema, client: dict[str, Any]) -> pa.Table:
    """The rows of the data files `paths`, in their order, as one table of `schema`."""
    import pyarrow as pa

    return pa.Table.from_batches([b for path in paths for b in _file_batches(root, path, schema, client)], schema=schema)


def _rewriter(
    root: str, schema: pa.Schema, client: dict[str, Any], updated: tuple[str, list[str], pa.Schema],
    keys: list[str], rules: dict[str, str], batch_column: str,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def rewrite(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        # In the batch's own columns: a state column it lacks keeps its values.
        folder, batch_paths, batch_schema = updated
        updates = _file_table(folder, batch_paths, batch_schema, client)
        write = _writer(root, schema, client, None)
        for batch in batches:
            for path in batch.column(0).to_pylist():
                old = _file_table(root, [path], schema, client)
                merged, taken = _merged(old, updates, keys, rules, batch_column)
                for row in write(iter(merged.to_batches())):
                    yield row.append_column("matched", pa.array([taken.to_pylist()], pa.list_(pa.int64())))

    return rewrite


def _inserter(
    root: str, schema: pa.Schema, client: dict[str, Any], folder: str, batch_paths: list[str], taken: list[int]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def insert(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        import pyarrow.compute as pc

        # Spark may split the one-row input over several tasks: only the
        # task that got the row writes (else each would write the inserts).
        if not sum(b.num_rows for b in batches):
            return
        updates = _file_table(folder, batch_paths, schema, client)  # a column the batch lacks: null, as a MERGE inserts it
        new = pc.invert(pc.is_in(pa.array(range(updates.num_rows), pa.int64()), value_set=pa.array(taken, pa.int64())))
        yield from _writer(root, schema, client, None)(iter(updates.filter(new).to_batches()))

    return insert


def _merged(old: pa.Table, updates: pa.Table, keys: list[str], rules: dict[str, str], batch_column: str) -> tuple[pa.Table, pa.Array]:
    """`old` (a state file's rows) with `updates` merged in by the MERGE's
    rules, in `old`'s schema and order, and the indexes of the updates'
    rows it took. A key of the updates is in `old` once at most."""
    import pyarrow as pa
    import pyarrow.compute as pc

    taken = _matches(old, updates, keys)
    hit = pc.is_valid(taken)
    columns = []
    for field in old.schema:
        t = old.column(field.name)
        if field.name in keys or field.name not in updates.column_names:
            columns.append(t)
            continue
        s = updates.column(field.name).take(taken)
        value = s if field.name == batch_column else _rule(rules[field.name], t, s, field.type)
        columns.append(pc.if_else(hit, value, t).cast(field.type))
    return pa.Table.from_arrays(columns, schema=old.schema), pc.drop_null(taken)


def _matches(old: pa.Table, updates: pa.Table, keys: list[str]) -> pa.Array:
    """For each row of `old`, the index of the update with its key (null:
    none). One key column: a hash lookup (`index_in`), a tenth of the cost
    of a join and the sort back into the file's order (measured on a file of
    8.7M keys); more: a join of the keys and row numbers (pyarrow's join
    takes no nested column, so the values are taken by row number after)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if len(keys) == 1:
        return pc.index_in(_key(old, keys[0]), value_set=_key(updates, keys[0])).cast(pa.int64())
    left = pa.table([*(_key(old, k) for k in keys), pa.array(range(old.num_rows), pa.int64())], names=[*keys, "__microbatch_old"])
    right = pa.table([*(_key(updates, k) for k in keys), pa.array(range(updates.num_rows), pa.int64())], names=[*keys, "__microbatch_new"])
    pairs = left.join(right, keys=keys, join_type="left outer", use_threads=False)
    return pairs.take(pc.sort_indices(pairs.column("__microbatch_old"))).column("__microbatch_new").combine_chunks()


def _key(table: pa.Table, name: str) -> pa.Array:
    """A key column as the MERGE's equality compares it: a float -0.0 is
    the key 0.0 (Spark's and DataFusion's `=`; a lookup by value would
    tell them apart). Only for matching: the file keeps its own."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    if pa.types.is_floating(column.type):
        column = pc.if_else(pc.equal(column, pa.scalar(0, column.type)), pa.scalar(0, column.type), column)
    return column


def _rule(rule: str, t: pa.ChunkedArray, s: pa.ChunkedArray, kind: pa.DataType) -> pa.ChunkedArray:
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


def _renamed(batch: pa.RecordBatch, rename: tuple[str, dict[str, str]]) -> pa.RecordBatch:
    """`batch` with the local file URIs of one column spelled as planned."""
    from urllib.parse import unquote, urlparse

    import pyarrow as pa

    column, planned = rename
    index = batch.schema.get_field_index(column)
    values = [
        planned.get(unquote(urlparse(v).path), v) if v is not None and v.startswith("file:") else v
        for v in batch.column(index).to_pylist()
    ]
    return batch.set_column(index, batch.schema.field(index), pa.array(values, pa.string()))


def _cast(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A batch in exactly the table's types (Spark's Arrow may use other
    string or timestamp forms; a narrower state column fails as the
    in-process cast does)."""
    import pyarrow as pa

    columns = []
    for field in schema:
        column = batch.column(batch.schema.get_field_index(field.name))
        try:
            columns.append(column.cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ValueError(f"{CAST_FAILED} {field.name!r} as {field.type}: {exc}") from exc
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _upload(settings: dict[str, Any], local: str, uri: str) -> None:
    import boto3

    bucket, _, key = uri.split("://", 1)[1].partition("/")
    boto3.session.Session().client("s3", **settings).upload_file(local, bucket, key)


class _Stats:
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
