"""Where a pipeline stands, and its history: read-only views of the tables.

Nothing here writes. `status` reports a pending repair (a state commit the
ledger has not recorded yet) or a mismatch instead of making or raising it,
so it can be run at any time, next to running batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spark_jobs.core.fencing import ORIGIN, Position
from spark_jobs.core.ledger import LedgerRow, RowStatus, utcnow
from spark_jobs.core.maintain import oldest_rewindable
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.protocol import check_spec, lagging_commit
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.errors import MicrobatchError
from spark_jobs.sources import Lag

__all__ = ["PipelineStatus", "history", "lag", "status"]


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
            "lag": {"count": self.lag.count, "unit": self.lag.unit, "future": self.lag.future, "parts": dict(self.lag.detail)}
            if self.lag
            else None,
            "note": self.note,
            "oldest_rewindable": self.oldest_rewindable,
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
        lag = p.source.lag(p.lineage(view))
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


def history(spec: PipelineSpec) -> list[LedgerRow]:
    """All ledger rows, oldest first."""
    rows = Pipeline(spec).ledger.load().rows
    order = {RowStatus.PLANNED: 0, RowStatus.COMMITTED: 1, RowStatus.REWOUND: 2}
    return sorted(rows, key=lambda r: (r.planned_at or r.committed_at or utcnow(), r.epoch, r.batch_id, order[r.status]))
