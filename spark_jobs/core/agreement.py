"""Whether a pipeline can go on from where its tables stand: the state and
the offset ledger agree, the state changed only through the job, and the
spec still means what it meant for the ledger's head.

Read-only judgements: the protocol's steps 1 and 2 (`spark_jobs.core.protocol`)
act on them, and `status` (`spark_jobs.core.inspect`) reports them without
writing anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from spark_jobs.core.commits import CommitKind, StateCommit
from spark_jobs.core.fencing import Position
from spark_jobs.core.identity import SpecIdentity, changes
from spark_jobs.core.ledger import LedgerView
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.errors import SpecChangedError, StateBehindLedgerError, StateChangedOutsideError, StateLedgerMismatchError

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["check_spec", "check_unchanged", "lagging_commit"]

log = logging.getLogger("microbatch")


def lagging_commit(pipeline: Pipeline, view: LedgerView, table: DeltaTable | None, state_at: Position) -> StateCommit | None:
    """The state commit the ledger lags behind, None if the two agree.

    Raises `StateLedgerMismatchError` (or its subclasses) when they do not
    belong together; reads only, so `status` can say what a run would find.
    """
    if view.agrees(state_at):
        check_unchanged(pipeline, view, table)
        return None
    if state_at < view.position:
        raise StateBehindLedgerError(pipeline.spec.name, view.position, state_at, missing=table is None)
    commit = pipeline.state.find_commit(table, state_at) if table is not None else None
    if commit is None:
        raise StateLedgerMismatchError(
            f"pipeline {pipeline.spec.name}: the state table is at {state_at} but its commit is not "
            f"in the last versions of {pipeline.state.path}'s history; the ledger cannot be repaired "
            "automatically. Rewind to a batch in the ledger with `microbatch rewind`.",
            pipeline=pipeline.spec.name,
            path=pipeline.state.path,
            position=state_at,
        )
    problem = _why_not_following(pipeline, view, state_at, commit)
    if problem is not None:
        raise StateLedgerMismatchError(problem, pipeline=pipeline.spec.name, path=pipeline.state.path, position=state_at)
    if commit.metadata.kind is CommitKind.BATCH:
        # A change made outside the job before the lagging batch would be
        # hidden by projecting it; one made after it is found once the row is
        # recorded. (A rewind replaces whatever was there with a version the
        # ledger knows: it is the repair.)
        check_unchanged(pipeline, view, table, before_version=commit.version)
    return commit


def _why_not_following(pipeline: Pipeline, view: LedgerView, state_at: Position, commit: StateCommit) -> str | None:
    """Why the state commit at `state_at` does not directly follow the ledger's head, or None.

    A run commits the state only from the ledger's head, and a rewind only
    one epoch up, so the ledger can lag the state by one event at most. A
    state further ahead, or one committed by another pipeline, means the
    ledger is not this state's (the checkpoint was deleted or replaced,
    the pipeline renamed, or the state table shared): recording just the
    latest commit would make the next runs re-read everything before it. A
    batch commit must also match a ``planned`` row of this ledger with the
    same pipeline id: names alone cannot tell two pipelines apart.
    """
    head = view.position
    m = commit.metadata
    if m.kind is CommitKind.REWIND:
        follows = state_at.epoch == head.epoch + 1 and state_at.batch_id <= head.batch_id
        ours = _same_id(m.pipeline_id, view.pipeline_id)
    else:
        # A run commits only what it planned first, in this ledger, under this id.
        follows = state_at == head.next()
        planned = view.planned(state_at)
        ours = planned is not None and _same_id(m.pipeline_id, planned.pipeline_id)
    if m.pipeline == pipeline.spec.name and follows and ours:
        return None
    return (
        f"pipeline {pipeline.spec.name}: the state table {pipeline.state.path} is at {state_at} (committed by pipeline "
        f"{m.pipeline!r}, id {m.pipeline_id or 'unknown'}), which does not follow {head} in the offset "
        f"ledger {pipeline.ledger.path} (pipeline id {view.pipeline_id or 'not minted yet'}). The "
        "ledger is not this state's: its checkpoint was deleted or replaced, the pipeline was renamed, "
        "or another pipeline writes the same state table. Nothing was written. Point `checkpoint` back "
        "at the folder that belongs to this state, or give the pipeline a new state path and a new "
        "checkpoint to start over."
    )


def _same_id(a: str | None, b: str | None) -> bool:
    """Ids match, or one side predates ids (format 1) and only the name can tell."""
    return a is None or b is None or a == b


def check_unchanged(pipeline: Pipeline, view: LedgerView, table: DeltaTable | None, before_version: int | None = None) -> None:
    """Refuse a state whose data changed outside the job since the ledger's head.

    A Delta RESTORE (or DELETE, ...) of the state does not move the fence
    (RESTORE leaves `txn` alone), so the positions still agree; only the
    history shows it.
    """
    head = view.head
    if table is None or head is None or head.state_version is None:
        return
    changes = pipeline.state.outside_changes(table, head.state_version, before_version)
    if changes:
        raise StateChangedOutsideError(pipeline.spec.name, pipeline.state.path, changes, view.position)


def check_spec(pipeline: Pipeline, view: LedgerView) -> SpecIdentity:
    """The spec's identity, if the lineage can carry on under it; else `SpecChangedError`.

    Compared with the spec that made the ledger's head (the last committed
    batch or rewind). Compatible changes are logged and recorded by the next
    row; see `spark_jobs.core.identity`.
    """
    identity = SpecIdentity.of(pipeline.spec)
    head = view.head
    if head is None or head.spec is None or head.spec_fingerprint == identity.fingerprint:
        return identity
    refused, allowed = changes(SpecIdentity.from_dict(head.spec), identity)
    if refused:
        listed = "\n".join(f"  - {c}" for c in refused)
        raise SpecChangedError(
            f"pipeline {pipeline.spec.name}: the spec changed since {head.position} (spec {head.spec_fingerprint}, now "
            f"{identity.fingerprint}) in ways the state cannot carry on from:\n{listed}\n"
            "Nothing was written. Either revert the spec; or recompute from the start under the new spec "
            f"with `microbatch rewind {pipeline.spec.spec_path} --to-batch 0` (a new epoch that reads the source "
            "again from its start: the rewind checks the source still has it, and refuses otherwise); or give the "
            "pipeline a new state path and a new checkpoint.",
            pipeline=pipeline.spec.name,
            path=pipeline.spec.spec_path,
            position=head.position,
        )
    for change in allowed:
        log.info("spec change since %s, recorded with the next batch: %s", head.position, change)
    return identity
