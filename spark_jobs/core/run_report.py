"""What a run reports: its outcome, built in one place (`outcome_of`), the
time each protocol step took (`StepTimes`), and why a run had nothing to
do. Kept apart from spark_jobs/core/protocol.py, whose module reads as
the five steps of a batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from spark_jobs.core.fencing import ORIGIN, Position
from spark_jobs.core.folding import row_counts
from spark_jobs.core.ledger import LedgerRow, RowStatus
from spark_jobs.core.outcome import BatchOutcome

if TYPE_CHECKING:
    from spark_jobs.core.compute import Engine
    from spark_jobs.core.pipeline import Pipeline
    from spark_jobs.core.protocol import Committed, Done, Processed, RunOptions
    from spark_jobs.core.spec import PipelineSpec

log = logging.getLogger("microbatch")

class StepTimes:
    """Milliseconds per protocol step, for the outcome. The engine's start is
    counted apart from the step that needed it first. A step that raises is
    not timed: no `finally`, so nothing runs on the way out of a crash."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.ms: dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        begun, engine_before = time.monotonic(), self._engine.start_s
        yield
        engine_start = self._engine.start_s - engine_before
        self.ms[name] = int((time.monotonic() - begun - engine_start) * 1000)
        if engine_start:
            self.ms["engine_start"] = int(engine_start * 1000)


def moved_past(n: Position, current: Position) -> str:
    """Why a run of `n` is a no-op, given the position the pipeline moved to."""
    if current.epoch > n.epoch:
        return f"the pipeline was rewound (now at {current}) while this run prepared {n}; nothing to do"
    return f"another run already committed {n} (the pipeline is at {current}); nothing to do"


def nothing_new(options: RunOptions, head: LedgerRow | None) -> str:
    """Why a run found nothing: for an interval, whether a batch already read
    past its end (it is covered) or nothing arrived in it at all."""
    at = head.position if head is not None else ORIGIN
    end = options.interval_end
    if end is None:
        return f"no new data (pipeline at {at})"
    # What the head batch read: up to its interval's end if it had one, else
    # what had arrived when it was planned. A rewind read nothing.
    read_to = None
    if head is not None and head.status is RowStatus.COMMITTED:
        read_to = head.interval_end or head.planned_at
    if read_to is not None and read_to >= end:
        return (
            f"this interval is already covered: batch {head.batch_id} (epoch {head.epoch}) read what had arrived "
            f"by {read_to.isoformat()}, after the interval's end {end.isoformat()} (pipeline at {at})"
        )
    start = f"{options.interval_start.isoformat()} to " if options.interval_start else "before "
    return f"nothing new arrived in the interval {start}{end.isoformat()} (pipeline at {at})"


def outcome_of(
    spec: PipelineSpec,
    options: RunOptions,
    started: float,
    done: Done,
    processed: Processed | None = None,
    committed: Committed | None = None,
    *,
    steps: StepTimes | None = None,
) -> BatchOutcome:
    """The one place a run's outcome is built."""
    batch = done.batch
    return BatchOutcome(
        status=done.status,
        pipeline=spec.name,
        message=done.message,
        run_id=options.run_id,
        epoch=done.position.epoch,
        batch_id=done.position.batch_id,
        start_offsets=batch.start.to_dict() if batch else None,
        end_offsets=batch.end.to_dict() if batch else None,
        inputs=tuple(batch.manifest.inputs()) if batch else (),
        records_in=processed.records_in if processed else None,
        records_quarantined=processed.records_quarantined if processed else None,
        records_late=processed.records_late if processed else None,
        records_duplicate=processed.records_duplicate if processed else None,
        watermark=committed.watermark if committed else None,
        keys_updated=committed.keys_updated if committed else None,
        state_version=committed.state_version if committed else None,
        duration_ms=int((time.monotonic() - started) * 1000),
        steps_ms=dict(steps.ms) if steps else None,
    )


def note_fold_due(pipeline: Pipeline) -> None:
    """After step 5: an appended state whose partial rows passed
    `state.fold_at` is due a fold, which `maintain` makes (the maintenance
    DAG, a cron): never a batch, which would then take as long as a MERGE
    of the whole state. The newest commit says it (no data read)."""
    counts = row_counts(pipeline.state.open())
    if counts.fold_due(pipeline.spec.state.fold_at):
        log.info(
            "the state holds %d rows appended since its last fold (state.fold_at %g of %d): `microbatch maintain` "
            "folds them (airflow.maintenance_schedule runs it)", counts.appended, pipeline.spec.state.fold_at, counts.folded
        )
