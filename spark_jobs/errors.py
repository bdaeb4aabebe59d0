"""Exceptions that carry the context a user needs to act on them.

Every error raised on purpose by the job derives from `MicrobatchError`; the
CLI prints its message (no traceback) and exits non-zero. Messages say what
went wrong *and* what to do about it.
"""

from __future__ import annotations


class MicrobatchError(Exception):
    """Base class for errors the job raises deliberately."""

    #: Whether retrying the same run may succeed (the orchestrator uses this to
    #: decide between a normal retry and failing fast).
    retryable: bool = False


class SpecError(MicrobatchError):
    """The pipeline spec is invalid. Raised before anything is read or written."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid pipeline spec {path}:\n{lines}")


class TransformError(MicrobatchError):
    """The transform SQL failed or returned a result that cannot be merged."""


class ComputeError(MicrobatchError):
    """The compute engine failed for a reason that is not the spec's fault."""

    retryable = True


class SourceError(MicrobatchError):
    """The source cannot be read (e.g. an unreadable file). Nothing is consumed."""

    retryable = True


class StateLedgerMismatchError(MicrobatchError):
    """The state table and the offset ledger do not describe the same history.

    Raised before anything is written; a retry meets the same tables, so it is
    not retryable. Raised as such when the ledger is not this state's (see the
    message); the subclasses say what else is wrong and how to repair it.
    """


class StateBehindLedgerError(StateLedgerMismatchError):
    """The state table is older than the ledger says it should be."""

    def __init__(self, pipeline: str, ledger_txn: str, state_txn: str, *, missing: bool = False) -> None:
        self.pipeline = pipeline
        if missing:
            message = (
                f"pipeline {pipeline!r}: there is no state table, but the offset ledger has "
                f"committed {ledger_txn}. If the state was moved or deleted on purpose to start "
                "over, give the pipeline a new checkpoint as well (the ledger and quarantine "
                "belong to the old state); otherwise put the state table back."
            )
        else:
            message = (
                f"pipeline {pipeline!r}: the state table is at {state_txn} but the offset "
                f"ledger has committed {ledger_txn}. Someone restored, replaced or deleted "
                "the state table outside `microbatch`. Use `microbatch rewind SPEC "
                "--to-batch K` to a batch the state still holds, or restore the table."
            )
        super().__init__(message)


class StateChangedOutsideError(StateLedgerMismatchError):
    """A commit not made by `microbatch` changed the state's data (a manual
    RESTORE, DELETE, UPDATE, MERGE or write), so the ledger no longer says
    which records the state holds."""

    def __init__(self, pipeline: str, path: str, changes: list[tuple[int, str]], head: str, last_batch: int) -> None:
        self.pipeline = pipeline
        self.changes = changes
        listed = ", ".join(f"version {v} ({op})" for v, op in changes)
        super().__init__(
            f"pipeline {pipeline!r}: the state table {path} was changed outside `microbatch` at "
            f"{listed}, after {head}. Continuing would count records the change removed as "
            "processed (or records it added as input). Undo it with `microbatch rewind SPEC "
            f"--to-batch {last_batch}` (or an earlier batch K): the state is restored to what "
            "that batch committed and the batches after it are replayed. Rewind is also the way "
            "to go back in time; a Delta RESTORE of the state is not."
        )


class ConcurrentRunError(MicrobatchError):
    """Another writer moved a table between our read and our commit, and it was
    not a run of this pipeline committing the same batch. Retrying is safe."""

    retryable = True


class StorageError(MicrobatchError):
    """A Delta table write failed in the storage layer (disk full, I/O error).

    Raised with the table's path and what the run was doing. Retrying is safe:
    a Delta commit either landed whole or not at all, and the next run finds
    out which (see `spark_jobs.delta_io.storage_errors`).
    """

    retryable = True


class RewindError(MicrobatchError):
    """A rewind request cannot be carried out."""
