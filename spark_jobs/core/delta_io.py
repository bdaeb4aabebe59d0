"""Small helpers around delta-rs shared by the ledger, state and quarantine.

Reads go through delta-rs's own query engine (`QueryBuilder`), not
`to_pyarrow_table()`: the pyarrow dataset path leaves native threads behind
that abort the interpreter at exit ("terminate called without an active
exception", 7 of 10 runs here; delta-rs#2184), which would turn successful CLI
runs into exit code 134.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, QueryBuilder
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from spark_jobs.errors import StorageError
from spark_jobs.storage.s3 import delta_storage_options

__all__ = [
    "SMALL_FILE_BYTES",
    "describe_os_error",
    "ensure_table",
    "is_commit_conflict",
    "open_table",
    "read_all",
    "storage_errors",
]

#: Compaction target for the tables every run appends to (ledger, consumed
#: index): files of about this size, bigger ones left alone. Delta's default
#: (100 MB) would rewrite the whole table at each compaction until it reached
#: that size, a cost that grows with the pipeline's age; and a read by
#: position decodes a whole file that may hold the row.
SMALL_FILE_BYTES = 2 * 1024 * 1024

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
            configuration=configuration,
            storage_options=storage_options,
            commit_properties=CommitProperties(max_commit_retries=0),
        )
    except Exception as exc:
        # A racing creator wrote version 0 first: fine, use its table.
        if not (is_commit_conflict(exc) or "already exists" in str(exc)):
            raise
    return DeltaTable(path, storage_options=storage_options)


def read_all(table: DeltaTable, *, where: str | None = None, columns: tuple[str, ...] = ()) -> pa.Table:
    """Read a table snapshot through delta-rs's engine: all of it, or the rows
    matching `where` (SQL the caller builds from integers and
    `spark_jobs.core.sql_text` literals only), which Delta's file statistics
    let the engine find without reading every file; all columns, or `columns`."""
    selected = ", ".join(f'"{c}"' for c in columns) if columns else "*"
    sql = f"SELECT {selected} FROM t" + (f" WHERE {where}" if where else "")
    return pa.table(QueryBuilder().register("t", table).execute(sql).read_all())


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
    """True for the error delta-rs raises when another commit won the race."""
    return isinstance(exc, CommitFailedError)
