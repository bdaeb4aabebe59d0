"""The offset ledger: an append-only Delta table, one row per event.

Statuses: ``planned`` (a batch's range, written ahead of processing it),
``committed`` (the state commit that made it durable, with metrics) and
``rewound`` (a new epoch starting from an earlier batch's offsets).

The ledger is the queryable history of the pipeline. It is *not* the commit
point: the state table's commit is (see `spark_jobs.core.protocol`); a missing
``committed`` row is repaired from the state commit's metadata.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, Field, write_deltalake

from spark_jobs.core.commits import RECORD_FIELDS, BatchRecord, CommitKind, StateCommit
from spark_jobs.core.delta_io import (
    COMPACTION_WRITER,
    SMALL_FILE_BYTES,
    ensure_table,
    in_range,
    int64s,
    is_commit_conflict,
    read_all,
    read_pruned,
    refreshed,
    rows_of,
    small_files,
)
from spark_jobs.core.fencing import COMMIT_FENCE, ORIGIN, PLAN_FENCE, Position, commit_properties, transaction_position
from spark_jobs.errors import ConcurrentRunError, NewerFormatError

__all__ = ["COMPACT_AT_FILES", "FORMAT_VERSION", "POSITION_COLUMNS", "LedgerRow", "LedgerView", "LiveLineage", "OffsetLedger", "RowStatus", "scoped", "utcnow"]

log = logging.getLogger("microbatch")

#: The row format this code writes, and the newest it reads (2 added
#: `pipeline_id`, `spec` and `spec_fingerprint`, 3 added `waiting_after`, 4
#: `watermark` and `records_late`, 5 `records_duplicate`; older tables gain
#: the columns on their next write, and their old rows read as None).
FORMAT_VERSION = 5
#: Columns added after format 1, added to older ledgers before a write.
_ADDED_COLUMNS = ("pipeline_id", "spec", "spec_fingerprint", "waiting_after", "watermark", "records_late", "records_duplicate")
#: Compact the ledger once it has this many data files (two per batch), so
#: that reading it, which every run does, stays fast after thousands of batches.
COMPACT_AT_FILES = 64



class RowStatus(StrEnum):
    PLANNED = "planned"  # a batch's range, written ahead of processing it
    COMMITTED = "committed"  # the state commit that made the batch durable
    REWOUND = "rewound"  # a new epoch starting from an earlier batch's offsets


#: The columns that place a row in a pipeline's history (the ledger's and the quarantine's).
POSITION_COLUMNS = [("pipeline", pa.string()), ("epoch", pa.int64()), ("batch_id", pa.int64())]

#: The Arrow type of a batch record's field, by the kind of value it holds
#: (JSON objects are stored as text).
_ARROW_TYPES = {str: pa.string(), int: pa.int64(), datetime: pa.timestamp("us", tz="UTC"), dict: pa.string()}
#: The ledger's columns: a row's position and status, the batch record
#: (`BatchRecord`, declared once), then what only the ledger keeps.
SCHEMA = pa.schema(
    [
        *POSITION_COLUMNS,
        ("status", pa.string()),
        *[(f.name, _ARROW_TYPES[f.kind]) for f in RECORD_FIELDS if f.name != "pipeline"],
        ("state_version", pa.int64()),
        ("keys_updated", pa.int64()),
        ("committed_at", pa.timestamp("us", tz="UTC")),
        ("format_version", pa.int64()),
    ]
)
#: Columns holding JSON objects.
_JSON_COLUMNS = tuple(f.name for f in RECORD_FIELDS if f.kind is dict)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class LiveLineage:
    """The positions whose committed batches make up the current state.

    Epoch e's part of the lineage is its batches after its rewind point K_e
    (0 for epoch 0), up to where the next epoch rewound to (the head, for
    the head's epoch); a rewind to before an earlier rewind point cuts older
    epochs at the lower of the two. So a committed (e, b) left the lineage
    exactly when a later epoch rewound to before b: what the console greys
    out, and what the quarantine counts leave out (docs/spec.md has the SQL).
    """

    #: Per epoch, the batch ids (after, upto] of it that are live.
    ranges: dict[int, tuple[int, int]]
    #: Per epoch after the first, the batch it rewound to.
    rewinds: dict[int, int]

    @classmethod
    def of(cls, head: Position, rewinds: dict[int, int]) -> LiveLineage:
        ranges: dict[int, tuple[int, int]] = {}
        limit = head.batch_id
        for epoch in range(head.epoch, -1, -1):
            floor = rewinds.get(epoch, 0)
            if floor < limit:
                ranges[epoch] = (floor, limit)
            limit = min(limit, floor)
        return cls(ranges, dict(rewinds))

    def holds(self, epoch: int, batch_id: int) -> bool:
        after, upto = self.ranges.get(epoch, (0, -1))
        return after < batch_id <= upto

    def cut_by(self, epoch: int, batch_id: int) -> int | None:
        """The epoch whose rewind took batch `batch_id` of `epoch` out of the
        lineage (the first that went back before it), None if none did."""
        return min((e for e, to in self.rewinds.items() if e > epoch and to < batch_id), default=None)

    def where(self) -> str:
        """The SQL predicate over `epoch`/`batch_id` columns that keeps live
        positions (integers only enter it)."""
        terms = [f"(epoch = {int(e)} AND batch_id > {int(a)} AND batch_id <= {int(u)})" for e, (a, u) in sorted(self.ranges.items())]
        return "(" + " OR ".join(terms) + ")" if terms else "FALSE"


@dataclass(frozen=True)
class LedgerRow(BatchRecord):
    """One ledger event. Offsets and manifest are JSON objects (dicts here)."""

    epoch: int
    batch_id: int
    status: RowStatus
    state_version: int | None = None
    keys_updated: int | None = None
    committed_at: datetime | None = None
    format_version: int = FORMAT_VERSION

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.batch_id)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (timestamps as ISO strings)."""
        out = asdict(self)
        out["status"] = str(self.status)
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat()
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any], *, path: str) -> LedgerRow:
        """A row from one table record (offsets and manifest as JSON text)."""
        version = record.get("format_version") or 1
        if version > FORMAT_VERSION:
            raise NewerFormatError(f"the offset ledger {path}", version, FORMAT_VERSION, pipeline=record.get("pipeline"), path=path)
        values = {k: record.get(k) for k in SCHEMA.names}
        for key in _JSON_COLUMNS:
            values[key] = json.loads(values[key]) if values[key] else None
        values.update(BatchRecord.decoded(values), status=RowStatus(values["status"]))
        return cls(**values)

    @classmethod
    def from_commit(cls, commit: StateCommit) -> LedgerRow:
        """The `committed` or `rewound` row a state commit stands for (reconcile's projection)."""
        m = commit.metadata
        rewind = m.kind is CommitKind.REWIND
        return cls(
            epoch=m.position.epoch,
            batch_id=m.position.batch_id,
            status=RowStatus.REWOUND if rewind else RowStatus.COMMITTED,
            state_version=commit.version,
            keys_updated=None if rewind else commit.keys_updated,
            committed_at=commit.timestamp,
            **m.record(),
        )


def _to_arrow(rows: list[LedgerRow]) -> pa.Table:
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for row in rows:
        for name in SCHEMA.names:
            value = getattr(row, name)
            if name in _JSON_COLUMNS:
                value = None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))
            elif name == "status":
                value = str(value)
            columns[name].append(value)
    return pa.table(columns, schema=SCHEMA)


def _upgrade(table: DeltaTable) -> list[str]:
    """Add the columns of newer formats to a ledger an older microbatch
    created; returns the table's column order, which appended rows follow.

    The added columns are null in old rows. The ALTER moves `table` to the
    new version, so the fence is then checked on the snapshot the append
    commits from, as always.
    """
    names = pa.schema(table.schema().to_arrow()).names
    missing = [c for c in _ADDED_COLUMNS if c not in names]
    if missing:
        try:
            types = {pa.string(): "string", pa.int64(): "long", pa.timestamp("us", tz="UTC"): "timestamp"}
            table.alter.add_columns([Field(c, types[SCHEMA.field(c).type], nullable=True) for c in missing])
        except Exception as exc:
            if not is_commit_conflict(exc):
                raise
            raise ConcurrentRunError(
                f"the offset ledger {table.table_uri} was being upgraded by another run; run again"
            ) from exc
        names = pa.schema(table.schema().to_arrow()).names
    return names


def scoped(app_id: str, pipeline: str) -> str:
    """A ledger or quarantine fence belongs to one pipeline: two pipelines
    sharing a checkpoint folder must not fence each other out."""
    return f"{app_id}/{pipeline}"


@dataclass
class LedgerView:
    """A snapshot of the ledger, with the derived facts the protocol needs.

    A run needs only the ledger's head and the plan after it, and
    `OffsetLedger.load` reads just those rows, by position, so the cost of a
    run does not grow with the ledger's length. Questions about the whole
    history (`rows`, `lineage`) read the snapshot in full, once, on demand:
    rewind, maintenance and `history` ask them, a run never does.
    """

    table: DeltaTable | None
    ledger: OffsetLedger
    head: LedgerRow | None
    _rows: list[LedgerRow] | None = None
    _planned: dict[Position, LedgerRow | None] = field(default_factory=dict)
    #: The ledger's Delta version this view was read at (-1: no ledger). Kept
    #: apart from `table`: views share the ledger's handle, which later loads move on.
    version: int = -1

    @classmethod
    def of_rows(cls, table: DeltaTable | None, ledger: OffsetLedger, rows: list[LedgerRow]) -> LedgerView:
        """A view whose rows are known (a full read, or a test's own)."""
        done = [r for r in rows if r.status in (RowStatus.COMMITTED, RowStatus.REWOUND)]
        return cls(table, ledger, max(done, key=lambda r: r.position) if done else None, list(rows), version=table.version() if table else -1)

    @property
    def pipeline(self) -> str:
        return self.ledger.pipeline

    @property
    def rows(self) -> list[LedgerRow]:
        """Every row of this pipeline in the snapshot (a full read)."""
        if self._rows is None:
            self._rows = self.ledger.read(self.table)
        return self._rows

    @property
    def position(self) -> Position:
        return self.head.position if self.head else ORIGIN

    def agrees(self, state_at: Position) -> bool:
        """Whether the state fence stands where the ledger's head says.

        Equal positions agree. So does a state never committed to (no table,
        or one created empty: fence at the origin) when the head is a rewind
        the ledger alone recorded (no state version: a rewind to 0 before the
        first commit), because an empty state is batch 0 of every epoch. Any
        other state at the origin is not the ledger's.
        """
        head = self.head
        return state_at == self.position or (
            state_at == ORIGIN and head is not None and head.status is RowStatus.REWOUND and head.state_version is None
        )

    @property
    def pipeline_id(self) -> str | None:
        """The id the pipeline's first plan minted (None: no rows yet, or all older than ids).

        Every row written after the first plan carries it, so the head has it,
        or else the plan after the head (the first batch, planned and not yet
        committed); rows without one are format-1 rows, older than any id.
        """
        if self.head is not None and self.head.pipeline_id:
            return self.head.pipeline_id
        following = self.planned(self.position.next())
        return following.pipeline_id if following is not None else None

    def planned(self, position: Position) -> LedgerRow | None:
        """The `planned` row of `position`, if there is one."""
        if self._rows is not None:
            return next((r for r in self._rows if r.status is RowStatus.PLANNED and r.position == position), None)
        if position not in self._planned:
            if self.table is not None and transaction_position(self.table, scoped(PLAN_FENCE, self.pipeline)) < position:
                return None  # the plan fence has not reached it: no such row (yet)
            found = self.ledger.at(self.table, position, (RowStatus.PLANNED,))
            self._planned[position] = found[0] if found else None
        return self._planned[position]

    def lineage(self) -> list[LedgerRow]:
        """The committed batches that make up the current state, in order (a full read)."""
        live = self.live()
        return sorted((r for r in self.rows if r.status is RowStatus.COMMITTED and live.holds(r.epoch, r.batch_id)), key=lambda r: r.batch_id)

    def live(self) -> LiveLineage:
        """Which (epoch, batch) positions the current state is made of, from
        the head and the rewinds alone (no full read unless one was made)."""
        if self._rows is not None:
            rows = self._rows
        else:  # epoch 0 has had no rewind: nothing to read
            rows = self.ledger.rewinds(self.table) if self.position.epoch > 0 else []
        return LiveLineage.of(self.position, {r.epoch: r.batch_id for r in rows if r.status is RowStatus.REWOUND})

    def committed_row(self, batch_id: int) -> LedgerRow | None:
        for row in self.lineage():
            if row.batch_id == batch_id:
                return row
        return None


class OffsetLedger:
    """Reads and appends ledger rows at ``<checkpoint>/offsets``."""

    def __init__(self, path: str, pipeline: str) -> None:
        self.path = path
        self.pipeline = pipeline
        self._table: DeltaTable | None = None
        #: Rows read or appended, by position and status: each fence lets one
        #: row per position and status in, so a found row never changes.
        self._known: dict[tuple[Position, RowStatus], LedgerRow] = {}

    def snapshot(self) -> DeltaTable | None:
        """The ledger at its latest version, None if it does not exist yet.

        One handle per `OffsetLedger`, brought up to date by reading only the
        commits since (milliseconds; opening it again reads the checkpoint).
        Views made earlier share the handle: every append checks its fence
        on the snapshot it commits from, which is the latest, so a view's
        older head can never let a stale row in.
        """
        self._table = refreshed(self._table, self.path)
        return self._table

    def load(self) -> LedgerView:
        """The ledger's snapshot, its head read by position.

        The commit fence's version *is* the head's position (every
        `committed` and `rewound` row advances it), so the head is found
        with one positional query, which Delta's file statistics narrow to
        the file holding it. A ledger whose fence says nothing (a new one,
        or one older than fences) is read in full.
        """
        table = self.snapshot()
        if table is None:
            return LedgerView(None, self, None, [])
        at = transaction_position(table, scoped(COMMIT_FENCE, self.pipeline))
        found = self.at(table, at, (RowStatus.COMMITTED, RowStatus.REWOUND)) if at != ORIGIN else []
        if not found:
            return LedgerView.of_rows(table, self, self.read(table))
        return LedgerView(table, self, found[0], version=table.version())

    def read(self, table: DeltaTable | None) -> list[LedgerRow]:
        """Every row of this pipeline in `table`'s snapshot."""
        if table is None:
            return []
        return self._rows(read_all(table))

    def at(self, table: DeltaTable | None, position: Position, statuses: tuple[RowStatus, ...]) -> list[LedgerRow]:
        """The rows of `position` with one of `statuses` (Delta skips the files that cannot hold them)."""
        known = [self._known[(position, s)] for s in statuses if (position, s) in self._known]
        if known:
            return known
        found = [r for r in self.between(table, position.epoch, position.batch_id, position.batch_id) if r.status in statuses]
        self._known.update(((r.position, r.status), r) for r in found)
        return found

    def committed_between(self, table: DeltaTable | None, epoch: int, after: int, upto: int) -> list[LedgerRow]:
        """The `committed` rows of `epoch` with `after` < batch id <= `upto`, in order."""
        rows = [r for r in self.between(table, epoch, after + 1, upto) if r.status is RowStatus.COMMITTED]
        return sorted(rows, key=lambda r: r.batch_id)

    def rewinds(self, table: DeltaTable | None) -> list[LedgerRow]:
        """The `rewound` rows: one per epoch after the first."""
        if table is None:
            return []
        return self._rows(read_all(table, where="status = 'rewound'"))

    def between(self, table: DeltaTable | None, epoch: int, first: int, last: int) -> list[LedgerRow]:
        """This pipeline's rows of `epoch` with `first` <= batch id <= `last`
        (Delta and Parquet statistics skip the files and row groups that cannot hold them)."""
        if table is None:
            return []
        e, lo, hi = int(epoch), int(first), int(last)
        bounds = int64s([e, lo, hi])
        records = read_pruned(
            table,
            lambda stats: in_range(stats, "epoch", e, e) and in_range(stats, "batch_id", lo, hi),
            lambda t: pc.and_(
                pc.equal(t["epoch"], bounds[0]), pc.and_(pc.greater_equal(t["batch_id"], bounds[1]), pc.less_equal(t["batch_id"], bounds[2]))
            ),
            # Only integers enter the query text; the pipeline and status are
            # filtered here, so no name ever becomes SQL.
            where=f"epoch = {e} AND batch_id >= {lo} AND batch_id <= {hi}",
        )
        return self._rows(records)

    def _rows(self, records: pa.Table) -> list[LedgerRow]:
        return [LedgerRow.from_record(r, path=self.path) for r in rows_of(records) if r["pipeline"] == self.pipeline]

    def append(self, view: LedgerView, row: LedgerRow, app_id: str) -> bool:
        """Append `row`, fenced by `app_id` at the row's position.

        Returns False without writing if the fence in `view`'s snapshot is
        already at or past the row's position (someone appended it), or if a
        concurrent append with the same fence won the race. True if ours
        landed.
        """
        table = view.table
        if table is None:
            # First event of a new pipeline: create the (empty) table, then
            # check the fence on the snapshot we will commit from.
            table = self._table = ensure_table(self.path, SCHEMA, name=f"{self.pipeline} offset ledger")
        columns = _upgrade(table)
        fence = scoped(app_id, self.pipeline)
        if transaction_position(table, fence) >= row.position:
            return False
        props = commit_properties(fence, row.position, {"microbatch.event": str(row.status)})
        try:
            write_deltalake(table, _to_arrow([row]).select(columns), mode="append", commit_properties=props)
        except Exception as exc:
            if is_commit_conflict(exc):
                return False
            raise
        self._known[(row.position, row.status)] = row
        return True

    def compact(self) -> bool:
        """Merge the ledger's small files into one when there are many.

        Best effort: compaction carries no fence and conflicts with nothing
        the protocol relies on; if it loses a race it is simply tried again
        after a later batch. Returns True if it compacted.
        """
        try:
            table = self.snapshot()
            if table is None or small_files(table) < COMPACT_AT_FILES:
                return False
            table.optimize.compact(target_size=SMALL_FILE_BYTES, writer_properties=COMPACTION_WRITER)
        except Exception as exc:  # noqa: BLE001 - it runs after the batch committed: never fail the run
            log.warning("offset ledger not compacted this time (%s); a later run tries again", exc)
            return False
        return True
