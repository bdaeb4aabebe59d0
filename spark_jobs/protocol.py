"""The commit protocol: one exactly-once micro-batch, told top to bottom.

Delta commits are atomic per table and there is no multi-table transaction,
so one table's commit must be *the* commit point. It is the state table's:
its commit carries the batch's position on the state fence (see
`spark_jobs.fencing`) and, in its commit metadata, everything the ledger row
needs (offsets, manifest, metrics). The ledger's ``committed`` row is a
projection of that commit, repaired by the next run if a crash falls between
the two. A run of batch N (position ``(epoch, N)``):

1. **Reconcile.** Read the ledger's head H and the state fence S. If S == H
   the tables agree (unless the state's history shows a change made outside
   the job since H's commit: stop). If S is one event ahead, a run committed
   the state and died before its ledger row: append that row from the state
   commit's metadata, fenced on the ledger's commit fence (so a racing run
   does not append it twice). If S is further ahead or behind, the tables do
   not belong together (a lost checkpoint, a replaced state): stop.

2. **Plan** N = H.batch_id + 1. If a ``planned`` row for N exists (an earlier
   attempt died), reuse its range: a replay reads exactly the same records.
   Otherwise ask the source for the records after H, bounded by ``until``
   (the end of the data interval) and the caps. Nothing new: return without
   starting Spark. Else check the transform against the source schema (before
   any write, so a bad spec writes nothing) and append the ``planned`` row on
   the ledger's plan fence. If another run planned N first, use its plan.

3. **Read and quarantine.** Compute reads exactly the planned range, splits
   off bad records and runs the transform. The result must fit the state
   table's types (the first batch creates the table, empty) before anything
   of N is written. Bad records are appended to the quarantine table on its
   own fence, so a replay of N does not add them twice.

4. **Commit the state** (the commit point). On a fresh snapshot, the state
   fence must still read H: if it reads N or beyond, another run committed
   this batch (or rewound the pipeline) and this run is a no-op. Otherwise
   MERGE the updates, carrying fence position N and the batch's metadata. If
   the commit fails because a commit with the state fence landed after our
   snapshot, the winner did the work: no-op, never a retry of N. (The
   "winner" can be this very commit, reported as failed by the store after it
   landed; its ``commit_token`` says so, and the run carries on to step 5.)

5. **Project into the ledger.** Step 1 again: the ``committed`` row is built
   from the state commit we just made.

Every crash point is covered: before 4 nothing visible happened but a plan
(reused on replay) and at most one quarantine append (fenced); after 4 the
batch is durable and the next run's step 1 completes it. The boundaries
between the steps are named fault points (`spark_jobs.faults`) for crash
tests, and where a SIGTERM stops the run (`spark_jobs.shutdown`) up to step
4; from the state commit on the run finishes (step 5 is milliseconds away)
and reports its batch committed.

Rewind to batch K: restore the state to K's version in one commit that moves
the state fence to ``(epoch + 1, K)``, then project a ``rewound`` row. Delta's
RESTORE does not roll ``txn`` versions back (delta-io/delta#1813), hence the
new epoch: positions stay increasing and fencing keeps working. The next
batch is K+1 in the new epoch; it plans afresh from K's offsets, so it
re-reads the files K+1.. read before (those still there) and whatever
landed since, and its batch boundaries may differ from the old epoch's.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from spark_jobs.compute import Compute
from spark_jobs.delta_io import is_commit_conflict, storage_errors
from spark_jobs.errors import (
    ConcurrentRunError,
    MicrobatchError,
    RewindError,
    StateBehindLedgerError,
    StateChangedOutsideError,
    StateLedgerMismatchError,
    StorageError,
)
from spark_jobs import shutdown
from spark_jobs.faults import fault_point, watch_for_new_files
from spark_jobs.fencing import COMMIT_FENCE, PLAN_FENCE, Position
from spark_jobs.ledger import COMMITTED, FORMAT_VERSION, PLANNED, REWOUND, LedgerRow, LedgerView, OffsetLedger, utcnow
from spark_jobs.quarantine import Quarantine
from spark_jobs.sources import BatchRange, FilesSource, make_source
from spark_jobs.sources.files import consumed_names
from spark_jobs.spec import PipelineSpec
from spark_jobs.state import StateCommit, StateTable

if TYPE_CHECKING:
    from deltalake import DeltaTable

log = logging.getLogger("microbatch")

# Outcomes of a run.
COMMITTED_BATCH = "committed"
NO_NEW_DATA = "no_new_data"
ALREADY_COMMITTED = "already_committed"
DRY_RUN = "dry_run"


@dataclass
class RunOptions:
    """What the orchestrator (CLI or Airflow) passes to one run."""

    run_id: str = field(default_factory=lambda: f"cli-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}")
    attempt: int = 1
    #: Data interval of the run. `interval_end` bounds the batch: only source
    #: data that had arrived before it is read.
    interval_start: datetime | None = None
    interval_end: datetime | None = None
    #: Override the spec's caps for this run.
    max_files: int | None = None
    max_records: int | None = None
    dry_run: bool = False


@dataclass
class BatchOutcome:
    """What a run did; printed by the CLI and returned as XCom by Airflow."""

    status: str
    pipeline: str
    message: str
    epoch: int | None = None
    batch_id: int | None = None
    start_offsets: dict[str, Any] | None = None
    end_offsets: dict[str, Any] | None = None
    files: list[str] = field(default_factory=list)
    records_in: int | None = None
    records_quarantined: int | None = None
    keys_updated: int | None = None
    state_version: int | None = None
    duration_ms: int | None = None
    run_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Pipeline:
    """The tables and source of one spec."""

    def __init__(self, spec: PipelineSpec, storage_options: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.ledger = OffsetLedger(spec.ledger_path, spec.name, storage_options)
        self.state = StateTable(spec, storage_options)
        self.quarantine = Quarantine(spec.quarantine_path, spec.name, storage_options)
        self.source: FilesSource = make_source(spec)


def run_batch(
    spec: PipelineSpec,
    options: RunOptions | None = None,
    compute_factory: Callable[[], Compute] | None = None,
) -> BatchOutcome:
    """Run one micro-batch of `spec` (steps 1-5 of the module docstring)."""
    options = options or RunOptions()
    started = time.monotonic()
    p = Pipeline(spec)

    # 1. Reconcile.
    view = reconcile(p)
    _boundary("after_reconcile")
    head = view.position
    n = head.next()

    # 2. Plan.
    planned = view.planned(n)
    if planned is not None:
        batch = BatchRange(planned.start_offsets, planned.end_offsets, planned.manifest)
        log.info("replaying the planned range of %s", n)
    else:
        consumed = consumed_names([r.manifest for r in view.lineage()])
        batch = p.source.plan(
            consumed,
            until=options.interval_end,
            max_files=options.max_files or spec.batch.max_files,
            max_records=options.max_records or spec.batch.max_records,
        )
        if batch is None:
            return _nothing_new(spec, options, head, started)
    if options.dry_run:
        return _outcome(DRY_RUN, spec, options, n, batch, started, f"would process {_describe(batch)} as {n}; nothing committed")

    compute = compute_factory() if compute_factory else _spark_compute(spec)
    try:
        if planned is None:
            compute.check(spec)  # a transform that cannot fit the state fails before any write
            row = LedgerRow(
                pipeline=spec.name,
                epoch=n.epoch,
                batch_id=n.batch_id,
                status=PLANNED,
                start_offsets=batch.start_offsets,
                end_offsets=batch.end_offsets,
                manifest=batch.manifest,
                run_id=options.run_id,
                attempt=options.attempt,
                interval_start=options.interval_start,
                interval_end=options.interval_end,
                planned_at=utcnow(),
            )
            with storage_errors(f"pipeline {spec.name}: could not record the plan of {n} in the offset ledger", p.ledger.path):
                appended = p.ledger.append(view, row, PLAN_FENCE)
            if not appended:
                # Another run planned N first (or the pipeline moved on): use its plan.
                view = p.ledger.load()
                planned = view.planned(n)
                if planned is None:
                    if view.position >= n:
                        return _outcome(ALREADY_COMMITTED, spec, options, n, batch, started, _moved_past(n, view.position))
                    raise ConcurrentRunError(f"pipeline {spec.name}: could not plan {n}: the ledger moved; run again")
                batch = BatchRange(planned.start_offsets, planned.end_offsets, planned.manifest)
            else:
                planned = row
        log.info("planned %s: %s", n, _describe(batch))
        _boundary("after_plan")

        # 3. Read and quarantine.
        result = compute.process(spec, batch)
        _boundary("after_read")
        committing = f"pipeline {spec.name}: could not commit {n} to the state table"
        with storage_errors(committing, p.state.path):
            table = p.state.open() or p.state.create(result.updates)
        # A batch that cannot fit the state fails before the quarantine write:
        # that write is fenced per batch, so after a fix to the spec the
        # replay would not quarantine again what the fixed spec rejects.
        p.state.check_fits(table, result.updates)
        quarantined = result.quarantine.num_rows
        if quarantined:
            watch_for_new_files("mid_quarantine_write", p.quarantine.path)
            with storage_errors(f"pipeline {spec.name}: could not quarantine {n}'s bad records", p.quarantine.path):
                p.quarantine.write(result.quarantine, n)
            log.info("quarantined %d of %d records", quarantined, result.records_in)
        _boundary("after_quarantine")

        # 4. Commit the state: the commit point. (A new state table was created
        # empty above, so that even batch 1 commits from a checked snapshot.)
        table = p.state.open()
        if table is None:
            raise ConcurrentRunError(
                f"pipeline {spec.name}: the state table {p.state.path} disappeared while this run "
                f"prepared {n}; nothing was committed"
            )
        current = p.state.position(table)
        if current >= n:
            reconcile(p)
            return _outcome(ALREADY_COMMITTED, spec, options, n, batch, started, _moved_past(n, current))
        if current != head:
            raise StateBehindLedgerError(spec.name, str(head), str(current))
        # Merging onto a change made outside the job since step 1 would hide it for good.
        _check_unchanged(p, view, table)
        metadata = {
            "txn": n.encode(),
            "kind": "batch",
            "pipeline": spec.name,
            "epoch": n.epoch,
            "batch_id": n.batch_id,
            "start_offsets": batch.start_offsets,
            "end_offsets": batch.end_offsets,
            "manifest": batch.manifest,
            "run_id": options.run_id,
            "attempt": options.attempt,
            "records_in": result.records_in,
            "records_quarantined": quarantined,
            "interval_start": _iso(options.interval_start),
            "interval_end": _iso(options.interval_end),
            "planned_at": _iso(planned.planned_at),
            "duration_ms": int((time.monotonic() - started) * 1000),
            "format_version": FORMAT_VERSION,
            # Tells this commit from any other at the same position (below).
            "commit_token": uuid.uuid4().hex,
        }
        watch_for_new_files("mid_state_merge", p.state.path)
        try:
            with storage_errors(committing, p.state.path):
                version, keys_updated = p.state.commit_batch(table, result.updates, n, metadata)
        except Exception as exc:
            if not is_commit_conflict(exc):
                raise
            table = p.state.open()
            now = p.state.position(table)
            landed = p.state.find_commit(table, n) if now >= n else None
            if landed is not None and landed.metadata.get("commit_token") == metadata["commit_token"]:
                # Our own commit landed but the store answered with an error: S3
                # can time out after the write, and the retried conditional put
                # then finds our log entry and reports a conflict.
                log.warning("the commit of %s landed although the store reported a failure", n)
                version, keys_updated = landed.version, _row_from_commit(spec.name, landed).keys_updated or 0
            elif now >= n:
                reconcile(p)
                return _outcome(ALREADY_COMMITTED, spec, options, n, batch, started, _moved_past(n, now))
            else:
                raise ConcurrentRunError(
                    f"pipeline {spec.name}: the state table changed while committing {n} "
                    f"({exc}); nothing was committed, run again"
                ) from exc
        # No stop here on SIGTERM: the ledger row is a few milliseconds away.
        fault_point("after_state_commit")
        log.info("committed %s: state version %d, %d keys updated", n, version, keys_updated)

        # 5. Project into the ledger.
        reconcile(p)
        # A fault point but no SIGTERM stop: the batch is committed, and a
        # run that committed must say so.
        fault_point("after_ledger_commit")
        if p.ledger.compact():
            log.info("compacted the offset ledger")
    finally:
        compute.close()

    outcome = _outcome(COMMITTED_BATCH, spec, options, n, batch, started, f"committed {n}: {_describe(batch)}")
    outcome.records_in = result.records_in
    outcome.records_quarantined = quarantined
    outcome.keys_updated = keys_updated
    outcome.state_version = version
    return outcome


def reconcile(p: Pipeline) -> LedgerView:
    """Step 1 (and 5): make the ledger's head agree with the state fence."""
    for _ in range(3):
        view = p.ledger.load()
        table = p.state.open()
        state_at = p.state.position(table)
        try:
            commit = _lagging_commit(p, view, table, state_at)
        except StateLedgerMismatchError:
            if p.ledger.load().position != view.position:
                continue  # our view of the ledger was stale (events landed since): look again
            raise
        if commit is None:
            return view
        row = _row_from_commit(p.spec.name, commit)
        with storage_errors(
            f"pipeline {p.spec.name}: could not record {row.status} {state_at} in the offset ledger",
            p.ledger.path,
            note=(
                f"{state_at} itself is durable in the state table (the commit point); the next run "
                "records this ledger row from it. It is safe to re-run once the storage is healthy "
                "again (space freed, disk fixed)."
            ),
        ):
            appended = p.ledger.append(view, row, COMMIT_FENCE)
        if appended:
            log.info("ledger: recorded %s %s from state version %d", row.status, state_at, commit.version)
    view = p.ledger.load()
    if p.state.position(p.state.open()) != view.position:
        raise ConcurrentRunError(f"pipeline {p.spec.name}: the tables kept moving while reconciling; run again")
    return view


def _lagging_commit(p: Pipeline, view: LedgerView, table: DeltaTable | None, state_at: Position) -> StateCommit | None:
    """The state commit the ledger lags behind, None if the two agree.

    Raises `StateLedgerMismatchError` (or its subclasses) when they do not
    belong together; reads only, so `status` can say what a run would find.
    """
    if state_at == view.position:
        _check_unchanged(p, view, table)
        return None
    if state_at < view.position:
        raise StateBehindLedgerError(p.spec.name, str(view.position), str(state_at), missing=table is None)
    commit = p.state.find_commit(table, state_at) if table is not None else None
    if commit is None:
        raise MicrobatchError(
            f"pipeline {p.spec.name}: the state table is at {state_at} but its commit is not "
            f"in the last versions of {p.state.path}'s history; the ledger cannot be repaired "
            "automatically. Rewind to a batch in the ledger with `microbatch rewind`."
        )
    problem = _not_following(p, view.position, state_at, commit)
    if problem is not None:
        raise StateLedgerMismatchError(problem)
    if commit.metadata.get("kind") == "batch":
        # A change made outside the job before the lagging batch would be
        # hidden by projecting it; one made after it is found once the row is
        # recorded. (A rewind replaces whatever was there with a version the
        # ledger knows: it is the repair.)
        _check_unchanged(p, view, table, before_version=commit.version)
    return commit


def _not_following(p: Pipeline, head: Position, state_at: Position, commit: StateCommit) -> str | None:
    """Why the state commit at `state_at` does not directly follow the ledger's head, or None.

    A run commits the state only from the ledger's head, and a rewind only
    one epoch up, so the ledger can lag the state by one event at most. A
    state further ahead, or one committed by another pipeline, means the
    ledger is not this state's own (the checkpoint was deleted or replaced,
    the pipeline renamed, or the state table shared): recording just the
    latest commit would make the next runs re-read everything before it.
    """
    m = commit.metadata
    if m.get("kind") == "rewind":
        follows = state_at.epoch == head.epoch + 1 and state_at.batch_id <= head.batch_id
    else:
        follows = state_at == head.next()
    if m.get("pipeline") == p.spec.name and follows:
        return None
    return (
        f"pipeline {p.spec.name}: the state table {p.state.path} is at {state_at} (committed by pipeline "
        f"{m.get('pipeline')!r}), which does not follow {head} in the offset ledger {p.ledger.path}. The "
        "ledger is not this state's: its checkpoint was deleted or replaced, the pipeline was renamed, "
        "or another pipeline writes the same state table. Nothing was written. Point `checkpoint` back "
        "at the folder that belongs to this state, or give the pipeline a new state path and a new "
        "checkpoint to start over."
    )


def _check_unchanged(
    p: Pipeline, view: LedgerView, table: DeltaTable | None, before_version: int | None = None
) -> None:
    """Refuse a state whose data changed outside the job since the ledger's head.

    A Delta RESTORE (or DELETE, ...) of the state does not move the fence
    (RESTORE leaves `txn` alone), so the positions still agree; only the
    history shows it.
    """
    head = view.head
    if table is None or head is None or head.state_version is None:
        return
    changes = p.state.outside_changes(table, head.state_version, before_version)
    if changes:
        raise StateChangedOutsideError(p.spec.name, p.state.path, changes, str(view.position), view.position.batch_id)


def _moved_past(n: Position, current: Position) -> str:
    """Why a run of `n` is a no-op, given the position the pipeline moved to."""
    if current.epoch > n.epoch:
        return f"the pipeline was rewound (now at {current}) while this run prepared {n}; nothing to do"
    return f"another run already committed {n} (the pipeline is at {current}); nothing to do"


def _row_from_commit(pipeline: str, commit: StateCommit) -> LedgerRow:
    m = commit.metadata
    metrics = commit.operation_metrics
    keys_updated = metrics.get("num_target_rows_inserted", metrics.get("num_added_rows", 0)) + metrics.get(
        "num_target_rows_updated", 0
    )
    rewind = m["kind"] == "rewind"
    return LedgerRow(
        pipeline=pipeline,
        epoch=m["epoch"],
        batch_id=m["batch_id"],
        status=REWOUND if rewind else COMMITTED,
        start_offsets=m["start_offsets"],
        end_offsets=m["end_offsets"],
        manifest=m.get("manifest") or {},
        state_version=commit.version,
        run_id=m.get("run_id"),
        attempt=m.get("attempt"),
        records_in=None if rewind else m.get("records_in"),
        records_quarantined=None if rewind else m.get("records_quarantined"),
        keys_updated=None if rewind else int(keys_updated),
        interval_start=_parse_iso(m.get("interval_start")),
        interval_end=_parse_iso(m.get("interval_end")),
        planned_at=_parse_iso(m.get("planned_at")),
        committed_at=commit.timestamp,
        duration_ms=m.get("duration_ms"),
    )


def rewind(spec: PipelineSpec, to_batch: int, run_id: str | None = None) -> BatchOutcome:
    """Restore the state to batch `to_batch` and continue from its offsets.

    Also the way out when the state table is behind the ledger (someone
    restored or replaced it): the rewind then starts from the ledger alone.
    """
    started = time.monotonic()
    p = Pipeline(spec)
    try:
        view = reconcile(p)
        recovering = False
    except (StateBehindLedgerError, StateChangedOutsideError):
        view = p.ledger.load()
        recovering = True
    head = view.position
    if to_batch < 0 or to_batch > head.batch_id:
        raise RewindError(f"pipeline {spec.name}: cannot rewind to batch {to_batch}; committed batches are 0..{head.batch_id}")
    if to_batch == head.batch_id and not recovering:
        raise RewindError(f"pipeline {spec.name}: already at batch {to_batch}; nothing to rewind")
    if to_batch == 0:
        version, end_offsets = None, p.source.origin
    else:
        target = view.committed_row(to_batch)
        if target is None or target.state_version is None:
            raise RewindError(f"pipeline {spec.name}: batch {to_batch} is not in the ledger's lineage")
        version, end_offsets = target.state_version, target.end_offsets
    table = p.state.open()
    if table is None:
        raise RewindError(
            f"pipeline {spec.name}: there is no state table at {p.state.path} to rewind. If it was "
            "moved or deleted on purpose to start over, give the pipeline a new checkpoint as well."
        )
    # The restore commits from this snapshot: its fence must be where the
    # ledger says (recovering: not ahead of it, or ahead by the one batch
    # the ledger may lag by), else a run or another rewind moved the
    # pipeline since we looked.
    current = p.state.position(table)
    if (current != head) if not recovering else not (current <= head or current == head.next()):
        raise ConcurrentRunError(f"pipeline {spec.name}: the state moved to {current} while rewinding; run the rewind again")
    new = Position(head.epoch + 1, to_batch)
    metadata = {
        "txn": new.encode(),
        "kind": "rewind",
        "pipeline": spec.name,
        "epoch": new.epoch,
        "batch_id": to_batch,
        "start_offsets": view.head.end_offsets if view.head else {},
        "end_offsets": end_offsets,
        "rewound_from": str(head),
        "restored_version": version,
        "run_id": run_id or f"cli-rewind-{uuid.uuid4().hex[:6]}",
        "format_version": FORMAT_VERSION,
    }
    try:
        with storage_errors(f"pipeline {spec.name}: could not rewind the state table to batch {to_batch}", p.state.path):
            state_version = p.state.restore(table, version, new, metadata)
    except Exception as exc:
        if isinstance(exc, StorageError):
            raise
        if is_commit_conflict(exc):
            raise ConcurrentRunError(f"pipeline {spec.name}: a batch committed while rewinding; run the rewind again") from exc
        raise RewindError(
            f"pipeline {spec.name}: could not restore {p.state.path} to version {version}: {exc}. "
            f"If old files were vacuumed, batch {to_batch} cannot be restored."
        ) from exc
    reconcile(p)
    outcome = BatchOutcome(
        status=REWOUND,
        pipeline=spec.name,
        message=f"rewound from {head} to batch {to_batch}: epoch {new.epoch} continues from {end_offsets}",
        epoch=new.epoch,
        batch_id=to_batch,
        end_offsets=end_offsets,
        state_version=state_version,
        duration_ms=int((time.monotonic() - started) * 1000),
        run_id=metadata["run_id"],
    )
    return outcome


@dataclass
class PipelineStatus:
    pipeline: str
    epoch: int
    last_batch: int
    end_offsets: dict[str, Any]
    state_version: int | None
    committed_at: datetime | None
    files_waiting: int
    note: str | None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["committed_at"] = _iso(self.committed_at)
        return out


def status(spec: PipelineSpec) -> PipelineStatus:
    """Where the pipeline stands. Read-only: a pending repair is reported, not made."""
    p = Pipeline(spec)
    view = p.ledger.load()
    head = view.head
    table = p.state.open()
    state_at = p.state.position(table)
    try:
        lagging = _lagging_commit(p, view, table, state_at)
        note = f"the state is at {state_at}; the next run will record it in the ledger" if lagging else None
    except MicrobatchError as exc:
        note = str(exc)
    consumed = consumed_names([r.manifest for r in view.lineage()])
    try:
        waiting = len(p.source.pending(consumed))
    except MicrobatchError as exc:
        waiting, note = 0, str(exc)
    return PipelineStatus(
        pipeline=spec.name,
        epoch=view.position.epoch,
        last_batch=view.position.batch_id,
        end_offsets=head.end_offsets if head else p.source.origin,
        state_version=head.state_version if head else None,
        committed_at=head.committed_at if head else None,
        files_waiting=waiting,
        note=note,
    )


def history(spec: PipelineSpec) -> list[LedgerRow]:
    """All ledger rows, oldest first."""
    rows = Pipeline(spec).ledger.load().rows
    order = {PLANNED: 0, COMMITTED: 1, REWOUND: 2}
    return sorted(rows, key=lambda r: (r.planned_at or r.committed_at or utcnow(), r.epoch, r.batch_id, order[r.status]))


# -- helpers ---------------------------------------------------------------------


def _boundary(point: str) -> None:
    """A protocol boundary: a named fault point, and where a SIGTERM stops the run."""
    fault_point(point)
    shutdown.check(point)


def _spark_compute(spec: PipelineSpec) -> Compute:
    # Imported here so that runs with nothing to do never import pyspark.
    from spark_jobs.spark_compute import SparkCompute, resolve_master

    return SparkCompute(master=resolve_master(None, spec))


def _nothing_new(spec: PipelineSpec, options: RunOptions, head: Position, started: float) -> BatchOutcome:
    if options.interval_end is not None:
        message = (
            f"no new data arrived before {options.interval_end.isoformat()}: this interval is "
            f"already covered (pipeline at {head})"
        )
    else:
        message = f"no new data (pipeline at {head})"
    return BatchOutcome(
        status=NO_NEW_DATA,
        pipeline=spec.name,
        message=message,
        epoch=head.epoch,
        batch_id=head.batch_id,
        duration_ms=int((time.monotonic() - started) * 1000),
        run_id=options.run_id,
    )


def _outcome(status_: str, spec: PipelineSpec, options: RunOptions, n: Position, batch: BatchRange, started: float, message: str) -> BatchOutcome:
    return BatchOutcome(
        status=status_,
        pipeline=spec.name,
        message=message,
        epoch=n.epoch,
        batch_id=n.batch_id,
        start_offsets=batch.start_offsets,
        end_offsets=batch.end_offsets,
        files=[f["name"] for f in batch.manifest.get("files", [])],
        duration_ms=int((time.monotonic() - started) * 1000),
        run_id=options.run_id,
    )


def _describe(batch: BatchRange) -> str:
    files = batch.manifest.get("files", [])
    return f"{len(files)} file(s), offsets {batch.start_offsets} -> {batch.end_offsets}"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _parse_iso(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None
