"""Small helpers around delta-rs shared by the ledger, state and quarantine.

Reads go through delta-rs's own query engine (`QueryBuilder`), not
`to_pyarrow_table()`: the pyarrow dataset path leaves native threads behind
that abort the interpreter at exit ("terminate called without an active
exception", 7 of 10 runs here; delta-rs#2184), which would turn successful CLI
runs into exit code 134.
"""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import CommitFailedError, TableNotFoundError

from spark_jobs.storage import delta_storage_options


def open_table(path: str, storage_options: dict[str, str] | None = None) -> DeltaTable | None:
    """The table at `path`, or None if there is no Delta table there yet.

    Without `storage_options`, S3 locations get theirs from boto3's chain
    (`spark_jobs.storage`).
    """
    if storage_options is None:
        storage_options = delta_storage_options(path)
    try:
        return DeltaTable(path, storage_options=storage_options)
    except TableNotFoundError:
        return None


def ensure_table(
    path: str,
    schema: pa.Schema,
    *,
    storage_options: dict[str, str] | None = None,
    name: str | None = None,
    description: str | None = None,
) -> DeltaTable:
    """The table at `path`, created empty first if it does not exist.

    Fenced commits must be made from a loaded snapshot: creating a table *with*
    the first fenced commit is not safe, because a second creator that finds
    the table already there appends to it from a snapshot that already holds
    the first commit, and the conflict check sees nothing. So tables are
    created empty (racing creators: one wins, the others find it) and every
    fenced commit goes through the normal snapshot check.
    """
    if storage_options is None:
        storage_options = delta_storage_options(path)
    table = open_table(path, storage_options)
    if table is not None:
        return table
    try:
        DeltaTable.create(
            path, schema, mode="ignore", name=name, description=description, storage_options=storage_options
        )
    except Exception as exc:
        # A racing creator wrote version 0 first: fine, use its table.
        if not (is_commit_conflict(exc) or "already exists" in str(exc)):
            raise
    return DeltaTable(path, storage_options=storage_options)


def read_all(table: DeltaTable) -> pa.Table:
    """Read a whole table snapshot through delta-rs's engine."""
    return pa.table(QueryBuilder().register("t", table).execute("SELECT * FROM t").read_all())


def query(table: DeltaTable, sql: str) -> pa.Table:
    """Run `sql` against the snapshot, registered as `t`."""
    return pa.table(QueryBuilder().register("t", table).execute(sql).read_all())


def is_commit_conflict(exc: BaseException) -> bool:
    """True for the error delta-rs raises when another commit won the race."""
    return isinstance(exc, CommitFailedError)
