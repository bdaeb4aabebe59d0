"""Small helpers around delta-rs shared by the ledger, state and quarantine.

Reads go through delta-rs's own query engine (`QueryBuilder`), not
`to_pyarrow_table()`: the pyarrow dataset path leaves native threads behind
that abort the interpreter at exit ("terminate called without an active
exception", 7 of 10 runs here; delta-rs#2184), which would turn successful CLI
runs into exit code 134.
"""

from __future__ import annotations

import io
import json
from array import array
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, QueryBuilder, WriterProperties
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from spark_jobs.core.fencing import STATE_FENCE
from spark_jobs.errors import StorageError
from spark_jobs.storage.s3 import delta_storage_options, read_bytes

__all__ = [
    "COMPACTION_WRITER",
    "arrow",
    "commit_info",
    "commit_infos",
    "count_rows",
    "int64s",
    "rows_of",
    "strings",
    "SMALL_FILE_BYTES",
    "TABLE_DEFAULTS",
    "Stats",
    "describe_os_error",
    "ensure_table",
    "in_range",
    "is_commit_conflict",
    "with_user_metadata",
    "open_table",
    "read_all",
    "read_pruned",
    "refreshed",
    "small_files",
    "storage_errors",
    "version_actions",
]

#: Compaction target for the tables every run appends to (ledger, consumed
#: index): files of about this size, bigger ones left alone. Delta's default
#: (100 MB) would rewrite the whole table at each compaction until it reached
#: that size, a cost that grows with the pipeline's age; and a read by
#: position decodes a whole file that may hold the row.
SMALL_FILE_BYTES = 2 * 1024 * 1024
#: How those tables' compactions write: row groups of at most 1,024 rows, so
#: that a read by position decodes one small group (see `read_pruned`).
COMPACTION_WRITER = WriterProperties(max_row_group_size=1024, compression="ZSTD")

#: What a storage error means for the pipeline, unless the caller knows better.
RERUN_SAFE = (
    "A Delta commit is atomic, so the table holds it whole or not at all and every table "
    "stays readable. It is safe to re-run once the storage is healthy again (space freed, "
    "disk fixed): the next run completes or replays the batch exactly once."
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: How Rust renders an OS error inside a `DeltaError`'s text.
_OS_ERROR = re.compile(r"\(os error \d+\)")


def open_table(path: str) -> DeltaTable | None:
    """The table at `path`, or None if there is no Delta table there yet.

    S3 locations get their storage options from boto3's chain
    (`spark_jobs.storage.s3`).
    """
    try:
        return DeltaTable(path, storage_options=delta_storage_options(path))
    except TableNotFoundError:
        return None


def refreshed(table: DeltaTable | None, path: str) -> DeltaTable | None:
    """`table` brought to the latest version by reading only the commits since
    (milliseconds), or the table at `path` opened (reading its checkpoint) if
    there is no handle yet; None if there is no table."""
    if table is None:
        return open_table(path)
    table.update_incremental()
    return table


#: The properties of every table the job makes. A checkpoint every 10
#: commits, not Delta's 100: a run opens its tables several times a batch,
#: and each open reads the log's entries since the last checkpoint (at 45
#: entries 20 ms, after a checkpoint 5; docs/benchmarks.md "Event time:
#: windows beside Structured Streaming").
TABLE_DEFAULTS = {"delta.checkpointInterval": "10"}


def ensure_table(
    path: str,
    schema: pa.Schema,
    *,
    name: str | None = None,
    description: str | None = None,
    configuration: dict[str, str] | None = None,
) -> DeltaTable:
    """The table at `path`, created empty first if it does not exist.

    Fenced commits must be made from a loaded snapshot: creating a table *with*
    the first fenced commit is not safe, because a second creator that finds
    the table already there appends to it from a snapshot that already holds
    the first commit, and the conflict check sees nothing. So tables are
    created empty (racing creators: one wins, the others find it) and every
    fenced commit goes through the normal snapshot check.
    """
    storage_options = delta_storage_options(path)
    table = open_table(path)
    if table is not None:
        return table
    try:
        # No commit retries: delta-rs would retry a CREATE that lost the race
        # as the next version, a second CREATE (new table id) that makes any
        # fenced commit in flight fail with "metadata changed".
        DeltaTable.create(
            path,
            schema,
            mode="ignore",
            name=name,
            description=description,
            configuration={**TABLE_DEFAULTS, **(configuration or {})},
            storage_options=storage_options,
            commit_properties=CommitProperties(max_commit_retries=0),
        )
    except Exception as exc:
        # A racing creator wrote version 0 first: fine, use its table.
        if not (is_commit_conflict(exc) or "already exists" in str(exc)):
            raise
    return DeltaTable(path, storage_options=storage_options)


def arrow(data: Any) -> pa.Table:
    """A pyarrow table from delta-rs's Arrow results (arro3 objects), through
    the Arrow stream interface: `pa.table` would first ask whether they are
    pandas frames, importing pandas on a run's hot path (docs/benchmarks.md,
    "Figures behind the code's choices")."""
    return pa.RecordBatchReader.from_stream(data).read_all()


def int64s(values: Sequence[int]) -> pa.Array:
    """An int64 array built from its buffers. pyarrow's conversion of Python
    values first asks whether they are a pandas object, importing pandas
    on the hot path (see `arrow`), where row masks need a few values."""
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(array("q", values).tobytes())])


def strings(values: Sequence[str]) -> pa.Array:
    """A string array built from its buffers (see `int64s`)."""
    data = [v.encode() for v in values]
    offsets = array("i", [0])
    for item in data:
        offsets.append(offsets[-1] + len(item))
    return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(data))])


def rows_of(data: pa.Table) -> list[dict[str, Any]]:
    """`data.to_pylist()`, with time zone-aware timestamps turned into
    datetimes here: pyarrow's own conversion of a zone imports pandas."""
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    zoned = [f.name for f in data.schema if pa.types.is_timestamp(f.type) and f.type.tz is not None]
    if not zoned:
        return data.to_pylist()
    plain = data.drop_columns(zoned).to_pylist()
    for name in zoned:
        field = data.schema.field(name)
        per_second = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[field.type.unit]
        values = data.column(name).cast(pa.int64()).to_pylist()
        for row, value in zip(plain, values):
            row[name] = None if value is None else epoch + timedelta(microseconds=value * 1_000_000 // per_second)
    return plain


def read_all(table: DeltaTable, *, where: str | None = None, columns: tuple[str, ...] = ()) -> pa.Table:
    """Read a table snapshot through delta-rs's engine: all of it, or the rows
    matching `where` (SQL the caller builds from integers and
    `spark_jobs.core.sql_text` literals only), which Delta's file statistics
    let the engine find without reading every file; all columns, or `columns`."""
    selected = ", ".join(f'"{c}"' for c in columns) if columns else "*"
    sql = f"SELECT {selected} FROM t" + (f" WHERE {where}" if where else "")
    return _plain(arrow(QueryBuilder().register("t", table).execute(sql).read_all()))


def count_rows(table: DeltaTable, *, where: str) -> int:
    """How many rows match `where` (built as for `read_all`), counted by the engine."""
    data = QueryBuilder().register("t", table).execute(f"SELECT count(*) AS n FROM t WHERE {where}").read_all()
    return int(arrow(data).column("n")[0].as_py())


#: A column's (min, max) in a file or row group, (None, None) when unknown.
Stats = Callable[[str], tuple[Any, Any]]


def read_pruned(
    table: DeltaTable,
    keep: Callable[[Stats], bool],
    rows: Callable[[pa.Table], pa.ChunkedArray],
    *,
    where: str,
    columns: tuple[str, ...] = (),
) -> pa.Table:
    """The rows `rows` selects (a boolean mask of a file's rows) of the
    snapshot's files and row groups that `keep` keeps.

    `keep` sees a column's statistics (for a file, from its add action; for
    a row group, from the Parquet footer) and drops what cannot hold a
    wanted row; what is kept is read with pyarrow and filtered by `rows`
    with compute kernels (an Arrow expression would import pyarrow.dataset,
    half a second). This is the hot path of every run (the ledger's head,
    the consumed index), and it stays off DataFusion, whose first query in a
    process costs about half a second; the files these tables are compacted
    into hold small row groups (`COMPACTION_WRITER`), so a row is found by
    decoding one group, not a file. Reading a snapshot's add files is
    reading the table when it needs no reader features (no deletion
    vectors, no column mapping: what delta-rs writes for our tables); a
    table that does is read through `read_all(where=...)`, which must mean
    the same as `rows`. Columns a file lacks (written before they were
    added) read as null.
    """
    if table.protocol().min_reader_version > 1:
        return read_all(table, where=where, columns=columns)
    root = table.table_uri.rstrip("/")
    parts = []
    actions = arrow(table.get_add_actions(flatten=True))
    for i, path in enumerate(actions.column("path").to_pylist()):
        # Statistics are read per asked column: turning every column into
        # Python would turn timestamps too, and that imports pandas (see `arrow`).
        if not keep(lambda c, i=i: (_stat(actions, f"min.{c}", i), _stat(actions, f"max.{c}", i))):
            continue
        # Single-threaded, like everything else on this path: pyarrow's
        # thread pools still alive beside delta-rs's at interpreter exit
        # aborted 1 run in 12 here ("terminate called without an active
        # exception", exit 134); none in 36 without them.
        parquet = pq.ParquetFile(io.BytesIO(read_bytes(f"{root}/{path}")), pre_buffer=False)
        groups = [i for i in range(parquet.num_row_groups) if keep(_group_stats(parquet, i))]
        if not groups:
            continue
        data = _plain(parquet.read_row_groups(groups, use_threads=False))
        data = data.filter(rows(data))
        if columns:
            data = data.select([c for c in columns if c in data.column_names])
        parts.append(data)
    if not parts:
        return pa.table({c: pa.array([], pa.null()) for c in columns}) if columns else pa.table({})
    return pa.concat_tables(parts, promote_options="permissive")


def _stat(actions: pa.Table, column: str, row: int) -> Any:
    return actions.column(column)[row].as_py() if column in actions.column_names else None


def _group_stats(parquet: pq.ParquetFile, group: int) -> Stats:
    names = parquet.schema_arrow.names
    metadata = parquet.metadata.row_group(group)

    def stats(column: str) -> tuple[Any, Any]:
        if column not in names:
            return None, None
        found = metadata.column(names.index(column)).statistics
        return (found.min, found.max) if found is not None and found.has_min_max else (None, None)

    return stats


def in_range(stats: Stats, column: str, low: Any, high: Any) -> bool:
    """Whether statistics allow a value of `column` in [low, high] (unknown: yes)."""
    lo, hi = stats(column)
    return (hi is None or hi >= low) and (lo is None or lo <= high)


def _plain(data: pa.Table) -> pa.Table:
    """Views and large variants of strings as plain strings (writers differ;
    not every Arrow kernel takes them all)."""
    fields = [
        f.with_type(pa.string()) if pa.types.is_string_view(f.type) or pa.types.is_large_string(f.type) else f
        for f in data.schema
    ]
    return data.cast(pa.schema(fields)) if fields != list(data.schema) else data


def small_files(table: DeltaTable) -> int:
    """How many of the snapshot's files are under half `SMALL_FILE_BYTES`: what a
    compaction would merge (files it already made are left out of the count)."""
    sizes = arrow(table.get_add_actions(flatten=True)).column("size_bytes")
    return int(pc.sum(pc.less(sizes, SMALL_FILE_BYTES // 2)).as_py() or 0)


@contextmanager
def storage_errors(action: str, path: str, *, note: str = RERUN_SAFE) -> Iterator[None]:
    """Turn an OS-level failure inside delta-rs into a retryable `StorageError`.

    delta-rs reports a full disk or an I/O error either as an `OSError` whose
    text is a colourised Rust error chain ("Generic LocalFileSystem error /
    Unable to copy data to file / No space left on device (os error 28)") or,
    when it happens while a data file is being finished, as a `DeltaError`
    ("Failed to parse parquet: External: ... (os error 28)"). The message says
    instead what the run was doing (`action`), on which table, the cause, and
    whether re-running is safe (`note`). Commit conflicts and other Delta
    errors pass through unchanged.
    """
    try:
        yield
    except (OSError, DeltaError) as exc:
        if isinstance(exc, CommitFailedError) or not (isinstance(exc, OSError) or _OS_ERROR.search(str(exc))):
            raise
        raise StorageError(f"{action}: storage error on Delta table {path}: {describe_os_error(exc)}. {note}") from exc


def describe_os_error(exc: Exception) -> str:
    """One line from delta-rs's multi-line, colourised error chain (outermost first)."""
    lines = (line.strip().lstrip("\u21b3").strip() for line in _ANSI.sub("", str(exc)).splitlines())
    return ": ".join(line for line in lines if line) or type(exc).__name__


def is_commit_conflict(exc: BaseException) -> bool:
    """True for the error delta-rs raises when another commit won the race
    (and the job's own log entries: `own_commits.commit`)."""
    return isinstance(exc, CommitFailedError)


def commit_info(table_uri: str, version: int) -> dict[str, Any] | None:
    """Version `version`'s commit info, read from its own log entry, with
    ``"version"`` set to `version`; None if the entry is gone (a log cleanup).

    The one way this project reads a commit's metadata. Never
    `DeltaTable.history()`: delta-rs 1.6.6 numbers its entries by counting
    down from the handle's version, so on a handle opened before newer
    commits the newest entries come back under wrong numbers (delta-rs#4488),
    and a version taken from them is another commit's (a batch recorded under
    the wrong state version, then rewound to the wrong data)."""
    actions = version_actions(table_uri, version)
    if actions is None:
        return None
    info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
    return {**with_user_metadata(info, actions), "version": version}


def with_user_metadata(info: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any]:
    """A commit info with the batch metadata a commit by delta-spark carries
    in its ``userMetadata`` (the job's big batches were MERGEd by delta-spark
    until 2026-12-04, which put there, under
    ``microbatch``, what delta-rs puts in the commit info itself), so that
    its readers read both alike. Only a commit of the job's: the metadata's
    position is the one the commit's own ``txn`` action moves the state
    fence to (`actions`: the version's). A user's write whose text merely
    names ``microbatch`` stays an outside change."""
    raw = info.get("userMetadata")
    if not isinstance(raw, str) or not raw.startswith("{"):
        return info
    try:
        carried = json.loads(raw).get("microbatch")
        position = json.loads(carried).get("txn") if isinstance(carried, str) else None
    except (ValueError, AttributeError):
        return info  # a user's own text
    fenced = {a["txn"].get("version") for a in actions if "txn" in a and a["txn"].get("appId") == STATE_FENCE}
    if position is None or position not in fenced:
        return info
    return {"microbatch": carried, **info}


def commit_infos(table_uri: str, newest: int, oldest: int = 0) -> Iterator[dict[str, Any]]:
    """`commit_info` of versions `newest` down to `oldest`, newest first,
    ending early at the first entry that is gone (the ones before it are
    gone too: a log cleanup removes the oldest)."""
    for version in range(newest, max(oldest, 0) - 1, -1):
        info = commit_info(table_uri, version)
        if info is None:
            return
        yield info


def version_actions(table_uri: str, version: int) -> list[dict[str, Any]] | None:
    """The actions of one version's log entry, None if the entry is gone."""
    try:
        entry = read_bytes(f"{table_uri.rstrip('/')}/_delta_log/{version:020d}.json").decode()
    except FileNotFoundError:
        return None
    return [json.loads(line) for line in entry.splitlines() if line.strip()]
