"""Where a pipeline stands, and its history: read-only views of the tables.

Nothing here writes. `status` reports a pending repair (a state commit the
ledger has not recorded yet) or a mismatch instead of making or raising it,
so it can be run at any time, next to running batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc

from spark_jobs.core.delta_io import open_table, read_all, rows_of
from spark_jobs.core.fencing import ORIGIN, Position
from spark_jobs.core.ledger import LedgerRow, RowStatus, utcnow
from spark_jobs.core.maintain import oldest_rewindable
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.protocol import check_spec, lagging_commit
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.sql_text import pipeline_literal
from spark_jobs.errors import MicrobatchError
from spark_jobs.sources import Lag

__all__ = ["PipelineStatus", "Quarantined", "history", "lag", "quarantined", "recent", "status"]


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


def status(spec: PipelineSpec) -> PipelineStatus:
    """Where the pipeline stands. Read-only: a pending repair is reported, not made."""
    p = Pipeline(spec)
    view = p.ledger.load()
    head = view.head
    table = p.state.open()
    state_at = p.state.position(table)
    problems: list[str] = []
    try:
        if lagging_commit(p, view, table, state_at):
            problems.append(f"the state is at {state_at}; the next run will record it in the ledger")
    except MicrobatchError as exc:
        problems.append(str(exc))
    try:
        check_spec(p, view)
    except MicrobatchError as exc:
        problems.append(str(exc))
    pending = view.planned(view.position.next())
    if pending is not None:
        # An earlier run planned the next batch and did not commit it: the
        # next run replays exactly that range, if it still can.
        try:
            p.source.verify(p.batch(pending))
        except MicrobatchError as exc:
            problems.append(f"{pending.position} is planned but cannot be replayed: {exc}")
    lag: Lag | None
    try:
        lag = p.source.lag(p.lineage(view), dated=True)
        problems += lag.warnings
    except MicrobatchError as exc:
        lag = None
        problems.append(str(exc))
    note = "\n".join(problems) or None
    return PipelineStatus(
        pipeline=spec.name,
        head=head,
        end_offsets=head.end_offsets if head else p.source.origin.to_dict(),
        lag=lag,
        note=note,
        oldest_rewindable=oldest_rewindable(p, view, table),
    )


def lag(spec: PipelineSpec) -> Lag:
    """What waits in the source, and nothing else (what a sensor polls).
    Raises what reading the source raises: a broken source is not "nothing waiting"."""
    p = Pipeline(spec)
    return p.source.lag(p.lineage(p.ledger.load()))


def recent(spec: PipelineSpec, limit: int) -> list[LedgerRow]:
    """The newest `limit` ledger rows, oldest first, as `history` orders them.

    Read by position from the head back, so a console page costs what it
    shows, not what the ledger holds; only a history that a recent rewind
    cut short (fewer rows in the head's epoch than asked for) is read whole.
    """
    p = Pipeline(spec)
    view = p.ledger.load()
    head = view.head
    rows: list[LedgerRow] = []
    if head is not None:
        # The head's epoch, up to the batch after the head (a planned, uncommitted one).
        rows = p.ledger.between(view.table, head.epoch, max(head.batch_id - limit + 1, 0), head.batch_id + 1)
    if head is None or (len(rows) < limit and (head.epoch > 0 or head.batch_id >= limit)):
        rows = view.rows
    return _ordered(rows)[-limit:]


def history(spec: PipelineSpec) -> list[LedgerRow]:
    """All ledger rows, oldest first."""
    return _ordered(Pipeline(spec).ledger.load().rows)


def _ordered(rows: list[LedgerRow]) -> list[LedgerRow]:
    order = {RowStatus.PLANNED: 0, RowStatus.COMMITTED: 1, RowStatus.REWOUND: 2}
    return sorted(rows, key=lambda r: (r.planned_at or r.committed_at or utcnow(), r.epoch, r.batch_id, order[r.status]))


@dataclass(frozen=True)
class Quarantined:
    """Quarantined records of a pipeline (or of one batch), newest batches first."""

    rows: list[dict[str, Any]]
    #: Every matching record's reason, counted (not only the rows returned).
    by_reason: dict[str, int]
    total: int

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "by_reason": self.by_reason, "rows": self.rows}


def quarantined(spec: PipelineSpec, *, batch_id: int | None = None, epoch: int | None = None, limit: int = 100) -> Quarantined:
    """The quarantine's rows for `batch_id` (of `epoch`, or of the newest
    epoch that has any), or for every batch; at most `limit`, newest first."""
    table = open_table(spec.quarantine_path)
    if table is None:
        return Quarantined([], {}, 0)
    where = f"pipeline = {pipeline_literal(spec.name)}"
    if batch_id is not None:
        where += f" AND batch_id = {int(batch_id)}" + (f" AND epoch = {int(epoch)}" if epoch is not None else "")
    data = read_all(table, where=where)
    if batch_id is not None and epoch is None and data.num_rows:
        data = data.filter(pc.equal(data["epoch"], pc.max(data["epoch"])))
    counts = pc.value_counts(data["reason"])
    by_reason = dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))
    newest = data.sort_by([("epoch", "descending"), ("batch_id", "descending"), ("line", "ascending")]).slice(0, limit)
    rows = [{**r, "quarantined_at": r["quarantined_at"].isoformat() if r["quarantined_at"] else None} for r in rows_of(newest)]
    return Quarantined(rows, dict(sorted(by_reason.items(), key=lambda kv: -kv[1])), data.num_rows)
