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
JVM; the rules are `spark_jobs.core.arrow_rows`'s, pickled by value with
this module); `write_table` writes rows already in the job's process the
same way.

`read_files` is the other direction: a snapshot's files (a fold's input, the
files a merge rewrites, a batch's written files checked for duplicate keys)
read by the executors with pyarrow, local or on S3, into a DataFrame; the
job's sessions read no Delta table through delta-spark or Hadoop's S3A (for
their start-up cost, docs/architecture.md), and the tables they read have
no column mapping, so a snapshot is its files less the rows their deletion
vectors delete (a state merged on read: the caller passes each file's
vector descriptor, and the task reads the vector's bytes alone and drops
those rows). A column a file lacks (added to the table after it) reads as
null.

The functions below run on executors, which need pyarrow and numpy (and
boto3 for S3) but not this package: the module is pickled by value (with
`deletion_vectors`'s decoding and `arrow_rows`), as
`spark_jobs.engine.s3_read` is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from spark_jobs.core import arrow_rows, deletion_vectors
from spark_jobs.core.arrow_rows import FileStats, merged_rows
from spark_jobs.core.deletion_vectors import vector_location, vector_rows
from spark_jobs.core.staged import CAST_FAILED, CHANGE_DATA, Staged, StagedFile

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "CHANGE_TYPE", "MAX_READ_TASKS", "read_files", "rewrite_files", "working_names", "write_files",
    "write_table", "writing", "writing_changes", "written",
]

#: What each task returns: one row per file it wrote.
WRITTEN = "path STRING, size BIGINT, records BIGINT, stats STRING, nonfinite STRING, bounds STRING"
#: The column of a change data file that says what each row is.
CHANGE_TYPE = "_change_type"
#: `writing_changes`'s columns beside the new rows: the old row's values (this prefix and the name) and the change
#: (`working_names`: with more underscores in front while a state column is named like one).
BEFORE, CHANGE = "__before_", "__change"
#: At most this many read tasks (one file each below it).
MAX_READ_TASKS = 64
#: The rows of one row group of a file a task writes (`_Out.write`): as many
#: as a batch merged on read takes from a file at once
#: (`merge_on_read.UNIT_ROWS`), so its memory stays what it was.
ROW_GROUP_ROWS = 1 << 18
#: Fewer, if they hold this much in a task's memory (wide rows).
ROW_GROUP_BYTES = 64 * 1024 * 1024


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


def working_names(names: list[str]) -> tuple[str, str]:
    """`writing_changes`'s working columns for a state of columns `names`:
    the prefix of the old row's values and the change's name, `BEFORE` and
    `CHANGE` with as many more leading underscores as it takes for no state
    column to be named like one (a state's columns may have any name, and
    Spark refuses a query that names two columns alike)."""
    mark = ""
    while any(n.startswith(mark + BEFORE) or n == mark + CHANGE for n in names):
        mark += "_"
    return mark + BEFORE, mark + CHANGE


def writing_changes(frame: DataFrame, root: str, schema: pa.Schema, client: dict[str, Any]) -> DataFrame:
    """`writing` for a merge that writes its change feed with it (a merged
    state with `change_feed`, `spark_state.merge_files`): `frame` holds, in
    this order, each row's new values (`schema`'s columns), its old ones
    (as many, named by `working_names`) and the change: "update",
    "insert", or null for a row the batch did not touch. Each task writes
    its rows as one data file and their changes (the old and new row of an
    update, a new key's row, with Delta's `CHANGE_TYPE`) as one change data
    file under `CHANGE_DATA`; a row comes back for each file."""
    _pickle_by_value()
    return frame.mapInArrow(_change_writer(root, schema, client), WRITTEN)


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


def read_files(
    spark: SparkSession, root: str, paths: list[str], schema: pa.Schema, client: dict[str, Any], vectors: dict[str, dict[str, Any]] | None = None
) -> DataFrame:
    """The rows of the data files `paths` (relative to the table's folder
    `root`) as a DataFrame of `schema`, read by the executors. `vectors`:
    the deletion vector (the log's descriptor) of each file of `paths` that
    carries one, by path; the rows it deletes are not read."""
    from pyspark.sql.pandas.types import from_arrow_schema

    _pickle_by_value()
    spark_schema = from_arrow_schema(schema)
    if not paths:
        return spark.createDataFrame([], spark_schema)
    rows = []
    for path in paths:
        vector = (vectors or {}).get(path)
        rows.append((path, json.dumps(vector) if vector else None, vector_location(root, vector)))
    frame = spark.createDataFrame(rows, "path STRING, vector STRING, stored STRING")
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
    cloudpickle.register_pickle_by_value(arrow_rows)
    cloudpickle.register_pickle_by_value(deletion_vectors)


def _writer(
    root: str, schema: pa.Schema, client: dict[str, Any], rename: tuple[str, dict[str, str]] | None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import uuid

        out = _Out(root, f"part-{uuid.uuid4()}-c000.snappy.parquet", schema, client)
        try:
            for batch in batches:
                if batch.num_rows:
                    out.write(_cast(_renamed(batch, rename) if rename else batch, schema))
            yield from out.close()
        finally:
            out.abandon()

    return write


def _change_writer(root: str, schema: pa.Schema, client: dict[str, Any]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import uuid

        import pyarrow as pa
        import pyarrow.compute as pc

        changes_schema = schema.append(pa.field(CHANGE_TYPE, pa.string()))
        data = _Out(root, f"part-{uuid.uuid4()}-c000.snappy.parquet", schema, client)
        changes = _Out(root, f"{CHANGE_DATA}/cdc-{uuid.uuid4()}.snappy.parquet", changes_schema, client)
        try:
            for batch in batches:
                if not batch.num_rows:
                    continue
                # By position (`writing_changes`): the new values, the old ones, the change.
                width = len(schema)
                rows = _cast(pa.RecordBatch.from_arrays(batch.columns[:width], names=schema.names), schema)
                data.write(rows)
                kind = batch.column(2 * width)
                updated = pc.fill_null(pc.equal(kind, "update"), False)
                inserted = pc.fill_null(pc.equal(kind, "insert"), False)
                before = pa.RecordBatch.from_arrays(batch.columns[width : 2 * width], names=schema.names)
                parts = [
                    (_cast(before, schema).filter(updated), "update_preimage"),
                    (rows.filter(updated), "update_postimage"),
                    (rows.filter(inserted), "insert"),
                ]
                for part, change_type in parts:
                    if part.num_rows:
                        label = pa.array([change_type] * part.num_rows, pa.string())
                        changes.write(pa.RecordBatch.from_arrays([*part.columns, label], schema=changes_schema))
            yield from data.close()
            yield from changes.close()
        finally:
            data.abandon()
            changes.abandon()

    return write


class _Out:
    """One Parquet file a task writes into a table's folder `root` (a local
    folder, or an S3 prefix: written locally, then uploaded), and the row
    that tells the job's process of it."""

    def __init__(self, root: str, name: str, schema: pa.Schema, client: dict[str, Any]) -> None:
        import os
        import tempfile

        self.root, self.name, self.schema, self.client = root, name, schema, client
        self.s3 = root.startswith("s3://")
        if self.s3:
            handle, self.local = tempfile.mkstemp(suffix=".parquet")
            os.close(handle)
        else:
            self.local = os.path.join(root, name)
            os.makedirs(os.path.dirname(self.local), exist_ok=True)
        self.stats = FileStats(schema)
        self.writer: Any = None
        #: Rows not yet written: a row group is written once it is full.
        self.pending: list[pa.RecordBatch] = []

    def write(self, batch: pa.RecordBatch) -> None:
        """Add `batch`'s rows to the file. Spark hands a task its rows in
        Arrow batches of 10,000 (``spark.sql.execution.arrow.maxRecordsPerBatch``),
        and each written as it came was a row group of its own (376 in each
        file of a 30M-key state); they are gathered into groups of
        `ROW_GROUP_ROWS`, or fewer that hold `ROW_GROUP_BYTES` in memory."""
        self.stats.add(batch)
        self.pending.append(batch)
        held = sum(b.num_rows for b in self.pending)
        if held >= ROW_GROUP_ROWS:
            self._flush(ROW_GROUP_ROWS * (held // ROW_GROUP_ROWS))
        elif sum(b.nbytes for b in self.pending) >= ROW_GROUP_BYTES:
            self._flush(held)

    def _flush(self, rows: int) -> None:
        """Write the first `rows` pending rows, in groups of `ROW_GROUP_ROWS`; keep the rest pending."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.local, self.schema, compression="snappy", coerce_timestamps="us", allow_truncated_timestamps=False)
        held = pa.Table.from_batches(self.pending, schema=self.schema)
        self.writer.write_table(held.slice(0, rows), row_group_size=ROW_GROUP_ROWS)
        self.pending = held.slice(rows).to_batches()

    def close(self) -> Iterator[pa.RecordBatch]:
        """Finish the file and yield its row (nothing, if no row was written)."""
        import json
        import os

        import pyarrow as pa

        if self.pending:
            self._flush(sum(b.num_rows for b in self.pending))
        if self.writer is None:
            return
        self.writer.close()
        self.writer = None
        size = os.path.getsize(self.local)
        if self.s3:
            _upload(self.client, self.local, f"{self.root.rstrip('/')}/{self.name}")
        row = {
            "path": self.name, "size": size, "records": self.stats.records, "stats": self.stats.json(),
            "nonfinite": json.dumps(sorted(self.stats.nonfinite)), "bounds": self.stats.bounds(),
        }
        yield pa.RecordBatch.from_pylist([row], schema=pa.schema([(n, pa.int64() if n in ("size", "records") else pa.string()) for n in row]))

    def abandon(self) -> None:
        """Close a file left open by a failure; drop the local copy of an S3 upload."""
        import os

        self.pending = []

        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.s3 and os.path.exists(self.local):
            os.unlink(self.local)


def _reader(root: str, schema: pa.Schema, client: dict[str, Any]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for path, vector, stored in zip(*(batch.column(i).to_pylist() for i in range(3)), strict=True):
                deleted = _deleted_rows(json.loads(vector), stored, client) if vector else None
                yield from _file_batches(root, path, schema, client, deleted)

    return read


def _deleted_rows(vector: dict[str, Any], stored: str | None, client: dict[str, Any]) -> Any:
    """The row indexes the deletion vector `vector` deletes, read from the
    file `stored` (a path or ``s3://`` URI; None for an inline vector): only
    its bytes, as ranges (one file may hold the vectors of many)."""

    def read(start: int, size: int) -> bytes:
        if stored.startswith("s3://"):
            import boto3

            bucket, _, key = stored.split("://", 1)[1].partition("/")
            s3 = boto3.session.Session().client("s3", **client)
            return s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + size - 1}")["Body"].read()
        with open(stored, "rb") as file:
            file.seek(start)
            return file.read(size)

    return vector_rows(vector, read)


def _file_batches(root: str, path: str, schema: pa.Schema, client: dict[str, Any], deleted: Any = None) -> Iterator[pa.RecordBatch]:
    """The rows of the data file `path` (relative to `root`) in `schema`: a
    column the file lacks (added to the table after it) as nulls; without
    the rows whose indexes are in `deleted` (sorted, of the file's deletion vector)."""
    import io
    from urllib.parse import unquote

    import numpy as np
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
    start = 0
    for part in source.iter_batches(columns=[f.name for f in schema if f.name in present]):
        columns = [
            part.column(part.schema.get_field_index(f.name)).cast(f.type) if f.name in present else pa.nulls(part.num_rows, f.type)
            for f in schema
        ]
        rows = pa.RecordBatch.from_arrays(columns, schema=schema)
        if deleted is not None and len(deleted):
            here = deleted[np.searchsorted(deleted, start) : np.searchsorted(deleted, start + rows.num_rows)] - start
            if len(here):
                keep = np.ones(rows.num_rows, bool)
                keep[here.astype(np.int64)] = False
                rows = rows.filter(pa.array(keep))
        start += part.num_rows
        yield rows


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
                merged, taken = merged_rows(old, updates, keys, rules, batch_column)
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
