"""Rewind: go back to batch K, in a new epoch.

Restore the state to K's version in one commit that moves the state fence to
``(epoch + 1, K)``, then project a ``rewound`` row (as step 5 of
`spark_jobs.core.protocol` projects a batch). Delta's RESTORE does not roll
``txn`` versions back (delta-io/delta#1813), hence the new epoch: positions
stay increasing and fencing keeps working. The next batch is K+1 in the new
epoch; it plans afresh from K's offsets, so it re-reads the files K+1.. read
before (those still there) and whatever landed since, and its batch
boundaries may differ from the old epoch's.

Rewind is also the way out when the state table is behind the ledger, or was
changed outside the job: it then starts from the ledger alone. And it is the
way out of a stuck batch (a planned batch that cannot be replayed, its file
gone or rewritten): a rewind to the last committed batch K moves the
pipeline to a new epoch at K, where that plan no longer applies. Before the
first commit there may be no state table at all: a missing state is the
empty state at batch 0 of any epoch, so the rewind to 0 is then recorded in
the ledger alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from spark_jobs.core.commits import CommitKind, CommitMetadata
from spark_jobs.core.delta_io import is_commit_conflict, storage_errors
from spark_jobs.core.fencing import COMMIT_FENCE, Position
from spark_jobs.core.ledger import LedgerRow, LedgerView, RowStatus, utcnow
from spark_jobs.core.identity import SpecIdentity, changes
from spark_jobs.core.maintain import oldest_rewindable, restorable_version
from spark_jobs.core.untracked import removal_floor
from spark_jobs.core.outcome import BatchOutcome, Outcome
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.protocol import reconcile
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.windows import settle
from spark_jobs.errors import (
    ConcurrentRunError,
    RewindError,
    StateBehindLedgerError,
    StateChangedOutsideError,
    StorageError,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["check_rewind", "rewind", "rewind_target"]


def rewind(spec: PipelineSpec, to_batch: int, run_id: str) -> BatchOutcome:
    """Restore the state to batch `to_batch` and continue from its offsets.

    `run_id` is recorded in the ledger's ``rewound`` row (the CLI's or the
    Airflow run's id), so an orchestrator can tell whether it already rewound.
    """
    started = time.monotonic()
    pipeline = Pipeline(spec)
    try:
        view = reconcile(pipeline)
        recovering = False
    except (StateBehindLedgerError, StateChangedOutsideError):
        view = pipeline.ledger.load()
        recovering = True
    head = view.position

    def refuse(message: str) -> RewindError:
        return RewindError(f"pipeline {spec.name}: {message}", pipeline=spec.name, path=pipeline.state.path, position=head)

    stuck = view.planned(head.next()) is not None
    if to_batch == head.batch_id and not (recovering or stuck):
        raise refuse(f"already at batch {to_batch}, with no pending plan; nothing to rewind")
    identity = SpecIdentity.of(spec)
    table = pipeline.state.open()
    version, end_offsets = rewind_target(pipeline, view, table, to_batch, identity)
    new = Position(head.epoch + 1, to_batch)
    if table is None and head.batch_id == 0:
        return _rewind_ledger_only(pipeline, view, new, identity, run_id, started)
    if table is None:
        raise refuse(
            f"there is no state table at {pipeline.state.path} to rewind. If it was moved or deleted on "
            "purpose to start over, give the pipeline a new checkpoint as well."
        )
    _check_not_moved(pipeline, view, table, recovering)
    pipeline.source.rewinding(end_offsets)
    # Again, now that the upstream's `maintain` keeps what the replay reads
    # (`rewinding` moved this pipeline's position back): one that deleted it
    # since the first check is caught here, before the state changes.
    _check_replay(pipeline, view, end_offsets, to_batch, refuse)
    metadata = CommitMetadata(
        kind=CommitKind.REWIND,
        pipeline=spec.name,
        position=new,
        start_offsets=view.head.end_offsets if view.head else {},
        end_offsets=end_offsets,
        pipeline_id=view.pipeline_id,
        spec=identity.to_dict(),
        spec_fingerprint=identity.fingerprint,
        run_id=run_id,
        rewound_from=str(head),
        restored_version=version,
        # The pipeline carries on from batch `to_batch`: from its watermark too.
        watermark=_watermark_at(view, to_batch),
    )
    state_version = _restore(pipeline, table, version, metadata, refuse)
    _after_rewind(pipeline)
    return _rewound(spec, head, new, end_offsets, state_version, run_id, started)



def _after_rewind(pipeline: Pipeline) -> None:
    """The rewind projected into the ledger; the consumed index rebuilt for
    the new epoch (rewinds are rare), so the next runs look files up in it
    again; the final rows of the batches after the target taken back."""
    rewound = reconcile(pipeline)
    pipeline.lineage(rewound).record()
    settle(pipeline, rewound)


def _watermark_at(view: LedgerView, batch_id: int) -> datetime | None:
    """The watermark batch `batch_id` of the lineage recorded (None: batch 0, or no event time)."""
    row = view.committed_row(batch_id) if batch_id > 0 else None
    return row.watermark if row is not None else None


def _check_not_moved(pipeline: Pipeline, view: LedgerView, table: DeltaTable, recovering: bool) -> None:
    """The restore commits from this snapshot: its fence must be where the
    ledger says (recovering: not ahead of it, or ahead by the one batch the
    ledger may lag by), else a run or another rewind moved the pipeline
    since we looked."""
    head, current = view.position, pipeline.state.position(table)
    if not view.agrees(current) if not recovering else not (current <= head or current == head.next()):
        raise ConcurrentRunError(
            f"pipeline {pipeline.spec.name}: the state moved to {current} while rewinding; run the rewind again",
            pipeline=pipeline.spec.name,
            position=current,
        )


def _restore(pipeline: Pipeline, table: DeltaTable, version: int, metadata: CommitMetadata, refuse: Callable[[str], RewindError]) -> int:
    """RESTORE the state to `version`, committing `metadata`: the rewind's commit point."""
    to_batch = metadata.position.batch_id
    try:
        with storage_errors(f"pipeline {pipeline.spec.name}: could not rewind the state table to batch {to_batch}", pipeline.state.path):
            return pipeline.state.restore(table, version, metadata)
    except StorageError:
        raise
    except Exception as exc:
        if is_commit_conflict(exc):
            raise ConcurrentRunError(
                f"pipeline {pipeline.spec.name}: another commit (a batch's, or `maintain`'s) landed on the state while "
                "rewinding; nothing was changed, run the rewind again", pipeline=pipeline.spec.name
            ) from exc
        raise refuse(
            f"could not restore {pipeline.state.path} to version {version}: {exc}. "
            f"If old files were vacuumed, batch {to_batch} cannot be restored."
        ) from exc


def rewind_target(
    pipeline: Pipeline, view: LedgerView, table: DeltaTable | None, to_batch: int, identity: SpecIdentity
) -> tuple[int | None, dict[str, Any]]:
    """The state version a rewind to `to_batch` restores (None: the empty
    state) and the offsets the pipeline then continues from. Raises
    `RewindError` saying why, if that batch cannot be rewound to."""
    head = view.position

    def refuse(message: str) -> RewindError:
        return RewindError(f"pipeline {pipeline.spec.name}: {message}", pipeline=pipeline.spec.name, path=pipeline.state.path, position=head)

    if to_batch < 0 or to_batch > head.batch_id:
        raise refuse(f"cannot rewind to batch {to_batch}; committed batches are 0..{head.batch_id}")
    if to_batch == 0:
        origin = pipeline.source.origin.to_dict()
        _check_replay(pipeline, view, origin, 0, refuse)
        return None, origin
    target = view.committed_row(to_batch)
    if target is None or target.state_version is None:
        raise refuse(f"batch {to_batch} is not in the ledger's lineage")
    if target.spec is not None:
        # Batches after K would be recomputed under this spec on top of a
        # state folded under another meaning.
        made_under = SpecIdentity.from_dict(target.spec)
        head_spec = view.head.spec if view.head is not None else None
        if head_spec is not None:
            # A batch recorded before a field had a rule (identity format 1)
            # holds no value for it: take the one the head recorded, which no
            # run since could change without a refusal. Else a rewind there
            # would pass what `check_spec` refuses.
            made_under = SpecIdentity({**SpecIdentity.from_dict(head_spec).values, **made_under.values})
        refused, _ = changes(made_under, identity)
        if refused:
            raise refuse(
                f"batch {to_batch}'s state was computed under another spec ({'; '.join(refused)}); "
                "rewind to batch 0 to recompute everything under this spec, or revert the spec"
            )
    _check_replay(pipeline, view, target.end_offsets, to_batch, refuse)
    following = view.committed_row(to_batch + 1)
    version = restorable_version(table, pipeline.state.path, target.state_version, following.state_version if following else None) if table else None
    # A version before the last removal of untracked files' floor may be losing its files now (`removal_floor`).
    floor = removal_floor(table) if table is not None else None
    if table is not None and (version is None or (floor is not None and version < floor)):
        oldest = oldest_rewindable(pipeline, view, table)
        raise refuse(
            f"batch {to_batch}'s state (version {target.state_version}) can no longer be restored: "
            f"`microbatch maintain` keeps batches {oldest}..{head.batch_id} rewindable and may have removed "
            f"this one's files (VACUUM, files no kept version names). Batches that can be rewound to: 0 and "
            f"{oldest}..{head.batch_id}. `maintenance.keep_batches` sets how many batches it keeps rewindable."
        )
    return version, target.end_offsets


def _check_replay(pipeline: Pipeline, view: LedgerView, start: dict[str, Any], to_batch: int, refuse: Callable[[str], RewindError]) -> None:
    """The new epoch reads again what the lineage's batches after
    `to_batch` read: the source must still give it, or the rewind would
    drop those records from the state for good (and a source that refuses
    lost data would leave the pipeline unable to plan at all)."""
    lineage = view.lineage()
    after = [pipeline.batch(row) for row in lineage if row.batch_id > to_batch]
    gaps = pipeline.source.replay_gaps(start, after)
    if gaps:
        oldest = _oldest_replayable(pipeline, lineage)
        raise refuse(
            f"cannot rewind to batch {to_batch}: the new epoch reads again what batches {to_batch + 1}.."
            f"{view.position.batch_id} read, and {gaps}. Nothing was changed. The source can still give "
            f"what follows batch {oldest} and later ones (if their state can be restored). To start over "
            "without those records, give the pipeline a new state path and a new checkpoint."
        )


def _oldest_replayable(pipeline: Pipeline, lineage: list[LedgerRow]) -> int:
    """The oldest batch of `lineage` after which the source still gives
    everything the later batches read (what it can give only shrinks from
    the oldest up: a binary search); the head, at worst."""
    batches = [pipeline.batch(row) for row in lineage]

    def replayable(i: int) -> bool:
        return pipeline.source.replay_gaps(lineage[i].end_offsets, batches[i + 1 :]) is None

    low, high = 0, len(lineage) - 1
    while low < high:
        mid = (low + high) // 2
        if replayable(mid):
            high = mid
        else:
            low = mid + 1
    return lineage[low].batch_id if lineage else 0


def check_rewind(spec: PipelineSpec, to_batch: int) -> None:
    """Raise `RewindError` if a rewind of `spec` to `to_batch` would be
    refused for its target. Read-only: what the console asks before it
    triggers a rewinding run."""
    pipeline = Pipeline(spec)
    rewind_target(pipeline, pipeline.ledger.load(), pipeline.state.open(), to_batch, SpecIdentity.of(spec))

def _rewind_ledger_only(
    pipeline: Pipeline, view: LedgerView, new: Position, identity: SpecIdentity, run_id: str, started: float
) -> BatchOutcome:
    """A rewind to 0 before any state commit: only a plan was made, so the
    ledger alone records the new epoch (the missing state is its empty state)."""
    origin = pipeline.source.origin.to_dict()
    pipeline.source.rewinding(origin)
    row = LedgerRow(
        epoch=new.epoch,
        batch_id=0,
        status=RowStatus.REWOUND,
        pipeline=pipeline.spec.name,
        start_offsets=origin,
        end_offsets=origin,
        pipeline_id=view.pipeline_id,
        spec=identity.to_dict(),
        spec_fingerprint=identity.fingerprint,
        run_id=run_id,
        committed_at=utcnow(),
    )
    with storage_errors(f"pipeline {pipeline.spec.name}: could not record the rewind in the offset ledger", pipeline.ledger.path):
        if not pipeline.ledger.append(view, row, COMMIT_FENCE):
            raise ConcurrentRunError(
                f"pipeline {pipeline.spec.name}: the ledger moved while rewinding; run the rewind again", pipeline=pipeline.spec.name
            )
    return _rewound(pipeline.spec, view.position, new, origin, None, run_id, started)


def _rewound(
    spec: PipelineSpec, head: Position, new: Position, end_offsets: dict[str, Any], state_version: int | None, run_id: str, started: float
) -> BatchOutcome:
    return BatchOutcome(
        status=Outcome.REWOUND,
        pipeline=spec.name,
        message=f"rewound from {head} to batch {new.batch_id}: epoch {new.epoch} continues from {end_offsets}",
        run_id=run_id,
        epoch=new.epoch,
        batch_id=new.batch_id,
        end_offsets=end_offsets,
        state_version=state_version,
        duration_ms=int((time.monotonic() - started) * 1000),
    )
