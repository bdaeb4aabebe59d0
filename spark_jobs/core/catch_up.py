"""Batches back to back on one engine, reading the next ones ahead.

A process with a backlog (``microbatch run --catch-up``, a long-lived
runner) runs the protocol's five steps (`spark_jobs.core.protocol`) per
batch, in the same order, with the same fault points and SIGTERM stops as
`run_batch`. It overlaps one thing: while batch N commits (steps 4 and 5),
reader threads *read ahead* the ranges N+1 and N+2 will most likely get,
each the source's next range after the one before as if that were committed
(N+2's only on an engine that runs two reads at once).

The read-ahead is a prefetching wrapper around the engine, and the steps do
not know it is there: step 3 asks the engine for the planned range, and
gets the read made ahead only if it is of exactly that range (same offsets,
same manifest) and for the same place in the pipeline (the position and
the state's columns its rows were written for, when the executors write
them: `spark_jobs.core.staged`). Otherwise it is dropped, with every read
after it (their files deleted: no commit names them), and the planned range
is read, as in any run. A read commits nothing, so a crash, a racing run or
a file landing between the two plans costs the early reads, never a
record: the range recorded, read and committed is step 2's, as always.

With `event_time`, batch N+1's records are judged against the watermark N
leaves, known once N's read is done (its newest event time), and N+2's
against the one N+1 leaves, not known before N+1's read. So each read
ahead is judged against a guess (`event_time.guesses`: N+1's is exact, a
later one's moves on by the last batch's step), and step 3 takes it only if
it judged every record as the planned watermark does
(`event_time.judged_alike`: no record's event time between the two); else
that read alone is dropped and the range read again. A pipeline with
`dedup` reads nothing ahead: N+1 drops the ids N takes, which only N's
commit records.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from spark_jobs.core import shutdown
from spark_jobs.core.compute import Compute, ComputeResult, Engine
from spark_jobs.core.event_time import guesses, judged_alike, watermark_after
from spark_jobs.core.outcome import BatchOutcome, Outcome
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.fencing import Position
from spark_jobs.core.protocol import Plan, Processed, RunOptions, complete, prepare, sink_for
from spark_jobs.core.run_report import StepTimes
from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec
from spark_jobs.core.staged import Sink, delete_files
from spark_jobs.errors import first_line
from spark_jobs.sources import BatchRange
from spark_jobs.sources.base import Lineage

__all__ = ["READ_AHEAD", "ReadAhead", "catch_up"]

log = logging.getLogger("microbatch")

#: How many batches `catch_up` reads ahead at most, on an engine that runs
#: that many reads at once (`Compute.reads_at_once`). Two: on a small
#: machine one read leaves a core idle while its driver plans and its last
#: stage runs on one task, and the next read fills it; three ahead measured
#: no better (docs/benchmarks.md, "Reading ahead").
READ_AHEAD = 2


def catch_up(
    spec: PipelineSpec,
    options: RunOptions,
    compute_factory: Callable[[], Compute],
    *,
    max_batches: int | None = None,
    on_outcome: Callable[[BatchOutcome], None] | None = None,
) -> list[BatchOutcome]:
    """Run batches back to back on one engine until one does not commit
    (nothing new is left, or another run got there first) or `max_batches`
    have committed; each outcome goes to `on_outcome` as it is known.

    The ranges read ahead are planned on this thread after N's step 3 and
    before its commit; from then on this thread alone touches the
    pipeline's tables, and the readers only the source's data through the
    engine: they share nothing but the CPU. Steps 1 and 2 of N+1 wait for
    N's commit (they read what it wrote) and for N+1's read.
    """
    pipeline = Pipeline(spec)
    engine = _Prefetching(compute_factory)
    outcomes: list[BatchOutcome] = []

    def report(outcome: BatchOutcome) -> None:
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    try:
        while True:
            started = time.monotonic()
            steps = StepTimes(engine)
            # A stop asked for while N committed (SIGTERM) waits for no read
            # ahead: those begun finish, as any step does (`close`), and the
            # run stops at N+1's first boundary.
            engine.begin_batch(steps, started, use_ahead=not shutdown.requested())
            ready = prepare(pipeline, options, engine, steps, started)
            if isinstance(ready, BatchOutcome):
                report(ready)
                break
            plan, processed = ready
            room = None if max_batches is None else max_batches - len(outcomes) - 1
            if not shutdown.requested():
                engine.read_ahead(pipeline, plan, processed, options, room)
            outcome = complete(pipeline, plan, processed, options, started, steps, engine)
            report(outcome)
            if (room is not None and room <= 0) or outcome.status is not Outcome.COMMITTED:
                break
    finally:
        engine.close()
    return outcomes


@dataclass(frozen=True)
class ReadAhead:
    """The engine's read of a range before step 2 planned it."""

    batch: BatchRange
    result: ComputeResult
    #: Where its rows were written (None: they came back).
    sink: Sink | None
    #: When the read began (`time.monotonic()`), and how long it took.
    begun: float
    seconds: float


def _same_range(a: BatchRange, b: BatchRange) -> bool:
    """Same offsets, same manifest (for files: the same files, sizes and
    modification times)."""
    return (a.start.to_dict(), a.end.to_dict(), a.manifest.to_dict()) == (b.start.to_dict(), b.end.to_dict(), b.manifest.to_dict())


class _Prefetching(Engine):
    """The engine as a catch-up's steps see it: step 3's `process` of a
    range read ahead is that read. Reads ahead run on reader threads, as
    many at once as the engine runs (no more than `READ_AHEAD`), oldest
    (N+1's) first."""

    def __init__(self, factory: Callable[[], Compute]) -> None:
        super().__init__(factory, alongside=True)
        self._pending: deque[_Pending] = deque()
        self._readers: ThreadPoolExecutor | None = None
        #: This batch's read ahead (`begin_batch`): its range, and the read (None if it failed).
        self._taken: BatchRange | None = None
        self._ahead: ReadAhead | None = None
        self._steps: StepTimes | None = None
        self._started = 0.0

    def begin_batch(self, steps: StepTimes, started: float, *, use_ahead: bool) -> None:
        """A batch begins: the oldest read in flight is its candidate, once done."""
        self._steps, self._started = steps, started
        oldest = self._pending.popleft() if use_ahead and self._pending else None
        self._taken = oldest.batch if oldest else None
        self._ahead = oldest.read.result() if oldest else None

    def process(
        self, spec: PipelineSpec, batch: BatchRange, sink: Sink | None = None, check: Callable[[BatchRange], None] | None = None
    ) -> ComputeResult:
        """Step 3's read: the read ahead if it is of exactly `batch`, for the
        same `sink` (its `check` was made as that read ended). If step 2
        planned another range, the reads in flight (planned after the wrong
        one) are dropped and `batch` is read now, as by a read ahead that failed."""
        taken, early, self._taken, self._ahead = self._taken, self._ahead, None, None
        if taken is not None and not _same_range(taken, batch):
            log.info("the range read ahead is not the one planned (%s): reading the planned range", batch.describe())
            self._drop()
            _discard(early)
            early = None
        elif early is not None and not _same_sink(early.sink, sink):
            log.info("the range read ahead was written for another position or columns: reading it again")
            _discard(early)
            early = None
        elif early is not None and not judged_alike(spec, early.result, early.batch.watermark, batch.watermark):
            # The reads after it were judged against guesses of their own,
            # and each is checked as it is taken.
            log.info("the range read ahead was judged against another watermark than %s, which judges some of its records otherwise: reading it again", batch.watermark)
            _discard(early)
            early = None
        if early is None:
            return super().process(spec, batch, sink, check)
        assert self._steps is not None
        self._steps.ms["read_ahead"] = int(early.seconds * 1000)
        # How long before this batch began its read had begun (a benchmark's
        # window starts there: docs/benchmarks.md).
        self._steps.ms["read_ahead_lead"] = int((self._started - early.begun) * 1000)
        return early.result

    def read_ahead(self, pipeline: Pipeline, plan: Plan, processed: Processed, options: RunOptions, room: int | None) -> None:
        """Start reading the ranges after `plan`'s until as many reads as
        the engine runs at once (no more than `READ_AHEAD`, nor `room`
        batches) are in flight, each judged against the watermark it most
        likely gets (`processed` is `plan`'s read). Planning stops at the
        first range the source cannot give: nothing waits, or it cannot tell
        now (the batch's own step 2 then raises what there is to raise)."""
        spec = pipeline.spec
        if spec.dedup is not None:
            # Batch N+1 drops the ids N takes, which N's commit records.
            return
        at_once = min(READ_AHEAD, self.reads_at_once)
        if self._readers is None:
            # As many threads as reads at once: a dropped read still running
            # holds one, and the next waits for it rather than run beside it.
            self._readers = ThreadPoolExecutor(at_once, thread_name_prefix="microbatch-read")
        wanted = at_once if room is None else min(at_once, room)
        if len(self._pending) >= wanted:
            return
        try:
            after: Lineage = _Ahead(pipeline.lineage(plan.view), plan.batch)
            for pending in self._pending:
                after = _Ahead(after, pending.batch)
            watermark_in = plan.view.head.watermark if plan.view.head else None
            watermarks = guesses(watermark_in, watermark_after(spec, watermark_in, processed.newest_event_time, plan.row), READ_AHEAD)
            while len(self._pending) < wanted:
                batch = pipeline.source.plan(after, until=options.interval_end, caps=options.caps(spec))
                if batch is None:
                    return
                if spec.event_time is not None:
                    batch = replace(batch, watermark=watermarks[len(self._pending)])
                # In this thread's context: storage sessions and connection
                # settings are context variables.
                position = Position(plan.position.epoch, plan.position.batch_id + 1 + len(self._pending))
                sink = self._sink(pipeline, batch, position)
                read = self._readers.submit(contextvars.copy_context().run, self._read, spec, batch, sink, pipeline.source.check_read)
                self._pending.append(_Pending(batch, read))
                after = _Ahead(after, batch)
        except Exception as exc:  # noqa: BLE001 - an optimisation only: step 2 decides
            log.info("could not plan ahead (%s); the next batch plans and reads as any run does", first_line(exc))

    def _sink(self, pipeline: Pipeline, batch: BatchRange, position: Position) -> Sink | None:
        """Where a read ahead writes its rows, as step 3 would for `position`
        with the state's columns as they are (None: its rows come back)."""
        spec = pipeline.spec
        if not self.executors_write(spec, batch):
            return None
        columns = self.files().result_schema(spec, batch)
        table = pipeline.state.open()
        schema = pipeline.state.fitted(table, columns) if table is not None else pa.schema([*columns, pa.field(BATCH_COLUMN, pa.int64())])
        return sink_for(pipeline, position, schema)

    def _read(self, spec: PipelineSpec, batch: BatchRange, sink: Sink | None, check: Callable[[BatchRange], None]) -> ReadAhead | None:
        """The engine's read of `batch`, checked as it ends (`Source.check_read`),
        or None if it fails (the batch's own step 3 then reads it, and raises
        what there is to raise)."""
        begun = time.monotonic()
        try:
            return ReadAhead(batch, super().process(spec, batch, sink, check), sink, begun, time.monotonic() - begun)
        except Exception as exc:  # noqa: BLE001 - an optimisation only: the planned read decides
            log.info("reading ahead failed (%s); the next batch reads its planned range itself", first_line(exc))
            return None

    def _drop(self) -> None:
        """Forget the reads in flight: those not begun are cancelled, the
        others' results unused (the files of those done deleted)."""
        for pending in self._pending:
            if not pending.read.cancel() and pending.read.done():
                _discard(pending.read.result())
        self._pending.clear()

    def close(self) -> None:
        """Wait for the reads that have begun (a read is not interrupted midway),
        cancel the rest, then close the engine."""
        self._pending.clear()
        if self._readers is not None:
            self._readers.shutdown(wait=True, cancel_futures=True)
        super().close()


def _same_sink(a: Sink | None, b: Sink | None) -> bool:
    """Whether a read's rows went where step 3 would write them: the same
    folders, position and columns."""
    if a is None or b is None:
        return a is b
    return a == b


def _discard(early: ReadAhead | None) -> None:
    """Delete the files a read ahead wrote that no batch will commit."""
    if early is None:
        return
    for staged in (early.result.staged, early.result.staged_quarantine):
        if staged is not None:
            delete_files(staged.root, staged.files)


@dataclass(frozen=True)
class _Pending:
    """A read ahead in flight."""

    batch: BatchRange
    read: Future[ReadAhead | None]


class _Ahead:
    """The lineage as it will be once `batch` commits: what the read-ahead plans from."""

    def __init__(self, lineage: Lineage, batch: BatchRange) -> None:
        self._lineage = lineage
        self._batch = batch

    @property
    def end(self) -> dict[str, Any]:
        return self._batch.end.to_dict()

    def consumed(self, keys: Collection[str]) -> dict[str, set[str]]:
        wanted = set(keys)
        found = self._lineage.consumed(wanted)
        for key, version in self._batch.manifest.units():
            if key in wanted:
                found.setdefault(key, set()).add(version)
        return found
