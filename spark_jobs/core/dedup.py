"""Duplicates dropped, exactly once (a spec's `dedup:` block).

A record's id is its `dedup.key` fields. Step 3 of the protocol
(`spark_jobs.core.protocol`) drops, before the transform sees them, the
valid records (parsed, not late) whose id

1. is *remembered*: taken by a batch of the pipeline's live lineage up to
   the ledger's head H, and, with `dedup.within`, with an event time no more
   than `within` behind H's watermark (the one the batch judges lateness by);
2. or comes twice in the batch: of the records sharing an id it keeps one,
   the earliest by event time, then by its fields in order, so that a
   replay keeps the same one.

The ids a batch takes are appended to the checkpoint's ``dedup`` table in
step 3, each with the batch's position and its event time, fenced per
batch like the quarantine (`spark_jobs.core.batch_append`): an attempt that dies after it
leaves the ids of N written, and the replay of N writes nothing. The replay
reads the ids of H's lineage only (never N's own), so it drops exactly what
the first attempt dropped. A rewind to K needs no write: the ids of the
batches after K leave the lineage with them, and the replay of K+1 sees
what K+1 saw (their rows stay, as the quarantine's do, until `maintain`).

The count of dropped records is the batch's `records_duplicate`, in its
commit like every count. What an id is remembered for, the JSON text of its
key fields (`ID`), is computed where the records are, on the executors
(`spark_jobs.engine.dedup_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import pyarrow as pa

from spark_jobs.core.batch_append import BatchAppend
from spark_jobs.core.delta_io import arrow, open_table, storage_errors
from spark_jobs.core.event_time import judged_against, less, stamp, utc
from spark_jobs.core.fencing import Position
from spark_jobs.core.ledger import POSITION_COLUMNS, LedgerRow, LedgerView
from spark_jobs.core.sql_text import pipeline_literal
from spark_jobs.core.staged import Staged

if TYPE_CHECKING:
    from spark_jobs.core.spec import PipelineSpec
    from spark_jobs.sources import BatchRange

__all__ = ["DEDUP_FENCE", "SCHEMA", "Remembered", "SeenIds", "judged", "remembered_at"]

#: The dedup table's fence: one append per batch.
DEDUP_FENCE = "microbatch.dedup"

SCHEMA = pa.schema(
    [
        *POSITION_COLUMNS,
        #: The key fields as JSON text (`{"click_id":"c-1"}`).
        ("id", pa.string()),
        #: The record's event time (none without `event_time`).
        ("event_time", pa.timestamp("us", tz="UTC")),
    ]
)

@dataclass(frozen=True)
class Remembered:
    """Which rows of the dedup table a batch drops the ids of: the
    pipeline's, of its live lineage at the head (`where`, over `epoch` and
    `batch_id`, integers only), and with an event time at or after `since`
    (None: every one)."""

    path: str
    pipeline: str
    where: str
    since: datetime | None

    def files(self) -> list[str]:
        """The table's data files now, relative to its folder (none: nothing
        remembered yet), less those whose every id is older than `since` by
        their statistics: each batch's ids are a file of their own, and
        without this every batch read every id the pipeline ever took
        (2.4 million after a day of 100,000 clicks an hour). Rows of a batch
        written after the head's are left out by `where`, so a listing taken
        later holds the same remembered ids."""
        table = open_table(self.path)
        if table is None:
            return []
        actions = arrow(table.get_add_actions(flatten=True))
        paths = actions.column("path").to_pylist()
        # A margin for statistics cut short (Parquet's bounds of a timestamp
        # may lose its microseconds); a file without them, or holding ids
        # with no event time (remembered for ever), is read.
        bound = less(utc(self.since), STATS_MARGIN) if self.since is not None else None
        if bound is None or "max.event_time" not in actions.column_names:
            return paths
        newest = actions.column("max.event_time").to_pylist()
        nulls = actions.column("null_count.event_time").to_pylist() if "null_count.event_time" in actions.column_names else [None] * len(paths)
        return [p for p, most, null in zip(paths, newest, nulls) if most is None or null is None or null > 0 or utc(most) >= bound]


#: How far a file's newest event time may be below `since` and still be read
#: (`Remembered.files`): more than any rounding of a statistic.
STATS_MARGIN = timedelta(seconds=1)


def judged(spec: PipelineSpec, batch: BatchRange, view: LedgerView) -> BatchRange:
    """`batch` as step 3 judges its records: against the watermark of
    `view`'s head (`event_time.judged_against`) and the ids it remembers."""
    batch = judged_against(spec, batch, view.head)
    remembered = remembered_at(spec, view)
    return replace(batch, remembered=remembered) if remembered is not None else batch


def remembered_at(spec: PipelineSpec, view: LedgerView) -> Remembered | None:
    """The ids a batch planned on `view`'s head drops (None without `dedup`)."""
    if spec.dedup is None:
        return None
    since = None
    head = view.head
    if spec.dedup.within_seconds is not None and head is not None and head.watermark is not None:
        since = less(head.watermark, timedelta(seconds=spec.dedup.within_seconds))
    return Remembered(spec.dedup_path, spec.name, view.live().where(), since)


class SeenIds(BatchAppend):
    """The dedup table of one pipeline (`spec.dedup_path`): the ids one batch
    took appended once (`BatchAppend.write`)."""

    what = "dedup"
    schema = SCHEMA

    def __init__(self, path: str, pipeline: str, untracked_hours: float) -> None:
        super().__init__(path, pipeline, untracked_hours, DEDUP_FENCE)

    def write(self, ids: pa.Table | Staged | None, position: Position) -> bool:
        """Append the ids batch `position` took, once (none: nothing to write).
        True if we wrote them. Committing the state without them would count
        their records again in the next batch: a failure here fails the run.

        `ids`: the `ID` and event time of each record the batch kept, or
        files the executors wrote into the table's folder in `SCHEMA`."""
        if ids is None or (isinstance(ids, Staged) and not ids.files) or (isinstance(ids, pa.Table) and not ids.num_rows):
            return False
        with storage_errors(f"pipeline {self.pipeline}: could not record the ids {position} took", self.path):
            return super().write(ids, position)

    def forget(self, view: LedgerView, oldest: LedgerRow | None, within_seconds: float | None) -> int:
        """`maintain`: delete the rows no batch that can still run or be
        replayed reads, and say how many went. Those of batches a rewind took
        out of the lineage (in an epoch before the head's: a batch in flight
        writes its ids at a position after the head, in its epoch), and,
        with `within`, those forgotten by the watermark of `oldest`, the
        oldest batch a rewind may go back to (every batch after it judges by
        a watermark no older)."""
        table = open_table(self.path)
        if table is None or view.head is None:
            return 0
        head = view.position
        gone = [f"(epoch < {int(head.epoch)} AND NOT {view.live().where()})"]
        since = None
        if within_seconds is not None and oldest is not None and oldest.watermark is not None:
            since = less(oldest.watermark, timedelta(seconds=within_seconds))
        if since is not None:
            # (A literal of the column's own type: a string would be cast to nanoseconds, which end in 2262.)
            gone.append(f"event_time < arrow_cast('{stamp(since.astimezone(UTC))}Z', 'Timestamp(Microsecond, Some(\"UTC\"))')")
        where = f"pipeline = {pipeline_literal(self.pipeline)} AND ({' OR '.join(gone)})"
        return int(table.delete(where).get("num_deleted_rows") or 0)

    def rows(self, data: pa.Table, position: Position) -> pa.Table:
        stamps = data.column("event_time").cast(pa.timestamp("us", tz="UTC"))
        return pa.table({**self.positioned(data.num_rows, position), "id": data.column("id").cast(pa.string()), "event_time": stamps}, schema=SCHEMA)
