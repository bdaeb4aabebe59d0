"""Rows the executors wrote as a table's data files, committed by the job.

On the executors' path (`state.write`, docs/architecture.md "Where the rows
go"), Spark's tasks write a batch's rows (its state updates, its quarantined
records, a fold's result) straight into the table's folder as Parquet files
(`spark_jobs.engine.spark_write`), and hand back only what the log needs of
each: its name, size, record count and statistics. This module commits such
files with delta-rs, in one commit that carries the fence and the commit
metadata: the protocol's commit points do not change, and the rows never
pass through the job's process.

The files' statistics are exact bounds of what the tasks wrote, so the
checks that read a batch's values (`Staged.ranges`: the overflow check) get
them from the log instead of the rows.
"""

from __future__ import annotations

import io
import json
import logging
import time
from dataclasses import dataclass
from datetime import date, datetime, timezone
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction, RemoveAction

from spark_jobs.core.delta_io import arrow
from spark_jobs.errors import ConcurrentRunError
from spark_jobs.storage.listing import StoredFile, delete, modified_at
from spark_jobs.storage.s3 import is_s3, read_bytes

log = logging.getLogger("microbatch")

__all__ = [
    "CAST_FAILED",
    "CHANGE_DATA",
    "IN_PROCESS_ROWS",
    "REWRITE_FROM_BYTES",
    "Sink",
    "Staged",
    "StagedFile",
    "StagedValues",
    "commit_files",
    "delete_files",
    "files_meeting",
    "files_bytes",
    "key_range",
    "read_staged",
    "require_written",
    "touched_files",
]


#: A merged state's batch of at most this many rows is small: merged by
#: delta-rs in the job's process (a MERGE that prunes the state's files by
#: the batch's keys, which a small batch's keys allow), or by the executors
#: file by file (`REWRITE_FROM_BYTES`). A bigger one is merged by Spark's
#: executors, a join of the state's files it may touch with the batch's.
#: About 100 MB in the job's process at the most (docs/state-at-scale.md).
IN_PROCESS_ROWS = 500_000

#: A small batch (`IN_PROCESS_ROWS`) whose merge would rewrite more than
#: this many bytes of a merged state's files has them rewritten by the
#: executors, each file where it stands (`FileWriting.rewrite_files`): a
#: MERGE here would stream every row of them through the job's process.
REWRITE_FROM_BYTES = 256 * 1024 * 1024

#: A Delta table's folder of change data files (delta-rs's and delta-spark's name).
CHANGE_DATA = "_change_data"

#: Starts the message of a value that does not cast to the state's column
#: type, in a writing task or in the job's process alike; the job turns it
#: into a `TransformError` (the spec's to fix).
CAST_FAILED = "microbatch: cannot store column"


@dataclass(frozen=True)
class Sink:
    """Where the executors write a batch's rows (`Compute.process(sink=...)`):
    its state updates in the state's types, each tagged with the batch id,
    and its quarantined records, each tagged with the batch's position."""

    #: The folder the updates' files go to: the state table's (an appended
    #: state commits them as they are; a merged one merges them in, then
    #: drops them).
    root: str
    #: The updates' columns in the state's types, `_batch_id` last.
    schema: pa.Schema
    #: The quarantine table's folder (`quarantine.SCHEMA`).
    quarantine_root: str
    pipeline: str
    epoch: int
    batch_id: int
    #: The dedup table's folder (`spark_jobs.core.dedup`), with `dedup` only.
    dedup_root: str | None = None


@dataclass(frozen=True)
class StagedFile:
    """One data file a task wrote: its path relative to the table's folder."""

    path: str
    size: int
    records: int
    #: Delta's statistics JSON (numRecords, minValues, maxValues, nullCount).
    stats: str
    #: Floating-point columns holding an infinity or a NaN (no bounds in `stats`).
    nonfinite: tuple[str, ...] = ()
    #: Exact bounds of the numeric columns, JSON: column to [low, high] as text.
    bounds: str = "{}"


@dataclass(frozen=True)
class Staged:
    """Rows written as data files in the folder `root`, not yet committed, in `schema`."""

    files: tuple[StagedFile, ...]
    schema: pa.Schema
    root: str

    @property
    def rows(self) -> int:
        return sum(f.records for f in self.files)

    def ranges(self, column: str) -> tuple[Fraction, Fraction] | None:
        """The numeric column's smallest and largest value over every file,
        exactly (None: all null)."""
        exact = (lambda text: Fraction(float(text))) if pa.types.is_floating(self.schema.field(column).type) else (lambda text: Fraction(Decimal(text)))
        lows, highs = [], []
        for f in self.files:
            found = json.loads(f.bounds).get(column)
            if found is not None:
                lows.append(exact(found[0]))
                highs.append(exact(found[1]))
        return (min(lows), max(highs)) if lows else None


class StagedValues:
    """A staged batch's values as the overflow check reads them
    (`widen.BatchValues`): bounds from what the writing tasks saw, rows read
    here only for the keys the check names (those near a column's limit)."""

    def __init__(self, staged: Staged) -> None:
        self.root = staged.root
        self.staged = staged

    @property
    def names(self) -> list[str]:
        return self.staged.schema.names

    def type(self, column: str) -> pa.DataType:
        return self.staged.schema.field(column).type

    def range(self, column: str) -> tuple[Fraction, Fraction] | None:
        return self.staged.ranges(column)

    def non_finite(self, column: str, keys: list[str]) -> tuple[dict[str, Any], Any] | None:
        for f in self.staged.files:
            if column not in f.nonfinite:
                continue
            rows = read_staged(Staged((f,), self.staged.schema, self.root), [*keys, column])
            bad = pc.fill_null(pc.invert(pc.is_finite(rows.column(column))), False)
            if pc.any(bad).as_py():
                row = pc.index(bad, True).as_py()
                return {k: rows.column(k)[row].as_py() for k in keys}, rows.column(column)[row].as_py()
        return None

    def rows(self, columns: list[str], keys: list[str], wanted: pa.Table) -> pa.Table:
        wanted = wanted.select(keys).cast(pa.schema([self.staged.schema.field(k) for k in keys]))
        parts = []
        for f in self.staged.files:
            rows = read_staged(Staged((f,), self.staged.schema, self.root), columns)
            parts.append(rows.join(wanted, keys=keys, join_type="left semi").select(columns))
        return pa.concat_tables(parts) if parts else pa.schema([self.staged.schema.field(c) for c in columns]).empty_table()


def read_staged(staged: Staged, columns: list[str] | None = None) -> pa.Table:
    """A staged result's rows (or some of its columns), read in this process:
    for results small enough (`IN_PROCESS_ROWS`), or the few rows a check names."""
    parts = []
    for f in staged.files:
        location = f"{staged.root.rstrip('/')}/{f.path}"
        source = pq.ParquetFile(io.BytesIO(read_bytes(location)) if is_s3(location) else location)
        parts.append(source.read(columns=columns))
    schema = staged.schema if columns is None else pa.schema([staged.schema.field(c) for c in columns])
    return pa.concat_tables(parts).cast(schema) if parts else schema.empty_table()


def files_bytes(table: DeltaTable, paths: list[str] | None = None) -> int:
    """The size of the snapshot's files `paths` (None: all of them), from the log."""
    sizes = _sizes(table)
    return sum(sizes.values()) if paths is None else sum(sizes[p] for p in paths)


def _sizes(table: DeltaTable) -> dict[str, int]:
    """Each file of the snapshot's size, by path, from the log."""
    actions = arrow(table.get_add_actions(flatten=True))
    return dict(zip(actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist()))


def touched_files(table: DeltaTable, keys: tuple[str, ...] | list[str], staged: Staged) -> list[str]:
    """The paths of the snapshot's files that may hold a key of the batch:
    with one key column, those whose key range (from their statistics)
    meets the batch's; else, or without statistics, every file. (Keys that
    come back from all over the state touch every file: a copy-on-write
    merge rewrites them all, as delta-rs's MERGE does.)

    A file judged untouched keeps its rows as they are, and the batch's row
    for a key in it is written beside it: the key twice. So every doubt
    counts a file as touched: the two ranges are compared as values of the
    key's type (never as text: a year before 1000 sorts wrongly as text),
    and where the log's bounds are not exact they are widened first
    (`_file_range`)."""
    kind = staged.schema.field(keys[0]).type
    return files_meeting(table, keys, kind, key_range(staged, keys[0]) if len(keys) == 1 else None)


def files_meeting(table: DeltaTable, keys: tuple[str, ...] | list[str], kind: pa.DataType, batch: tuple[Any, Any] | None) -> list[str]:
    """`touched_files` of a batch whose key (one column, of type `kind`)
    ranges over `batch` (None: unknown, every file)."""
    actions = arrow(table.get_add_actions(flatten=True))
    paths = actions.column("path").to_pylist()
    if len(keys) != 1:
        return paths
    key = keys[0]
    lows, highs = f"min.{key}", f"max.{key}"
    if batch is None or lows not in actions.column_names or highs not in actions.column_names:
        return paths
    try:
        bounds = zip(paths, actions.column(lows).to_pylist(), actions.column(highs).to_pylist())
    except (OverflowError, ValueError):  # a date or time past Python's years 1 to 9999, which Spark holds
        return paths
    touched = []
    for path, low, high in bounds:
        found = _file_range(kind, low, high)
        if found is None or not (found[1] < batch[0] or found[0] > batch[1]):
            touched.append(path)
    return touched


def key_range(staged: Staged, key: str) -> tuple[Any, Any] | None:
    """The batch's smallest and largest key as values of the key's type,
    from what the writing tasks saw (None: unknown). Numbers come from the
    exact bounds (`StagedFile.bounds`: a DECIMAL's statistics go through a
    float); the rest from the files' statistics, which bound them (a time
    rounded out to the millisecond)."""
    kind = staged.schema.field(key).type
    lows, highs = [], []
    for f in staged.files:
        if pa.types.is_integer(kind) or pa.types.is_decimal(kind) or pa.types.is_floating(kind):
            pair = json.loads(f.bounds).get(key)
        else:
            stats = json.loads(f.stats)
            pair = [stats.get("minValues", {}).get(key), stats.get("maxValues", {}).get(key)]
        bounds = [_typed(kind, value) for value in pair] if pair else [None, None]
        if None in bounds:
            return None
        lows.append(bounds[0])
        highs.append(bounds[1])
    return (min(lows), max(highs)) if lows else None


def _typed(kind: pa.DataType, value: Any) -> Any:
    """A bound as the writing tasks give it (`spark_files`), as a value of
    the key's type; None where the type is one this check does not order."""
    if value is None:
        return None
    if pa.types.is_integer(kind):
        return int(value)
    if pa.types.is_decimal(kind):
        return Decimal(value)
    if pa.types.is_floating(kind):
        return float(value)
    if pa.types.is_timestamp(kind) and kind.tz is not None:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    if pa.types.is_date32(kind):
        return date.fromisoformat(value)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_boolean(kind):
        return value
    return None


def _file_range(kind: pa.DataType, low: Any, high: Any) -> tuple[Any, Any] | None:
    """A state file's key range as the log gives it (delta-rs's typed
    statistics), widened where they are not exact: a DECIMAL's bounds went
    through a float (about 16 digits, and rounded either way), so they are
    widened by a relative 2^-50 and a unit of the last place. Timestamps are
    to the millisecond in the log, truncated, which a batch's bounds
    (rounded out) still compare with rightly. None: no usable range."""
    if low is None or high is None:
        return None
    if pa.types.is_decimal(kind):
        with localcontext() as exact:
            exact.prec = 100
            unit = Decimal(1).scaleb(-kind.scale)
            low, high = Decimal(low), Decimal(high)
            return low - abs(low) * _DRIFT - unit, high + abs(high) * _DRIFT + unit
    if pa.types.is_timestamp(kind):
        if kind.tz is None or low.tzinfo is None:
            return None
        return low.astimezone(timezone.utc), high.astimezone(timezone.utc)
    if isinstance(low, datetime) or isinstance(high, datetime):
        return None
    return low, high


#: How far a DECIMAL bound read back from a float may be from its value, relative to it.
_DRIFT = Decimal(2) ** -50


def require_written(root: str, files: tuple[StagedFile, ...], untracked_hours: float, what: str) -> None:
    """Before a commit names `files` (in the folder `root`): each is there,
    and younger than half of `untracked_hours`, else a `ConcurrentRunError`
    (nothing is committed; the replay writes them again).

    `maintain` deletes the files no commit names once they are older than
    `untracked_hours` (`spark_jobs.core.untracked`), and commits a fenced
    marker before it does. A run whose snapshot predates the marker cannot
    commit (the fence); one that read its snapshot after it checks here,
    after the marker, that its files were younger than half the window: so
    they were younger than the whole window when `maintain` chose what to
    delete, and it spared them (docs/reliability.md, "Files are never
    deleted under a live plan"). Without the check, a batch held or
    frozen past the window commits files that are gone: rows the ledger
    says are committed, which no reader can read."""
    oldest = time.time() - untracked_hours * 3600 / 2
    for f in files:
        location = f"{root.rstrip('/')}/{f.path}"
        written = modified_at(location)
        if written is None or written < oldest:
            said = "is gone" if written is None else f"was written {(time.time() - written) / 3600:.2f} h ago"
            raise ConcurrentRunError(
                f"{what}: its file {location} {said}, and `microbatch maintain` removes files no commit names once "
                f"they are {untracked_hours:g} h old (maintenance.untracked_files_hours); nothing was committed, "
                "run again: the batch is written anew",
                path=root,
            )


def delete_files(root: str, files: tuple[StagedFile, ...]) -> None:
    """Delete files written but never to be committed (best effort: `maintain`
    removes what is left once older than its window)."""
    for f in files:
        location = f"{root.rstrip('/')}/{f.path}"
        try:
            delete(StoredFile(f.path, 0.0, location))
        except Exception as exc:  # noqa: BLE001 - clean-up only
            log.debug("could not delete %s (%s)", location, exc)


def commit_files(
    table: DeltaTable,
    added: tuple[StagedFile, ...],
    schema: pa.Schema,
    properties: CommitProperties,
    *,
    removed: list[str] | None = None,
    data_change: bool = True,
) -> None:
    """Commit `added` (files already in the table's folder) and the removal of
    `removed` (paths of `table`'s snapshot) as one version, from `table`'s
    snapshot, with `properties` (the fence, the metadata). Raises delta-rs's
    commit error when a conflicting commit landed first; with `removed`,
    when any commit landed since the snapshot. The handle does not move:
    find the version by its fence (`StateTable.find_commit`)."""
    now = int(time.time() * 1000)
    actions: list[Any] = [AddAction(f.path, f.size, {}, now, data_change, f.stats) for f in added]
    if removed:
        # On the snapshot it was made from, or not at all: delta-rs's check
        # lets a removal of files another commit removed meanwhile (an
        # OPTIMIZE, a fold, any tool's) land, and this commit's rewrites of
        # them would then stand beside that commit's copy: every key twice.
        properties = CommitProperties(
            custom_metadata=properties.custom_metadata, app_transactions=properties.app_transactions, max_commit_retries=0
        )
        # Each removal carries its file's size, as the protocol recommends:
        # delta-rs's change-feed reader (`load_cdf`) refuses a removal
        # without one, should a reader ever read such a version's files.
        sizes = _sizes(table)
        actions += [RemoveAction(path, data_change, now, sizes[path], {}) for path in removed]
    table.create_write_transaction(actions, mode="append", schema=schema, commit_properties=properties)
