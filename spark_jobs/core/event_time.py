"""Event time: the pipeline's watermark, and which records are late.

A spec with an `event_time` block names a TIMESTAMP or DATE column of the
source's records and a `delay`. The watermark is a point in event time that
says "records older than this are not expected any more":

1. Batch N's records are judged against the watermark the ledger's head
   (batch N-1, or the rewind before N) recorded: ``W_in``. A record whose
   event time is before ``W_in`` is *late*; `event_time.late` says whether it
   goes to the quarantine (reason ``late: ...``, naming its event time and
   the watermark; the default), is dropped and counted, or is accepted and
   counted. A record without an event time is quarantined: it cannot be
   placed in time. The first batch has no watermark: nothing is late.
2. After N, the watermark is ``max(W_in, newest accepted event time -
   delay)`` and, with `advance_with_schedule`, also at least the data
   interval's end minus the delay (a quiet source's watermark keeps time with
   the schedule). It never moves back.
3. It is recorded in N's state commit metadata and so in N's ledger row
   (`BatchRecord.watermark`), with the count of late records
   (`records_late`): in the batch's atomic commit. A replay of N judges
   against the same ``W_in`` (the head did not move) over the same planned
   range, and so computes the same watermark; a rewind to batch K records
   K's watermark in its own row, so the pipeline carries on from it.

Both values come from the planned row and the range, never from the clock,
which is what makes a replay, a retry or a backfill judge every record the
same way. (Structured Streaming keeps its watermark in the commit log for the
same reason, SPARK-24699.) The records are marked by the engine
(`spark_jobs.engine.event_marks`), before the transform sees them.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spark_jobs.core.ledger import LedgerRow
    from spark_jobs.core.spec import PipelineSpec
    from spark_jobs.sources import BatchRange

__all__ = ["iso", "judged_against", "watermark_after"]


def judged_against(spec: PipelineSpec, batch: BatchRange, head: LedgerRow | None) -> BatchRange:
    """`batch` with the watermark its records are judged against (``W_in``):
    the head's, or none before the first batch. Unchanged without event time."""
    if spec.event_time is None:
        return batch
    return replace(batch, watermark=head.watermark if head is not None else None)


def watermark_after(
    spec: PipelineSpec, watermark_in: datetime | None, newest: datetime | None, interval_end: datetime | None
) -> datetime | None:
    """The watermark after a batch whose newest accepted event time was
    `newest` (None: no record with one): step 2 of the module docstring."""
    if spec.event_time is None:
        return None
    delay = timedelta(seconds=spec.event_time.delay_seconds)
    candidates = [w for w in (watermark_in, newest - delay if newest is not None else None) if w is not None]
    if spec.event_time.advance_with_schedule and interval_end is not None:
        candidates.append(_utc(interval_end) - delay)
    return max(candidates) if candidates else None


def iso(moment: datetime) -> str:
    """A watermark as reasons and the console spell it: UTC, to the microsecond when it has any."""
    text = _utc(moment).strftime("%Y-%m-%dT%H:%M:%S.%f").removesuffix(".000000")
    return text + "Z"


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
