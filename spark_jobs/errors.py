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


class StateBehindLedgerError(MicrobatchError):
    """The state table is older than the ledger says it should be."""

    def __init__(self, pipeline: str, ledger_txn: str, state_txn: str) -> None:
        self.pipeline = pipeline
        super().__init__(
            f"pipeline {pipeline!r}: the state table is at {state_txn} but the offset "
            f"ledger has committed {ledger_txn}. Someone restored, replaced or deleted "
            "the state table outside `microbatch`. Use `microbatch rewind SPEC "
            "--to-batch K` to a batch the state still holds, or restore the table."
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
