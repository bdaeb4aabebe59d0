"""The commit protocol: one exactly-once micro-batch, told top to bottom.

Delta commits are atomic per table and there is no multi-table transaction,
so one table's commit must be *the* commit point. It is the state table's:
its commit carries the batch's position on the state fence (see
`spark_jobs.core.fencing`) and, in its commit metadata, everything the ledger row
needs (offsets, manifest, metrics). The ledger's ``committed`` row is a
projection of that commit, repaired by the next run if a crash falls between
the two. A run of batch N (position ``(epoch, N)``):

1. **Reconcile.** Read the ledger's head H and the state fence S. (The
   ledger's commit fence holds H's position, so H is read by position: no
   run reads the whole ledger, and a run costs the same at batch 10 and at
   batch 100,000.) If S == H the tables agree (unless the state's history
   shows a change made outside the job since H's commit: stop). If S is one
   event ahead, a run committed the state and died before its ledger row:
   append that row from the state commit's metadata, fenced on the ledger's
   commit fence (so a racing run does not append it twice). If S is further
   ahead or behind, the tables do not belong together (a lost checkpoint, a
   replaced state): stop. Then windows settle at H (`core.windows`).

2. **Plan** N = H.batch_id + 1. First, the spec must still mean what it
   meant for H (`spark_jobs.core.identity`): an incompatible change stops
   the run here. If a ``planned`` row for N exists (an earlier attempt died),
   reuse its range: a replay reads exactly the same records.
   Otherwise ask the source for the records after H's lineage, bounded by ``until``
   (the end of the data interval) and the caps. Nothing new: return without
   starting Spark. Else check the transform against the source schema (before
   any write, so a bad spec writes nothing) and append the ``planned`` row on
   the ledger's plan fence. If another run planned N first, use its plan.

3. **Read and quarantine.** Compute reads exactly the planned range, splits
   off bad records and runs the transform. The source then confirms the read
   got what was planned (`Source.check_read`: a file renamed over a planned
   one meanwhile was read in its place, so the batch stops). The result must fit the state
   table's types (the first batch creates the table, empty) before anything
   of N is written; a new merge column is added to the state and a wider
   result type widens the state's column (values kept), only while the
   state fence still reads H. Bad records are appended to the quarantine
   table on its own fence, so a replay of N does not add them twice; so are
   the ids N took, with `dedup` (`spark_jobs.core.dedup`: records whose id
   H's lineage took were dropped before the transform).

4. **Commit the state** (the commit point). On a fresh snapshot, the state
   fence must still read H: if it reads N or beyond, another run committed
   this batch (or rewound the pipeline) and this run is a no-op. Otherwise
   MERGE the updates, carrying fence position N and the batch's metadata. If
   the commit fails because a commit that moved the state fence landed after
   our snapshot, the winner did the work: no-op, never a retry of N. (The
   "winner" can be this very commit, reported as failed by the store after it
   landed; its ``commit_token`` says so, and the run carries on to step 5.)
   A commit that moved no fence (a compaction, `maintain`'s marker before it
   removes files no commit names) fails ours too, whenever it removed what
   ours relies on: step 4 then starts again from a fresh snapshot, at most
   three times (docs/reliability.md says which check guards each writer).

5. **Project into the ledger.** Step 1 again: the ``committed`` row is built
   from the state commit we just made (and windows settle at it). The
   consumed index, a cache of the ledger that answers "was this file
   consumed?" without reading every manifest (`spark_jobs.core.lineage`),
   follows it. Then the source may release what the committed batches
   consumed (`source.after_commit`: delete or archive).

Every crash point is covered: before 4 nothing visible happened but a plan
(reused on replay), at most one quarantine append (fenced), and a change of
the state's columns that keeps every value; after 4 the
batch is durable and the next run's step 1 completes it. The boundaries
between the steps are named fault points (`spark_jobs.core.faults`) for crash
tests, and where a SIGTERM stops the run (`spark_jobs.core.shutdown`) up to step
4; from the state commit on the run finishes (step 5 is milliseconds away)
and reports its batch committed.

Each step is one function below, in this order: `reconcile`, `plan`,
`read_and_quarantine`, `commit_state`, `project`; `run_batch` runs them.
What steps 1 and 2 judge (do the tables agree, was the state changed outside
the job, does the spec still mean the same) is `spark_jobs.core.agreement`,
which `status` reads too.

A rewind (`spark_jobs.core.rewind`) is the one other writer of the state;
status and history (`spark_jobs.core.inspect`) only read.

An appended state (`state.layout: appended`) takes step 4 as an append of
the batch's rows instead of a MERGE, same fence, same metadata. Its fold
(`spark_jobs.core.folding`) is a commit that changes no value and keeps the
fence, made by `maintain`, never by a batch: it is no step of the protocol,
and a fold lost or crashed changes nothing.

Where the rows go: on an engine whose executors write files (Spark), step 3
has them write the batch's updates and bad records as data files
(`spark_jobs.core.staged`), and steps 3 and 4 commit those files, with the
same fences and metadata; no row passes through this process. (A state
with a change feed, or merged on read, has the executors' join write its
change files too, in a log entry the job writes: `spark_jobs.core.own_commits`.)
The commits, and so every crash point, are the same; which path a batch
takes is `spark_jobs.core.write_path`'s.

A process that runs batches back to back (`spark_jobs.core.catch_up`) runs
these same steps per batch, through an engine that reads the next ranges
ahead while a batch commits; step 3 gets a read made ahead only if it is of
exactly the planned range.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, cast

import pyarrow as pa

from spark_jobs.core import shutdown
from spark_jobs.core.agreement import check_spec, check_unchanged, lagging_commit
from spark_jobs.core.commits import CommitKind, CommitMetadata
from spark_jobs.core.compute import Compute, Engine
from spark_jobs.core.delta_io import is_commit_conflict, storage_errors
from spark_jobs.core.dedup import judged
from spark_jobs.core.event_time import check_replay, is_quiet, quiet_batch, quiet_updates, watermark_after
from spark_jobs.core.faults import fault_point, watch_for_new_files
from spark_jobs.core.folding import is_appended
from spark_jobs.core.fencing import COMMIT_FENCE, ORIGIN, PLAN_FENCE, Position
from spark_jobs.core.identity import SpecIdentity, new_pipeline_id
from spark_jobs.core.ledger import LedgerRow, LedgerView, RowStatus, utcnow
from spark_jobs.core.outcome import BatchOutcome, Outcome
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.run_report import StepTimes, moved_past, note_fold_due, nothing_new, outcome_of
from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec
from spark_jobs.core.staged import Sink, Staged
from spark_jobs.core.windows import check_windows, settle
from spark_jobs.core.write_path import merged_by_join
from spark_jobs.errors import ConcurrentRunError, StateBehindLedgerError, StateLedgerMismatchError
from spark_jobs.sources import BatchRange, Caps

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["Plan", "Processed", "RunOptions", "StepTimes", "complete", "prepare", "reconcile", "run_batch", "sink_for"]

log = logging.getLogger("microbatch")

#: How often step 1 reads the tables again when a run recorded a row while
#: it looked: each try sees a newer ledger, so only runs landing again and
#: again exhaust it (then the run fails retryably).
RECONCILE_TRIES = 3

#: How often step 4 commits from a fresh snapshot after a commit that moved
#: no fence landed first (`maintain`'s compaction, its marker, a tool's
#: OPTIMIZE): then the run fails retryably.
STATE_COMMIT_TRIES = 3


@dataclass(frozen=True)
class RunOptions:
    """What the orchestrator (CLI or Airflow) passes to one run."""

    #: Who runs this batch: recorded in the ledger (an Airflow run id, or the CLI's own).
    run_id: str
    attempt: int = 1
    #: Data interval of the run. `interval_end` bounds the batch: only source
    #: data that had arrived before it is read.
    interval_start: datetime | None = None
    interval_end: datetime | None = None
    #: Override the spec's caps for this run.
    max_files: int | None = None
    max_records: int | None = None
    dry_run: bool = False

    def caps(self, spec: PipelineSpec) -> Caps:
        """A batch's caps: this run's overrides, else the spec's `batch:` block."""
        return Caps(self.max_files or spec.batch.max_files, self.max_records or spec.batch.max_records)


@dataclass(frozen=True)
class Plan:
    """Step 2's result: batch N's range, recorded in the ledger."""

    position: Position  # N
    head: Position  # H, where the ledger stood
    batch: BatchRange
    row: LedgerRow  # the `planned` row (ours, or an earlier attempt's)
    view: LedgerView  # the ledger as step 2 last read it
    identity: SpecIdentity  # the spec this run computes the batch under


@dataclass(frozen=True)
class Processed:
    """Step 3's result: the batch's state updates, fitted to the state table
    (in memory, or files the executors wrote: `spark_jobs.core.staged`)."""

    updates: pa.Table | Staged
    records_in: int
    records_quarantined: int
    #: Its late records and newest accepted event time (`event_time`), and its duplicates (`dedup`).
    records_late: int | None = None
    newest_event_time: datetime | None = None
    records_duplicate: int | None = None


@dataclass(frozen=True)
class Committed:
    """Step 4's result: the state commit that made the batch durable."""

    state_version: int
    keys_updated: int
    #: Event time: the watermark the commit recorded (None without `event_time`).
    watermark: datetime | None = None


@dataclass(frozen=True)
class Done:
    """A step found the run has nothing (more) to do: how it ends, and why."""

    status: Outcome
    message: str
    position: Position
    batch: BatchRange | None = None


def run_batch(spec: PipelineSpec, options: RunOptions, compute_factory: Callable[[], Compute]) -> BatchOutcome:
    """Run one micro-batch of `spec`: steps 1-5 of the module docstring.

    `compute_factory` is called only when a batch has work, so a run with
    nothing new never starts an engine.
    """
    started = time.monotonic()
    pipeline = Pipeline(spec)
    engine = Engine(compute_factory)
    steps = StepTimes(engine)
    try:
        ready = prepare(pipeline, options, engine, steps, started)
        if isinstance(ready, BatchOutcome):
            return ready
        return complete(pipeline, *ready, options, started, steps, engine)
    finally:
        engine.close()


def prepare(pipeline: Pipeline, options: RunOptions, engine: Engine, steps: StepTimes, started: float) -> tuple[Plan, Processed] | BatchOutcome:
    """Steps 1-3 of a batch: its plan and its fitted updates, or the outcome
    of a run that ends before its commit."""
    spec = pipeline.spec
    with steps("reconcile"):
        view = reconcile(pipeline)
        settle(pipeline, view)
    _boundary("after_reconcile", spec)
    with steps("plan"):
        plan = plan_batch(pipeline, view, options, engine)
    if isinstance(plan, Done):
        return outcome_of(spec, options, started, plan, steps=steps)
    _boundary("after_plan", spec)
    with steps("read"):
        processed = read_and_quarantine(pipeline, plan, engine)
    if isinstance(processed, Done):
        return outcome_of(spec, options, started, processed, steps=steps)
    return plan, processed


def complete(
    pipeline: Pipeline, plan: Plan, processed: Processed, options: RunOptions, started: float, steps: StepTimes, engine: Engine
) -> BatchOutcome:
    """Steps 4 and 5 of a batch whose step 3 is done."""
    spec = pipeline.spec
    with steps("commit"):
        committed = commit_state(pipeline, plan, processed, options, started, engine)
    if isinstance(committed, Done):
        return outcome_of(spec, options, started, committed, steps=steps)
    log.debug("committed %s: state version %d, %d keys updated", plan.position, committed.state_version, committed.keys_updated)
    with steps("project"):
        project(pipeline)
    if is_appended(spec):
        note_fold_due(pipeline)
    done = Done(Outcome.COMMITTED, f"committed {plan.position}: {plan.batch.describe()}", plan.position, plan.batch)
    return outcome_of(spec, options, started, done, processed, committed, steps=steps)


# -- 1. Reconcile ----------------------------------------------------------------------


def reconcile(pipeline: Pipeline, *, own_commit: bool = False) -> LedgerView:
    """Step 1 (and 5): make the ledger's head agree with the state fence.

    `own_commit`: step 5, recording the commit this run just made, which its
    outcome reports; a row recorded at any other time completes what an
    earlier run left, and is logged."""
    for _ in range(RECONCILE_TRIES):
        view = pipeline.ledger.load()
        table = pipeline.state.open()
        state_at = pipeline.state.position(table)
        try:
            commit = lagging_commit(pipeline, view, table, state_at)
        except StateLedgerMismatchError:
            # A run that planned and committed between our ledger read and
            # our state open looks like a state that is not this ledger's
            # (its plan is not in the view). If the ledger moved at all (a
            # plan counts, not only a commit), our view was stale: look again.
            if pipeline.ledger.load().version != view.version:
                continue
            raise
        if commit is None:
            return view
        row = LedgerRow.from_commit(commit)
        with storage_errors(
            f"pipeline {pipeline.spec.name}: could not record {row.status} {state_at} in the offset ledger",
            pipeline.ledger.path,
            note=(
                f"{state_at} itself is durable in the state table (the commit point); the next run "
                "records this ledger row from it. It is safe to re-run once the storage is healthy "
                "again (space freed, disk fixed)."
            ),
        ):
            appended = pipeline.ledger.append(view, row, COMMIT_FENCE)
        if appended:
            log.log(logging.DEBUG if own_commit else logging.INFO, "ledger: recorded %s %s from state version %d", row.status, state_at, commit.version)
    view = pipeline.ledger.load()
    if not view.agrees(pipeline.state.position(pipeline.state.open())):
        raise ConcurrentRunError(
            f"pipeline {pipeline.spec.name}: the tables kept moving while reconciling; run again", pipeline=pipeline.spec.name
        )
    return view


# -- 2. Plan ---------------------------------------------------------------------------


def plan_batch(pipeline: Pipeline, view: LedgerView, options: RunOptions, engine: Engine) -> Plan | Done:
    """Step 2: batch N's range, reused from an earlier attempt or planned and recorded now."""
    spec, head = pipeline.spec, view.position
    n = head.next()
    row = view.planned(n)
    if row is not None:
        check_replay(spec, row)  # (before `check_spec` logs the change as going on)
    identity = check_spec(pipeline, view)
    if row is not None:
        batch = pipeline.batch(row)
        pipeline.source.verify(batch)
        log.info("replaying the planned range of %s", n)
    else:
        planned = pipeline.source.plan(pipeline.lineage(view), until=options.interval_end, caps=options.caps(spec))
        planned = planned or quiet_batch(spec, pipeline.source, view.head, options.interval_end)
        if planned is None:
            return Done(Outcome.NO_NEW_DATA, nothing_new(options, view.head), head)
        batch = planned
    batch = judged(spec, batch, view)
    if options.dry_run:
        return Done(Outcome.DRY_RUN, f"would process {batch.describe()} as {n}; nothing committed", n, batch)
    if row is None:
        engine.check(spec, batch)  # a transform that cannot fit the state fails before any write
        recorded = _record_plan(pipeline, view, n, batch, identity, options)
        if isinstance(recorded, Done):
            return recorded
        view, row, batch = recorded
        batch = judged(spec, batch, view)
    log.info("planned %s: %s", n, batch.describe())
    return Plan(n, head, batch, row, view, identity)


def _record_plan(
    pipeline: Pipeline, view: LedgerView, n: Position, batch: BatchRange, identity: SpecIdentity, options: RunOptions
) -> tuple[LedgerView, LedgerRow, BatchRange] | Done:
    """Append the `planned` row of N on the plan fence; if another run planned
    N first, its plan is the one to run (or the pipeline moved on: done)."""
    spec = pipeline.spec
    row = LedgerRow(
        pipeline=spec.name,
        epoch=n.epoch, batch_id=n.batch_id,
        status=RowStatus.PLANNED,
        start_offsets=batch.start.to_dict(), end_offsets=batch.end.to_dict(), manifest=batch.manifest.to_dict(),
        pipeline_id=view.pipeline_id or new_pipeline_id(),
        spec=identity.to_dict(), spec_fingerprint=identity.fingerprint,
        run_id=options.run_id, attempt=options.attempt,
        interval_start=options.interval_start, interval_end=options.interval_end,
        planned_at=utcnow(),
        waiting_after=batch.waiting_after,
    )
    with storage_errors(f"pipeline {spec.name}: could not record the plan of {n} in the offset ledger", pipeline.ledger.path):
        if pipeline.ledger.append(view, row, PLAN_FENCE):
            return view, row, batch
    view = pipeline.ledger.load()
    theirs = view.planned(n)
    if theirs is not None:
        check_replay(spec, theirs)
        return view, theirs, pipeline.batch(theirs)
    if view.position >= n:
        return Done(Outcome.ALREADY_COMMITTED, moved_past(n, view.position), n, batch)
    raise ConcurrentRunError(
        f"pipeline {spec.name}: could not plan {n}: the ledger moved; run again", pipeline=spec.name, position=n
    )


# -- 3. Read and quarantine ------------------------------------------------------------


def read_and_quarantine(pipeline: Pipeline, plan: Plan, engine: Engine) -> Processed | Done:
    """Step 3: compute reads exactly the planned range; the state makes room
    for the batch (a new or widened merge column); bad records go to the
    quarantine, once. On an engine whose executors write the rows, they
    write the batch's updates and bad records as data files, and only the
    files' names and statistics reach this process (`_read_by_executors`)."""
    spec, n = pipeline.spec, plan.position
    if is_quiet(plan.batch):  # nothing to read: a batch that moves the watermark on schedule
        return Processed(quiet_updates(spec, pipeline.state.open()), 0, 0, 0)
    if engine.executors_write(spec, plan.batch):
        return _read_by_executors(pipeline, plan, engine)
    # Spark reads the planned files by name: one replaced meanwhile was read in
    # its place, and must not be recorded (and released) as the planned one:
    # checked as the read ends (a read made ahead, when it ended).
    result = engine.process(spec, plan.batch, check=pipeline.source.check_read)
    _boundary("after_read", spec)
    with storage_errors(f"pipeline {spec.name}: could not commit {n} to the state table", pipeline.state.path):
        table = pipeline.state.open() or pipeline.state.create(result.updates)
    moved = _moved_on(pipeline, plan, table)
    if moved is not None:
        return moved
    # A batch that cannot fit the state fails before the quarantine write:
    # that write is fenced per batch, so after a fix to the spec the replay
    # would not quarantine again what the fixed spec rejects.
    updates = pipeline.state.align(table, result.updates)
    check_windows(spec, updates, plan.batch.watermark)
    quarantined = result.quarantine.num_rows
    if quarantined:
        watch_for_new_files("mid_quarantine_write", pipeline.quarantine.path)
        with storage_errors(f"pipeline {spec.name}: could not quarantine {n}'s bad records", pipeline.quarantine.path):
            pipeline.quarantine.write(result.quarantine, n)
        log.info("quarantined %d of %d records", quarantined, result.records_in)
    pipeline.dedup.write(result.seen_ids, n)
    _boundary("after_quarantine", spec)
    return Processed(updates, result.records_in, quarantined, result.records_late, result.newest_event_time, result.records_duplicate)


def _read_by_executors(pipeline: Pipeline, plan: Plan, engine: Engine) -> Processed | Done:
    """Step 3 with the executors writing the rows (`spark_jobs.core.staged`):
    the state makes room for the transform's columns first (they are known
    once it is analysed), so that the files are written in the state's
    types; the overflow check then reads what the writing tasks saw, and the
    quarantine commits the files they wrote, once. A first batch creates the
    state table once its rows are written, as a batch in memory does."""
    spec, n = pipeline.spec, plan.position
    columns = engine.files().result_schema(spec, plan.batch)
    table = pipeline.state.open()
    if table is not None:
        moved = _moved_on(pipeline, plan, table)
        if moved is not None:
            return moved
    schema = pipeline.state.make_room(table, columns) if table is not None else pa.schema([*columns, pa.field(BATCH_COLUMN, pa.int64())])
    watch_for_new_files("mid_executor_write", pipeline.state.path)
    result = engine.process(spec, plan.batch, sink_for(pipeline, n, schema), check=pipeline.source.check_read)
    _boundary("after_read", spec)
    updates = cast(Staged, result.staged)
    if table is None:
        with storage_errors(f"pipeline {spec.name}: could not commit {n} to the state table", pipeline.state.path):
            table = pipeline.state.create(columns)
        moved = _moved_on(pipeline, plan, table)
        if moved is not None:
            return moved
    pipeline.state.check_staged(table, updates)
    check_windows(spec, updates, plan.batch.watermark)
    bad = result.staged_quarantine
    if bad is not None and bad.files:
        fault_point("mid_quarantine_write")  # its files written, their commit not made
        with storage_errors(f"pipeline {spec.name}: could not quarantine {n}'s bad records", pipeline.quarantine.path):
            pipeline.quarantine.write(bad, n)
        log.info("quarantined %d of %d records", bad.rows, result.records_in)
    pipeline.dedup.write(result.seen_ids, n)
    _boundary("after_quarantine", spec)
    bad_rows = bad.rows if bad is not None else 0
    return Processed(updates, result.records_in, bad_rows, result.records_late, result.newest_event_time, result.records_duplicate)


def sink_for(pipeline: Pipeline, position: Position, schema: pa.Schema) -> Sink:
    """Where the executors write batch `position`'s rows, in `schema` (the state's types)."""
    return Sink(pipeline.state.path, schema, pipeline.quarantine.path, pipeline.spec.name, position.epoch, position.batch_id, pipeline.dedup.path)


def _moved_on(pipeline: Pipeline, plan: Plan, table: DeltaTable) -> Done | None:
    """Whether the pipeline moved on from the ledger's head before this run's
    changes to the state (a column added for the batch, say): only a state
    still at the head may change (a run that lost the race, or a zombie,
    must not)."""
    n, current = plan.position, pipeline.state.position(table)
    if current >= n:
        reconcile(pipeline)  # records the winner's commit, or refuses one that is not ours
        return Done(Outcome.ALREADY_COMMITTED, moved_past(n, current), n, plan.batch)
    if not plan.view.agrees(current):
        raise StateBehindLedgerError(pipeline.spec.name, plan.head, current)
    return None


# -- 4. Commit the state ---------------------------------------------------------------


def commit_state(pipeline: Pipeline, plan: Plan, processed: Processed, options: RunOptions, started: float, engine: Engine) -> Committed | Done:
    """Step 4, the commit point: MERGE the updates with fence position N, from
    a checked snapshot; again from a fresh one when a commit that moved no
    fence landed first (a compaction, a VACUUM, `maintain`'s marker, any
    tool's): at most `STATE_COMMIT_TRIES` times."""
    spec, n = pipeline.spec, plan.position
    metadata = _batch_metadata(pipeline, plan, processed, options, started)
    watch_for_new_files("mid_state_merge", pipeline.state.path)
    if isinstance(processed.updates, Staged) and not merged_by_join(spec):
        # The batch's files are written, their commit not made. (The join has
        # its point after the files it writes: `own_commits.commit_rewrite`.)
        fault_point("mid_state_merge")
    for attempt in range(1, STATE_COMMIT_TRIES + 1):
        table = _checked_snapshot(pipeline, plan)
        if isinstance(table, Done):
            return table
        try:
            with storage_errors(f"pipeline {spec.name}: could not commit {n} to the state table", pipeline.state.path):
                # Also for a batch held here: a small batch into a big merged state
                # has the executors rewrite the state's files (`StateTable.commit_batch`).
                files = engine.files() if processed.records_in and engine.writes_files else None
                version, keys_updated = pipeline.state.commit_batch(table, processed.updates, metadata, files)
        except Exception as exc:
            if not is_commit_conflict(exc):
                raise
            landed = _after_conflict(pipeline, plan, metadata, exc, last=attempt == STATE_COMMIT_TRIES)
            if landed is None:
                log.info("another commit landed on the state while %s committed (try %d); again from a fresh snapshot", n, attempt)
                continue
            return landed
        # No stop here on SIGTERM: the ledger row is a few milliseconds away.
        fault_point("after_state_commit")
        return Committed(version, keys_updated, metadata.watermark)
    raise AssertionError("unreachable: the last try returns or raises")


def _checked_snapshot(pipeline: Pipeline, plan: Plan) -> DeltaTable | Done:
    """The state's snapshot step 4 commits from, checked: still at the
    ledger's head H, and changed by no one outside the job since; or how
    the run ends (another run committed N, or rewound the pipeline)."""
    spec, n, head = pipeline.spec, plan.position, plan.head
    # A new state table was created empty in step 3, so that even batch 1
    # commits from a checked snapshot.
    table = pipeline.state.open()
    if table is None:
        raise ConcurrentRunError(
            f"pipeline {spec.name}: the state table {pipeline.state.path} disappeared while this run "
            f"prepared {n}; nothing was committed",
            pipeline=spec.name,
            path=pipeline.state.path,
            position=n,
        )
    current = pipeline.state.position(table)
    if current >= n:
        reconcile(pipeline)
        return Done(Outcome.ALREADY_COMMITTED, moved_past(n, current), n, plan.batch)
    if not plan.view.agrees(current):
        raise StateBehindLedgerError(spec.name, head, current)
    if current == ORIGIN:
        # A state never committed to carries no fence, and a rewind the ledger
        # alone recorded moves none: a run that planned before such a rewind
        # must find out from the ledger, just before its first commit.
        moved = pipeline.ledger.load().position
        if moved != head:
            return Done(Outcome.ALREADY_COMMITTED, moved_past(n, moved), n, plan.batch)
    # Merging onto a change made outside the job since step 1 would hide it for good.
    check_unchanged(pipeline, plan.view, table)
    return table


def _batch_metadata(pipeline: Pipeline, plan: Plan, processed: Processed, options: RunOptions, started: float) -> CommitMetadata:
    """What the state commit carries, and the ledger's row is built from: the planned
    row's range (this run's or an earlier attempt's), this run's spec, step 3's counts."""
    return CommitMetadata(
        **{
            **plan.row.record(),
            "spec": plan.identity.to_dict(), "spec_fingerprint": plan.identity.fingerprint,
            "run_id": options.run_id, "attempt": options.attempt,
            "interval_start": options.interval_start, "interval_end": options.interval_end,
            "records_in": processed.records_in, "records_quarantined": processed.records_quarantined,
            "duration_ms": int((time.monotonic() - started) * 1000),
            # (From the head's and the plan's interval, not this run's: a replay leaves the same.)
            "watermark": watermark_after(pipeline.spec, plan.view.head.watermark if plan.view.head else None, processed.newest_event_time, plan.row),
            "records_late": processed.records_late, "records_duplicate": processed.records_duplicate,
        },
        kind=CommitKind.BATCH,
        position=plan.position,
        commit_token=uuid.uuid4().hex,
    )


def _after_conflict(pipeline: Pipeline, plan: Plan, metadata: CommitMetadata, exc: Exception, *, last: bool) -> Committed | Done | None:
    """A commit landed after our snapshot and ours failed: whose was it? Ours
    (reported as failed), another run's of N (or a rewind): how the run ends.
    None: one that moved no fence (a compaction, say), after which step 4 may
    try again from a fresh snapshot, unless this was the `last` try."""
    n = plan.position
    table = pipeline.state.open()
    now = pipeline.state.position(table)
    landed = pipeline.state.find_commit(table, n) if now >= n else None
    if landed is not None and landed.metadata.commit_token == metadata.commit_token:
        # Our own commit landed but the store answered with an error: S3 can
        # time out after the write, and the retried conditional put then finds
        # our log entry and reports a conflict.
        log.warning("the commit of %s landed although the store reported a failure", n)
        fault_point("after_state_commit")
        return Committed(landed.version, landed.keys_updated, landed.metadata.watermark)
    if now >= n:
        reconcile(pipeline)
        return Done(Outcome.ALREADY_COMMITTED, moved_past(n, now), n, plan.batch)
    if not last and plan.view.agrees(now):
        return None
    raise ConcurrentRunError(
        f"pipeline {pipeline.spec.name}: the state table changed while committing {n} ({exc}); nothing was committed, run again",
        pipeline=pipeline.spec.name,
        path=pipeline.state.path,
        position=n,
    ) from exc


# -- 5. Project into the ledger --------------------------------------------------------


def project(pipeline: Pipeline) -> None:
    """Step 5: step 1 again, which records the `committed` row from the state
    commit just made; then the source may release what is committed."""
    view = reconcile(pipeline, own_commit=True)
    # A fault point but no SIGTERM stop: the batch is committed, and a run
    # that committed must say so.
    fault_point("after_ledger_commit")
    settle(pipeline, view)
    if pipeline.ledger.compact():
        log.info("compacted the offset ledger")
    lineage = pipeline.lineage(view)
    # The consumed index is a cache of the ledger: it follows the row just
    # recorded (best effort; lookups read what it lacks from the ledger).
    lineage.record()
    # After the commit only (a replay reads its planned files), and after the
    # ledger row, so the consumed set it goes by includes this batch.
    try:
        pipeline.source.after_commit(lineage)
    except Exception as exc:  # noqa: BLE001 - the batch is committed: releasing files never fails the run
        log.warning("consumed source data not released this time (%s); the next committing run tries again", exc)


# -- helpers ---------------------------------------------------------------------------


def _boundary(point: str, spec: PipelineSpec) -> None:
    """A protocol boundary: a named fault point, and where a SIGTERM stops the run."""
    fault_point(point)
    shutdown.check(point, spec.name)
