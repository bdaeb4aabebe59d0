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

from spark_jobs.core.staged import CAST_FAILED, StagedFile

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["MAX_READ_TASKS", "read_files", "write_files", "writing", "written"]

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
        import io
        from urllib.parse import unquote

        import pyarrow as pa
        import pyarrow.parquet as pq

        for batch in batches:
            for path in batch.column(0).to_pylist():
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

    return read


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
            low, high = found["min"].as_py(), found["max"].as_py()
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
            whole += datetime.timedelta(milliseconds=1)
        return whole.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    if pa.types.is_date32(t):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        # As delta-rs writes them: through a float, which the overflow check allows for.
        return float(value)
    if isinstance(value, str):
        return value if len(value) <= MAX_STAT_CHARS else None
    return value
