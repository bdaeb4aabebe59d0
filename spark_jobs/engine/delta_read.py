"""Read a planned range of an upstream Delta table's versions: two readers, the same rows.

* The driver's (`read_versions`, `source.reader: driver`, the default):
  delta-rs reads the range and hands Spark an Arrow table: the change data
  feed for ``read: changes`` (delta-rs's `load_cdf`), the files the versions
  added for ``read: appends``. A batch spans at most `batch.max_versions`
  versions, which keeps what the driver holds bounded. It needs no JVM of
  its own and no delta-spark, and it is the faster one for the batches
  chained pipelines make.
* Spark's (`spark_versions`, `source.reader: spark`): delta-spark reads the
  range on the executors (`readChangeFeed`, or the files the versions added),
  so no row passes through the driver. It pays for batches of millions of
  change rows on a cluster (docs/benchmarks.md, "Reading a Delta source"),
  and it reads tables with column mapping, which delta-rs cannot.

Both apply the same rule to a change feed (`net_changes`,
`spark_net_changes`): a row a version removed and added back unchanged is
no change, and only where a version's log entry says it may hold such a
row (`_may_cancel`): a version that only adds files is inserts alone. The
driver nets a range that has one; Spark reads the range as runs of such
versions and others (`_runs`), and nets the first.
"""

from __future__ import annotations

import functools
import io
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from spark_jobs.core.spec import CHANGE_COLUMNS
from spark_jobs.sources.delta import DeltaManifest, feed_files, range_column_types, spark_feed_types, version_actions
from spark_jobs.storage.s3 import delta_storage_options, read_bytes

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["arrow_frame", "batch_schema", "net_changes", "read_versions", "spark_net_changes", "spark_versions"]


def _table(uri: str, version: int | None = None) -> DeltaTable:
    return DeltaTable(uri, version=version, storage_options=delta_storage_options(uri))


def batch_schema(uri: str, read: str, version: int | None = None) -> pa.Schema:
    """The `batch` view's columns for a Delta source: the table's (as of
    `version`, else now), plus the feed's for changes."""
    schema = pa.schema(_table(uri, version).schema().to_arrow())
    if read == "changes":
        schema = pa.schema(
            [*schema, pa.field(CHANGE_COLUMNS[0], pa.string()), pa.field(CHANGE_COLUMNS[1], pa.int64()),
             pa.field(CHANGE_COLUMNS[2], pa.timestamp("us", tz="UTC"))]
        )
    return schema


def arrow_frame(spark: SparkSession, rows: pa.Table) -> DataFrame:
    """`rows` as a Spark DataFrame, with their schema given: Spark Connect
    cannot infer one from a table without rows (CANNOT_INFER_EMPTY_SCHEMA)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    return spark.createDataFrame(rows, schema=from_arrow_schema(rows.schema)) if rows.num_rows == 0 else spark.createDataFrame(rows)


def read_versions(manifest: DeltaManifest) -> pa.Table:
    """Exactly the rows of versions `first..last` (what the batch planned;
    none when the batch only records versions lost upstream)."""
    if manifest.first > manifest.last:
        return batch_schema(manifest.uri, manifest.read).empty_table()
    if manifest.read == "changes":
        table = _table(manifest.uri)
        rows = pa.table(table.load_cdf(starting_version=manifest.first, ending_version=manifest.last).read_all())
        # As `batch_schema` says: plain strings and UTC microseconds, whatever delta-rs hands over.
        rows = rows.cast(pa.schema([_plain(f) for f in rows.schema]))
        # (Netting builds a text key a row: 1.25 GB more of this process for
        # 600k inserts of long, repetitive text that nothing could cancel.)
        return net_changes(rows) if any(map(_may_cancel, _entries(table, manifest).values())) else rows
    return _appended(manifest)


def spark_versions(spark: SparkSession, manifest: DeltaManifest) -> DataFrame:
    """`read_versions`, read by delta-spark on the executors (the session
    must have delta-spark: `default_session(delta=True)`, or a Connect
    server started with it). Not run: a plan, for the batch's one job."""
    if manifest.first > manifest.last:
        return arrow_frame(spark, batch_schema(manifest.uri, manifest.read).empty_table())
    if manifest.read == "changes":
        table = _table(manifest.uri)
        if _widened_since(table, manifest):
            # Read when the job runs, not here: set for the session, and
            # harmless for its other reads (planning refused every other
            # change of a column, `DeltaSource._check_columns_since`).
            spark.conf.set(_WIDENED_READ, "true")
        entries = _entries(table, manifest)

        def read(first: int, last: int) -> DataFrame:
            feed = (
                spark.read.format("delta")
                .option("readChangeFeed", "true")
                .option("startingVersion", first)
                .option("endingVersion", last)
                .load(manifest.uri)
            )
            return _commit_times_as_logged(feed, {v: entries[v] for v in range(first, last + 1)})

        runs = _runs(entries)
        feeds = [(read(first, last), cancels) for first, last, cancels in runs] if len(runs) <= MAX_FEED_READS else []
        # One read, netted whole, as before: for more runs than that (each a
        # relation to plan), or runs read with other columns (with column
        # mapping delta-spark reads a range with its last version's: a run
        # before a column was added lacks it, and a nested one turns the
        # netting off for the range it is in: `spark_net_changes`).
        if not feeds or any(feed.schema != feeds[-1][0].schema for feed, _ in feeds):
            feeds = [(read(manifest.first, manifest.last), True)]
        netted = [spark_net_changes(feed) if cancels else feed for feed, cancels in feeds]
        return functools.reduce(lambda a, b: a.unionByName(b), netted)
    return _spark_appended(spark, manifest)


#: At most this many reads of a change feed's range (`_runs`), else one, netted whole.
MAX_FEED_READS = 8


def _entries(table: DeltaTable, manifest: DeltaManifest) -> dict[int, list[dict[str, Any]] | None]:
    """Each version's log entry in the range (None: gone), of the upstream `table`."""
    return {version: version_actions(table.table_uri, version) for version in range(manifest.first, manifest.last + 1)}


def _runs(entries: dict[int, list[dict[str, Any]] | None]) -> list[tuple[int, int, bool]]:
    """The range as runs of consecutive versions that may cancel or may
    not (`_may_cancel`): (first, last, whether to net). Each is read on its
    own, so that a chain's downstream catching up on a 30M-key first batch
    and a batch of returning keys nets the second's rows alone: netted as
    one range, the first batch's 30M inserts went through both windows too
    (113 s of a 30M-key downstream's read, against 29 s without them;
    docs/benchmarks.md). Netting is within a version, so the runs net as
    the whole range would."""
    runs: list[tuple[int, int, bool]] = []
    for version, actions in entries.items():
        cancels = _may_cancel(actions)
        if runs and runs[-1][2] == cancels:
            runs[-1] = (runs[-1][0], version, cancels)
        else:
            runs.append((version, version, cancels))
    return runs


def _may_cancel(actions: list[dict[str, Any]] | None) -> bool:
    """Whether a version's changes may hold a removal and an addition of
    the same row (`spark_net_changes` has something to cancel): change data
    files (a MERGE's, holding every kind), or data files both removed and
    added. A version that only adds files (an append; a first batch, whose
    keys are all new, of a state with a change feed) reads as inserts alone,
    and one that only removes them as deletes alone: nothing to cancel, and
    netting them is two windows over all their rows (a shuffle and two sorts
    of every column)."""
    if actions is None:
        return True  # (unknown: net, as before)
    kinds = {kind for kind, _ in feed_files(actions, "changes")}
    return "cdc" in kinds or kinds == {"add", "remove"}


#: delta-spark reads a change feed with the table's columns as they are now,
#: and refuses a range written before a column was widened (INT to BIGINT:
#: DELTA_CHANGE_DATA_FEED_INCOMPATIBLE_DATA_SCHEMA) unless this is set; with
#: it, Spark's Parquet reader widens the old files' values.
_WIDENED_READ = "spark.databricks.delta.changeDataFeed.unsafeBatchReadOnIncompatibleSchemaChanges.enabled"


def _widened_since(table: DeltaTable, manifest: DeltaManifest) -> bool:
    """Whether a column the range's files may hold has another type in the
    columns delta-spark reads the range with (`spark_feed_types`; planning
    let only widenings through: `DeltaSource._check_columns_since`)."""
    read_with, _ = spark_feed_types(manifest.uri, table, manifest.last)
    return any(
        read_with.get(name, kind) != kind
        for _, types in range_column_types(manifest.uri, manifest.first, manifest.last)
        for name, kind in types.items()
    )


_ADDED = ("insert", "update_postimage")
_REMOVED = ("delete", "update_preimage")


def net_changes(rows: pa.Table) -> pa.Table:
    """The feed without the rows a version removed and added again unchanged.

    A version with no change data files of its own (a rewind's RESTORE, a
    rewrite widening a column) reads as a delete of every row in the files
    it removed and an insert of every row in the files it added, most of
    them the same rows. Only a transform that subtracts deletes exactly
    nets those out; one with `min`, `max`, `last` or a count of changes
    would not. So within each version, a removal and an addition of an
    identical row (nulls equal nulls) cancel, leaving the version's true
    changes: a RESTORE becomes the exact reversal of what it undid, and a
    rewrite that kept every value, nothing. (A MERGE's update that changed
    nothing cancels too.) Rows keep their order and change types. A table
    with nested or binary columns is passed as it is.
    """
    if rows.num_rows == 0:
        return rows
    values = [c for c in rows.column_names if c not in (CHANGE_COLUMNS[0], CHANGE_COLUMNS[2])]
    if not all(_comparable(rows.schema.field(c).type) for c in values):
        return rows
    kinds = rows.column(CHANGE_COLUMNS[0]).cast(pa.string())
    added, removed = pc.is_in(kinds, pa.array(_ADDED)), pc.is_in(kinds, pa.array(_REMOVED))
    # One text key per row: each value as its length, ':' and its text (so no
    # text can run into the next), a null as 'N'.
    parts = []
    for c in values:
        text = pc.cast(rows.column(c), pa.string())
        parts.append(pc.fill_null(pc.binary_join_element_wise(pc.cast(pc.utf8_length(text), pa.string()), text, ":"), "N"))
    key = pc.binary_join_element_wise(*parts, "|")
    marked = pa.table({"key": key, "added": added, "removed": removed})
    groups = marked.group_by("key", use_threads=False).aggregate([("added", "any"), ("removed", "any")])
    both = groups.filter(pc.and_(groups.column("added_any"), groups.column("removed_any"))).column("key")
    if len(both) == 0:
        return rows
    candidates = pc.indices_nonzero(pc.is_in(key, both)).to_pylist()
    keys, adds = key.take(candidates).to_pylist(), added.take(candidates).to_pylist()
    pending: dict[str, list[tuple[int, bool]]] = {}
    dropped: set[int] = set()
    for i, k, is_add in zip(candidates, keys, adds):
        queue = pending.setdefault(k, [])
        if queue and queue[0][1] != is_add:
            dropped.update((queue.pop(0)[0], i))
        else:
            queue.append((i, is_add))
    keep = pa.array([i not in dropped for i in range(rows.num_rows)])
    return rows.filter(keep)


def spark_net_changes(feed: DataFrame) -> DataFrame:
    """`net_changes` in Spark: within a version, a removal and an addition of
    an identical row (nulls equal nulls) cancel, pair by pair; what is left
    of either kind stays. (Which of several identical rows stay is not
    defined, as their order is not; the rows left are the same.) A feed
    with nested or binary columns is passed as it is, as `net_changes` does."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, BinaryType, MapType, StructType

    values = [c for c in feed.columns if c not in (CHANGE_COLUMNS[0], CHANGE_COLUMNS[2])]
    if any(isinstance(feed.schema[c].dataType, (ArrayType, BinaryType, MapType, StructType)) for c in values):
        return feed
    added = F.col(CHANGE_COLUMNS[0]).isin(*_ADDED)
    # The feed has only these four kinds, so not added means removed.
    same = Window.partitionBy(*[F.col(f"`{c}`") for c in values])
    pairs = F.least(F.sum(added.cast("int")).over(same), F.sum((~added).cast("int")).over(same))
    rank = F.row_number().over(Window.partitionBy(*[F.col(f"`{c}`") for c in values], added).orderBy(F.lit(1)))
    return (
        feed.withColumn("__rank", rank)
        .withColumn("__pairs", pairs)
        .where(F.col("__rank") > F.col("__pairs"))
        .drop("__rank", "__pairs")
    )


def _commit_times_as_logged(feed: DataFrame, entries: dict[int, list[dict[str, Any]] | None]) -> DataFrame:
    """The feed with each version's `_commit_timestamp` from its log entry's
    commit info (`entries`), as delta-rs gives it (and as planning dates
    versions for a data interval). delta-spark gives the log file's
    modification time, which may be a few milliseconds off (seen on a
    RESTORE's commit)."""
    from pyspark.sql import functions as F

    logged: list = []
    for version, actions in entries.items():
        info = next((a["commitInfo"] for a in actions or [] if "commitInfo" in a), {})
        if isinstance(info.get("timestamp"), int):
            logged += [F.lit(version), F.lit(info["timestamp"])]
    if not logged:
        return feed
    column = CHANGE_COLUMNS[2]
    as_logged = F.timestamp_millis(F.element_at(F.create_map(*logged), F.col(CHANGE_COLUMNS[1])))
    return feed.withColumn(column, F.coalesce(as_logged, F.col(column)))


def _comparable(kind: pa.DataType) -> bool:
    """Types whose text tells equal values from unequal ones."""
    return not (pa.types.is_nested(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind))



def _plain(field: pa.Field) -> pa.Field:
    if pa.types.is_string_view(field.type) or pa.types.is_large_string(field.type):
        return field.with_type(pa.string())
    if field.name == CHANGE_COLUMNS[2]:
        return field.with_type(pa.timestamp("us", tz="UTC"))
    if field.name == CHANGE_COLUMNS[1]:
        return field.with_type(pa.int64())
    return field


def _appended(manifest: DeltaManifest) -> pa.Table:
    """The rows of the data files versions first..last added (the source
    checked they only add): read from each version's own log entry, so no
    file of an earlier version and no file an OPTIMIZE rewrote is read."""
    table = _table(manifest.uri, manifest.last)
    schema = pa.schema(table.schema().to_arrow())
    root = table.table_uri.rstrip("/")
    parts = []
    for version in range(manifest.first, manifest.last + 1):
        for action in version_actions(table.table_uri, version) or []:
            add = action.get("add")
            if add is None or not add.get("dataChange", True):
                continue
            data = pq.read_table(io.BytesIO(read_bytes(f"{root}/{add['path']}")))
            for column, value in (add.get("partitionValues") or {}).items():
                # The log's value is the row's (delta-spark 4 writes the column into the file as well).
                if column in data.column_names:
                    data = data.drop_columns([column])
                data = data.append_column(column, pa.array([value] * data.num_rows, pa.string()).cast(schema.field(column).type))
            # Columns added to the table after the file was written read as null.
            for field in schema:
                if field.name not in data.column_names:
                    data = data.append_column(field.name, pa.nulls(data.num_rows, field.type))
            parts.append(data.select(schema.names).cast(schema))
    return pa.concat_tables(parts) if parts else schema.empty_table()


def _spark_appended(spark: SparkSession, manifest: DeltaManifest) -> DataFrame:
    """`_appended` by delta-spark: the table as of a version, kept to the
    files the versions added (matched by path, `_metadata.file_path`).

    The range is read in runs of versions that removed no file, each as of
    its own last version, where every file the run added is still there.
    Only an OPTIMIZE removes files in a range the source planned as appends
    (it refuses removals that change data), and it may have folded files of
    the versions before it into new ones: those are read as of the version
    before it, the files it wrote not at all. Columns added along the range
    read as null in the rows written before them, as the driver's read gives.
    """
    from pyspark.sql import functions as F

    table = _table(manifest.uri, manifest.last)
    runs: list[tuple[int, set[str]]] = []
    added: set[str] = set()
    for version in range(manifest.first, manifest.last + 1):
        actions = version_actions(table.table_uri, version) or []
        if any("remove" in a for a in actions):
            if added:
                runs.append((version - 1, added))
            added = set()
            continue
        added |= {a["add"]["path"] for a in actions if "add" in a and a["add"].get("dataChange", True)}
    if added:
        runs.append((manifest.last, added))
    columns = pa.schema(table.schema().to_arrow()).names
    # A file's path as Spark gives it, decoded (a literal '+' kept: URIs never mean a space by it).
    decoded = F.expr("url_decode(replace(_metadata.file_path, '+', '%2B'))")
    result = None
    for as_of, paths in runs:
        read = spark.read.format("delta").option("versionAsOf", as_of).load(manifest.uri)
        part = read.where(_path_in(decoded, paths))
        result = part if result is None else result.unionByName(part, allowMissingColumns=True)
    if result is None:
        return arrow_frame(spark, batch_schema(manifest.uri, manifest.read).empty_table())
    return result.select(*[F.col(f"`{c}`") for c in columns])


def _path_in(decoded: Column, paths: set[str]) -> Column:
    """Whether a row's file (its decoded path) is one of `paths` (a log's
    paths: relative to the table, or absolute URIs; percent-encoded):
    compared by as many trailing parts as each path has."""
    from pyspark.sql import functions as F

    by_depth: dict[int, list[str]] = {}
    for path in paths:
        plain = unquote(urlparse(path).path if "://" in path else path).strip("/")
        by_depth.setdefault(plain.count("/") + 1, []).append(plain)
    parts = F.split(decoded, "/")
    found = None
    for depth, tails in by_depth.items():
        match = F.concat_ws("/", F.slice(parts, -depth, depth)).isin(sorted(tails))
        found = match if found is None else found | match
    return found
