"""Where a pipeline stands, and its history: read-only views of the tables.

Nothing here writes. `status` reports a pending repair (a state commit the
ledger has not recorded yet) or a mismatch instead of making or raising it,
so it can be run at any time, next to running batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from spark_jobs.core.delta_io import count_rows, open_table, read_all, rows_of
from spark_jobs.core.fencing import ORIGIN, Position
from spark_jobs.core.ledger import LedgerRow, LedgerView, LiveLineage, RowStatus, utcnow
from spark_jobs.core.maintain import oldest_rewindable
from spark_jobs.core.deletion_vectors import has_deletion_vectors
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.agreement import check_spec, lagging_commit
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.windows import FinalSummary, final_summary
from spark_jobs.core.sql_text import pipeline_literal
from spark_jobs.errors import MicrobatchError, SourceError, StateLedgerMismatchError
from spark_jobs.sources import Lag

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = [
    "BatchView", "PipelineStatus", "Quarantined", "batches", "history", "lag", "lag_after", "quarantined", "recent",
    "recent_in_lineage", "status",
]


@dataclass(frozen=True)
class PipelineStatus:
    pipeline: str
    #: The ledger's head: the last committed batch or rewind (None before the first).
    head: LedgerRow | None
    #: Where the next batch starts.
    end_offsets: dict[str, Any]
    #: What waits in the source, in its own terms (None if the source could not be read).
    lag: Lag | None
    note: str | None
    #: The oldest batch a rewind can restore besides 0 (None: no state yet).
    oldest_rewindable: int | None = None
    #: Records the live lineage's batches quarantined (rewound batches' are not counted).
    quarantined: int = 0
    #: What the source said when it could not be read (a folder missing, a
    #: broker that does not answer): also in `note`. Before a first batch
    #: that is something to wait for, after one a problem.
    source_unavailable: str | None = None
    #: Event-time windows: what the table of final rows holds (None without one).
    final: FinalSummary | None = None
    #: The state's table declares deletion vectors (merged on read: `true`,
    #: or `auto` past its bound, now or before): its readers need Delta 2.3
    #: or later.
    merged_on_read: bool = False

    @property
    def position(self) -> Position:
        return self.head.position if self.head else ORIGIN

    def to_dict(self) -> dict[str, Any]:
        committed_at = self.head.committed_at if self.head else None
        return {
            "pipeline": self.pipeline,
            "epoch": self.position.epoch,
            "last_batch": self.position.batch_id,
            "end_offsets": self.end_offsets,
            "state_version": self.head.state_version if self.head else None,
            "committed_at": committed_at.isoformat() if committed_at else None,
            "lag": _lag_dict(self.lag) if self.lag else None,
            "note": self.note,
            "oldest_rewindable": self.oldest_rewindable,
            "quarantined": self.quarantined,
            # Event time: the watermark the next batch's records are judged against.
            "watermark": self.head.watermark.isoformat() if self.head and self.head.watermark else None,
            "final": self.final.to_dict() if self.final else None,
            "merged_on_read": self.merged_on_read,
        }


def _lag_dict(lag: Lag) -> dict[str, Any]:
    oldest = lag.oldest
    return {
        "count": lag.count,
        "unit": lag.unit,
        "future": lag.future,
        "parts": dict(lag.detail),
        "oldest_at": oldest.isoformat() if oldest else None,
        "oldest_age_s": round((utcnow() - oldest).total_seconds(), 3) if oldest else None,
    }


def _agreement(pipeline: Pipeline) -> tuple[LedgerView, DeltaTable | None, list[str]]:
    """The ledger and the state as a run's step 1 would find them, and what
    it would say of them. As step 1 does, a run that plans and commits
    between the two reads is no broken checkpoint: while the ledger moves,
    look again (`protocol.reconcile`)."""
    for _ in range(3):
        view = pipeline.ledger.load()
        table = pipeline.state.open()
        state_at = pipeline.state.position(table)
        try:
            if lagging_commit(pipeline, view, table, state_at):
                return view, table, [f"the state is at {state_at}; the next run will record it in the ledger"]
            return view, table, []
        except StateLedgerMismatchError as exc:
            if pipeline.ledger.load().version == view.version:
                return view, table, [str(exc)]
        except MicrobatchError as exc:
            return view, table, [str(exc)]
    return view, table, ["the tables kept moving while status looked (runs are committing); look again"]


def status(spec: PipelineSpec) -> PipelineStatus:
    """Where the pipeline stands. Read-only: a pending repair is reported, not made."""
    pipeline = Pipeline(spec)
    view, table, problems = _agreement(pipeline)
    head = view.head
    try:
        check_spec(pipeline, view)
    except MicrobatchError as exc:
        problems.append(str(exc))
    pending = view.planned(view.position.next())
    if pending is not None:
        # An earlier run planned the next batch and did not commit it: the
        # next run replays exactly that range, if it still can.
        try:
            pipeline.source.verify(pipeline.batch(pending))
        except MicrobatchError as exc:
            problems.append(f"{pending.position} is planned but cannot be replayed: {exc}")
    lag: Lag | None
    unavailable = None
    try:
        lag = pipeline.source.lag(pipeline.lineage(view), dated=True)
        problems += lag.warnings
    except SourceError as exc:
        lag, unavailable = None, str(exc)
        problems.append(unavailable)
    except MicrobatchError as exc:
        lag = None
        problems.append(str(exc))
    note = "\n".join(problems) or None
    return PipelineStatus(
        pipeline=spec.name,
        head=head,
        end_offsets=head.end_offsets if head else pipeline.source.origin.to_dict(),
        lag=lag,
        note=note,
        oldest_rewindable=oldest_rewindable(pipeline, view, table),
        quarantined=_quarantine_count(spec, view.live()),
        source_unavailable=unavailable,
        final=final_summary(spec),
        merged_on_read=table is not None and has_deletion_vectors(table),
    )


def _quarantine_count(spec: PipelineSpec, live: LiveLineage) -> int:
    table = open_table(spec.quarantine_path)
    if table is None:
        return 0
    return count_rows(table, where=f"pipeline = {pipeline_literal(spec.name)} AND {live.where()}")


def lag(spec: PipelineSpec) -> Lag:
    """What waits in the source, and nothing else (what a sensor polls).
    Raises what reading the source raises: a broken source is not "nothing waiting"."""
    pipeline = Pipeline(spec)
    return pipeline.source.lag(pipeline.lineage(pipeline.ledger.load()))


def lag_after(spec: PipelineSpec) -> tuple[Lag, Position]:
    """`lag`, and the ledger position it counts from (the last committed
    batch or rewind), from one read of the ledger: a watcher tells a commit
    or a rewind from a batch merely starting by it."""
    pipeline = Pipeline(spec)
    view = pipeline.ledger.load()
    return pipeline.source.lag(pipeline.lineage(view)), view.position


def recent(spec: PipelineSpec, limit: int) -> list[LedgerRow]:
    """The newest `limit` ledger rows, oldest first, as `history` orders them.

    Read by position from the head back, so a console page costs what it
    shows, not what the ledger holds; only a history that a recent rewind
    cut short (fewer rows in the head's epoch than asked for) is read whole.
    """
    pipeline = Pipeline(spec)
    return _recent(pipeline, pipeline.ledger.load(), limit)


def recent_in_lineage(spec: PipelineSpec, limit: int) -> tuple[list[LedgerRow], LiveLineage]:
    """`recent`, and which positions are live, from one read of the ledger."""
    pipeline = Pipeline(spec)
    view = pipeline.ledger.load()
    return _recent(pipeline, view, limit), view.live()


def _recent(pipeline: Pipeline, view: LedgerView, limit: int) -> list[LedgerRow]:
    head = view.head
    rows: list[LedgerRow] = []
    if head is not None:
        # The head's epoch, up to the batch after the head (a planned, uncommitted one).
        rows = pipeline.ledger.between(view.table, head.epoch, max(head.batch_id - limit + 1, 0), head.batch_id + 1)
    if head is None or (len(rows) < limit and (head.epoch > 0 or head.batch_id >= limit)):
        rows = view.rows
    return _ordered(rows)[-limit:]


#: At most this many input names per batch in `BatchView.to_dict` (the count is always there).
INPUTS_SHOWN = 100


@dataclass(frozen=True)
class BatchView:
    """One batch as a person reads it: the ledger row that tells what became
    of it (its commit, else its plan; a rewind is a row of its own), and where
    it stands in the state's lineage."""

    row: LedgerRow
    #: committed; rewind; pending (planned after the head and not committed:
    #: running now, or left by a crash, and the next run replays exactly it);
    #: abandoned (planned, and a rewind went back before it first).
    phase: str
    #: Part of the current state: a committed batch no rewind went back before.
    live: bool
    #: The epoch whose rewind took this batch out of the lineage, if one did.
    rewound_in_epoch: int | None
    #: What the batch read (file names, Kafka partition ranges, Delta versions).
    inputs: list[str]
    #: When its oldest input arrived, where the source knows (files: modification time).
    oldest_arrival: datetime | None

    def to_dict(self) -> dict[str, Any]:
        """The ledger row's fields, and the view's own."""
        committed = self.row.committed_at if self.row.status is RowStatus.COMMITTED else None
        latency = (committed - self.oldest_arrival).total_seconds() if committed and self.oldest_arrival else None
        return {
            **self.row.to_dict(),
            "phase": self.phase,
            "live": self.live,
            "rewound_in_epoch": self.rewound_in_epoch,
            "inputs": self.inputs[:INPUTS_SHOWN],
            "input_count": len(self.inputs),
            "oldest_arrival": self.oldest_arrival.isoformat() if self.oldest_arrival else None,
            "arrival_to_commit_s": round(latency, 3) if latency is not None else None,
        }


def batches(spec: PipelineSpec, limit: int) -> list[BatchView]:
    """The newest `limit` batches, oldest first, one entry each (a batch's
    `planned` and `committed` rows are one batch), each marked live or not."""
    pipeline = Pipeline(spec)
    view = pipeline.ledger.load()
    live = view.live()
    rows = _recent(pipeline, view, 2 * limit + 1)  # at most a plan and a commit per batch, and a rewind
    chosen: dict[tuple[int, int], LedgerRow] = {}
    for row in rows:
        key = (row.epoch, row.batch_id)
        if key not in chosen or row.status is not RowStatus.PLANNED:
            chosen[key] = row
    out: list[BatchView] = []
    for row in chosen.values():
        cut = live.cut_by(row.epoch, row.batch_id)
        if row.status is RowStatus.COMMITTED:
            phase = "committed"
        elif row.status is RowStatus.REWOUND:
            phase, cut = "rewind", None
        else:
            phase = "pending" if row.position == view.position.next() else "abandoned"
        try:
            inputs = pipeline.batch(row).manifest.inputs() if row.status is not RowStatus.REWOUND else []
        except MicrobatchError:
            inputs = []
        out.append(BatchView(row, phase, row.status is RowStatus.COMMITTED and live.holds(row.epoch, row.batch_id), cut, inputs, _oldest_arrival(row)))
    return out[-limit:]


def _oldest_arrival(row: LedgerRow) -> datetime | None:
    """The oldest input's arrival, for sources whose manifest dates inputs (files)."""
    stamps = [f.get("mtime_ms") for f in row.manifest.get("files", []) if isinstance(f, dict) and f.get("mtime_ms")]
    return datetime.fromtimestamp(min(stamps) / 1000, timezone.utc) if stamps else None


def history(spec: PipelineSpec) -> list[LedgerRow]:
    """All ledger rows, oldest first."""
    return _ordered(Pipeline(spec).ledger.load().rows)


def _ordered(rows: list[LedgerRow]) -> list[LedgerRow]:
    order = {RowStatus.PLANNED: 0, RowStatus.COMMITTED: 1, RowStatus.REWOUND: 2}
    return sorted(rows, key=lambda r: (r.planned_at or r.committed_at or utcnow(), r.epoch, r.batch_id, order[r.status]))


#: Late records' reasons each name their own event time: counted (and
#: filtered) together under `LATE_REASON`, one group however many there are.
LATE_PREFIX = "late: "
LATE_REASON = "late: event time before the watermark"


@dataclass(frozen=True)
class Quarantined:
    """Quarantined records of a pipeline (or of one batch), newest batches first."""

    rows: list[dict[str, Any]]
    #: Every matching record's reason, counted (not only the rows returned).
    by_reason: dict[str, int]
    total: int
    #: "live": the batches of the current state only; "all": rewound ones too.
    lineage: str = "live"

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "by_reason": self.by_reason, "rows": self.rows, "lineage": self.lineage}


def quarantined(
    spec: PipelineSpec,
    *,
    batch_id: int | None = None,
    epoch: int | None = None,
    reason: str | None = None,
    lineage: str = "live",
    limit: int | None = 100,
) -> Quarantined:
    """The quarantine's rows for `batch_id` (of `epoch`, or of the newest
    epoch that has any), or for every batch; at most `limit` (None: all),
    newest first, of `reason` if given.

    By default only the live lineage's records count: a rewound and
    replayed batch quarantines its bad records again, in its new epoch, and
    the old epoch's rows stay for audit (`lineage="all"` shows them; so does
    asking for one batch by `batch_id` and `epoch`).
    `by_reason` counts every reason whatever `reason` asks for, so a filter
    shows its share; late records count under `LATE_REASON`, which also
    filters them.
    """
    if lineage not in ("live", "all"):
        raise ValueError(f"lineage must be 'live' or 'all', not {lineage!r}")
    table = open_table(spec.quarantine_path)
    if table is None:
        return Quarantined([], {}, 0, lineage)
    where = f"pipeline = {pipeline_literal(spec.name)}"
    if lineage == "live" and (batch_id is None or epoch is None):
        # One batch named by its epoch is shown whatever became of it.
        where += f" AND {Pipeline(spec).ledger.load().live().where()}"
    if batch_id is not None:
        where += f" AND batch_id = {int(batch_id)}" + (f" AND epoch = {int(epoch)}" if epoch is not None else "")
    data = read_all(table, where=where)
    if batch_id is not None and epoch is None and data.num_rows:
        data = data.filter(pc.equal(data["epoch"], pc.max(data["epoch"])))
    grouped = pc.if_else(pc.starts_with(data["reason"], LATE_PREFIX), pa.scalar(LATE_REASON), data["reason"]) if data.num_rows else data["reason"]
    counts = pc.value_counts(grouped)
    by_reason = dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))
    if reason is not None:
        data = data.filter(pc.equal(grouped, reason))
    newest = data.sort_by([("epoch", "descending"), ("batch_id", "descending"), ("line", "ascending")])
    if limit is not None:
        newest = newest.slice(0, limit)
    rows = [{**r, "quarantined_at": r["quarantined_at"].isoformat() if r["quarantined_at"] else None} for r in rows_of(newest)]
    return Quarantined(rows, dict(sorted(by_reason.items(), key=lambda kv: -kv[1])), data.num_rows, lineage)
