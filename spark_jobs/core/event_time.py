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
   delay)`` and, with `advance_with_schedule`, also at least the planned
   data interval's end minus the delay when N took everything that waited
   (a batch capped by `batch.max_files` leaves records that arrived in time
   for later batches: those must not find the watermark moved past them).
   It never moves back: a batch made without `event_time` (the block taken
   out of the spec for a while) carries the watermark on unchanged.
3. It is recorded in N's state commit metadata and so in N's ledger row
   (`BatchRecord.watermark`), with the count of late records
   (`records_late`): in the batch's atomic commit. A replay of N judges
   against the same ``W_in`` (the head did not move) over the same planned
   range, under the `event_time` block N was planned with (a replay under
   another is refused: the first attempt may have quarantined by it), and
   so computes the same watermark; a rewind to batch K records K's
   watermark in its own row, so the pipeline carries on from it.

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

import pyarrow as pa

from spark_jobs.core.spec import BATCH_COLUMN
from spark_jobs.errors import ConcurrentRunError, SpecChangedError

if TYPE_CHECKING:
    from deltalake import DeltaTable

    from spark_jobs.core.compute import ComputeResult
    from spark_jobs.core.ledger import LedgerRow
    from spark_jobs.core.spec import PipelineSpec
    from spark_jobs.sources import BatchRange, Source

__all__ = [
    "check_replay",
    "guesses",
    "is_quiet",
    "iso",
    "judged_against",
    "judged_alike",
    "less",
    "stamp",
    "quiet_batch",
    "quiet_updates",
    "utc",
    "watermark_after",
]


def judged_against(spec: PipelineSpec, batch: BatchRange, head: LedgerRow | None) -> BatchRange:
    """`batch` with the watermark its records are judged against (``W_in``):
    the head's, or none before the first batch. Unchanged without event time."""
    if spec.event_time is None:
        return batch
    return replace(batch, watermark=head.watermark if head is not None else None)


def watermark_after(spec: PipelineSpec, watermark_in: datetime | None, newest: datetime | None, plan: LedgerRow) -> datetime | None:
    """The watermark after the batch `plan` planned, whose newest accepted
    event time was `newest` (None: no record with one), from the head's
    `watermark_in`: step 2 of the module docstring."""
    if spec.event_time is None:
        return watermark_in
    delay = timedelta(seconds=spec.event_time.delay_seconds)
    candidates = [watermark_in, less(newest, delay)]
    if spec.event_time.advance_with_schedule and plan.interval_end is not None and plan.waiting_after == 0:
        candidates.append(less(utc(plan.interval_end), delay))
    found = [w for w in candidates if w is not None]
    return max(found) if found else None


def guesses(watermark_in: datetime | None, watermark_out: datetime | None, count: int) -> list[datetime | None]:
    """The watermarks `count` batches after one that moved the watermark from
    `watermark_in` to `watermark_out` will most likely be judged against, for
    reads made ahead of their plans (`spark_jobs.core.catch_up`): the next
    one's is `watermark_out` itself; each later one's moves on by the same
    step, as a steady stream's does. A wrong guess costs its read, never a
    record: `judged_alike` decides whether the read stands."""
    if watermark_in is None or watermark_out is None or watermark_out <= watermark_in:
        return [watermark_out] * count
    step = watermark_out - watermark_in
    return [watermark_out + step * k for k in range(count)]


def judged_alike(spec: PipelineSpec, result: ComputeResult, read_against: datetime | None, planned: datetime | None) -> bool:
    """Whether a read that judged its records against `read_against` (a read
    made ahead, against a guess) judged each exactly as the `planned`
    watermark does, so that its rows, counts and newest event time are the
    planned read's. They are when no record's event time lies between the
    two watermarks: the newest late one is before `planned`, the oldest on
    time at or after it (no watermark at all judges nothing late). Under
    `late: quarantine` a late record's reason names the watermark it was
    judged against, so a read with any late record stands only for that one."""
    read_against, planned = (utc(w) if w is not None else None for w in (read_against, planned))
    if read_against == planned:
        return True
    if spec.event_time is None:
        return False
    if spec.event_time.late == "quarantine" and result.records_late:
        return False
    if planned is None:
        return result.newest_late is None
    return (result.newest_late is None or result.newest_late < planned) and (result.oldest_on_time is None or planned <= result.oldest_on_time)


def quiet_batch(spec: PipelineSpec, source: Source, head: LedgerRow | None, interval_end: datetime | None) -> BatchRange | None:
    """A run that finds nothing new, with `advance_with_schedule`: the batch
    that still moves the watermark to the data interval's end less the delay
    when that is past the head's, so that windows close on time while the
    source is quiet. It reads nothing (its range starts where it ends) and
    commits like any batch: planned, fenced, in the ledger, replayed as
    planned. None when there is nothing to move (or no state to commit to)."""
    event_time = spec.event_time
    if event_time is None or not event_time.advance_with_schedule or head is None or head.state_version is None or interval_end is None:
        return None
    moved = less(utc(interval_end), timedelta(seconds=event_time.delay_seconds))
    if moved is None or (head.watermark is not None and moved <= utc(head.watermark)):
        return None
    return replace(source.decode(head.end_offsets, head.end_offsets, {}), waiting_after=0)


def is_quiet(batch: BatchRange) -> bool:
    """Whether `batch` is a `quiet_batch`: nothing to read."""
    return batch.start.to_dict() == batch.end.to_dict()


def quiet_updates(spec: PipelineSpec, table: DeltaTable | None) -> pa.Table:
    """A quiet batch's updates: none, in the state's columns."""
    if table is None:
        raise ConcurrentRunError(
            f"pipeline {spec.name}: the state table {spec.state_path} disappeared while this run planned a quiet batch; nothing was committed",
            pipeline=spec.name,
            path=spec.state_path,
        )
    schema = pa.schema(table.schema().to_arrow())
    return schema.remove(schema.get_field_index(BATCH_COLUMN)).empty_table()


def check_replay(spec: PipelineSpec, planned: LedgerRow) -> None:
    """A replay of `planned` judges its records as its first attempt did,
    which may have written its quarantine: under the same `event_time`."""
    then = ((planned.spec or {}).get("fields") or {}).get("event_time")
    now = spec.event_time.model_dump() if spec.event_time is not None else None
    if (planned.spec or {}).get("format") and then != now:
        raise SpecChangedError(
            f"pipeline {spec.name}: {planned.position} was planned with event_time {then} and the spec now says "
            f"{now}. An earlier attempt at it may have quarantined its late records already, so it is replayed "
            "only as it was planned: put the event_time block back as it was until that batch commits, then "
            "change it (the next batch is judged by the new one).",
            pipeline=spec.name,
            path=spec.spec_path,
            position=planned.position,
        )


def less(moment: datetime | None, delay: timedelta) -> datetime | None:
    """`moment` less `delay`, or None when that is before year 1 (nothing is older)."""
    if moment is None:
        return None
    try:
        return moment - delay
    except OverflowError:
        return None


def iso(moment: datetime) -> str:
    """A watermark as reasons and the console spell it: UTC, to the microsecond when it has any."""
    return stamp(utc(moment)).removesuffix(".000000") + "Z"


def stamp(moment: datetime) -> str:
    """`moment`'s ISO text to the microsecond, its year in four digits
    (`strftime`'s ``%Y`` writes year 202 as ``202``, which no parser takes)."""
    m = moment
    return f"{m.year:04d}-{m.month:02d}-{m.day:02d}T{m.hour:02d}:{m.minute:02d}:{m.second:02d}.{m.microsecond:06d}"


def utc(moment: datetime) -> datetime:
    """`moment` in UTC (a naive one is taken as UTC, as Delta and Spark store them)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
