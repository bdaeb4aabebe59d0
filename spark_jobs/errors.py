"""Exceptions that carry the context a user needs to act on them, and the
one policy that says what each kind of failure means.

Every error raised on purpose by the job derives from `MicrobatchError` and
from exactly one of two mixins, which decide everything an orchestrator
needs to know:

* `Terminal`: retrying meets the same spec, tables or request and fails the
  same way; a person must act (the message says how). The CLI exits 2 and
  Airflow fails the task at once, without retries.
* `Transient`: retrying is safe (the commit protocol makes every retry
  exactly-once) and may succeed: a lost race, a storage hiccup, a stop
  request. The CLI exits 1 and Airflow's retries apply.

`exit_code` and `is_retryable` read that off the class, so the CLI and the
operator cannot disagree. Errors carry the pipeline, the path and the
position they concern as attributes, not only in the message text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spark_jobs.core.fencing import Position

__all__ = [
    "EXIT_OK",
    "EXIT_RETRYABLE",
    "EXIT_TERMINAL",
    "ComputeError",
    "ConcurrentRunError",
    "InternalError",
    "MergeOverflowError",
    "MicrobatchError",
    "NewerFormatError",
    "ResultTooLargeError",
    "QuarantineLimitError",
    "RewindError",
    "SourceChangedError",
    "SourceError",
    "SpecChangedError",
    "SpecError",
    "StateBehindLedgerError",
    "StateChangedOutsideError",
    "StateLedgerMismatchError",
    "StorageError",
    "Terminal",
    "Terminated",
    "TransformError",
    "Transient",
    "exit_code",
    "first_line",
    "is_retryable",
]

#: Exit codes of the `microbatch` command.
EXIT_OK, EXIT_RETRYABLE, EXIT_TERMINAL = 0, 1, 2


class MicrobatchError(Exception):
    """Base class for errors the job raises deliberately (always with `Terminal` or `Transient`)."""

    def __init__(
        self, message: str, *, pipeline: str | None = None, path: str | None = None, position: Position | None = None
    ) -> None:
        super().__init__(message)
        #: The pipeline concerned, the table or file, and the batch position, where known.
        self.pipeline = pipeline
        self.path = path
        self.position = position


class Terminal:
    """Mixin: retrying cannot help; fix what the message names, then run again."""


class Transient:
    """Mixin: retrying is safe and may succeed."""


def is_retryable(exc: BaseException) -> bool:
    """Whether an orchestrator should retry after `exc`.

    Unexpected exceptions (not ours) are retried: the protocol makes a retry
    safe, and a bug that fails every time still ends in a failed task.
    """
    return not isinstance(exc, Terminal)


def exit_code(exc: BaseException) -> int:
    """The `microbatch` command's exit code for a run that raised `exc`."""
    return EXIT_RETRYABLE if is_retryable(exc) else EXIT_TERMINAL


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's text (engines' messages run for pages), cut to `limit`."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


class SpecError(Terminal, MicrobatchError):
    """The pipeline spec is invalid. Raised before anything is read or written."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid pipeline spec {path}:\n{lines}", path=path)


class TransformError(Terminal, MicrobatchError):
    """The transform SQL failed or returned a result that cannot be merged."""


class ResultTooLargeError(Terminal, MicrobatchError):
    """A batch's result was to come back to the job's process and is bigger
    than Spark lets one (``spark.driver.maxResultSize``). A retry meets the
    same size: the message names the setting that writes it by the executors."""


class SpecChangedError(Terminal, MicrobatchError):
    """The spec changed in a way the pipeline's history cannot carry on from
    (keys, a merge rule, the source's identity, a state column): continuing
    would mix two meanings in one state. Raised before anything is written."""


class MergeOverflowError(Terminal, MicrobatchError):
    """Merging a batch would overflow a state column (a wrapped integer, a
    decimal past its precision, or an infinity from finite values). Nothing
    is committed; the message names the key, column, values and remedy."""


class SourceChangedError(Terminal, MicrobatchError):
    """A planned input changed between the plan and its replay (a file was
    rewritten or removed), so the replay cannot read what was planned."""


class SourceRefusedError(Terminal, MicrobatchError):
    """The source holds something the spec cannot read as asked (a Delta
    table without its change feed, a version that is not an append); a
    person must change the spec or the source."""


class DataLossError(Terminal, MicrobatchError):
    """Source data the pipeline has not consumed is gone (retention, a log
    cleanup); `source.on_data_loss: skip` goes on without it."""


class NewerFormatError(Terminal, MicrobatchError):
    """A ledger row or state commit was written by a newer microbatch, whose
    format this version cannot read safely."""

    def __init__(self, what: str, found: int, supported: int, *, pipeline: str | None = None, path: str | None = None) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            f"{what} was written in format version {found} by a newer microbatch; this one reads "
            f"up to version {supported}. Upgrade microbatch; nothing was written.",
            pipeline=pipeline,
            path=path,
        )


class ComputeError(Transient, MicrobatchError):
    """The compute engine failed for a reason that is not the spec's fault."""


class SourceError(Transient, MicrobatchError):
    """The source cannot be read (e.g. an unreadable file). Nothing is consumed."""


class StateLedgerMismatchError(Terminal, MicrobatchError):
    """The state table and the offset ledger do not describe the same history.

    Raised before anything is written; a retry meets the same tables. Raised
    as such when the ledger is not this state's (see the message); the
    subclasses say what else is wrong and how to repair it.
    """


class StateBehindLedgerError(StateLedgerMismatchError):
    """The state table is older than the ledger says it should be."""

    def __init__(self, pipeline: str, ledger_at: Position, state_at: Position, *, missing: bool = False) -> None:
        self.state_at = state_at
        if missing:
            message = (
                f"pipeline {pipeline!r}: there is no state table, but the offset ledger has "
                f"committed {ledger_at}. If the state was moved or deleted on purpose to start "
                "over, give the pipeline a new checkpoint as well (the ledger and quarantine "
                "belong to the old state); otherwise put the state table back."
            )
        else:
            message = (
                f"pipeline {pipeline!r}: the state table is at {state_at} but the offset "
                f"ledger has committed {ledger_at}. Someone restored, replaced or deleted "
                "the state table outside `microbatch`. Use `microbatch rewind SPEC "
                "--to-batch K` to a batch the state still holds, or restore the table."
            )
        super().__init__(message, pipeline=pipeline, position=ledger_at)


class StateChangedOutsideError(StateLedgerMismatchError):
    """A commit not made by `microbatch` changed the state's data (a manual
    RESTORE, DELETE, UPDATE, MERGE or write), so the ledger no longer says
    which records the state holds."""

    def __init__(self, pipeline: str, path: str, changes: list[tuple[int, str]], head: Position) -> None:
        self.changes = changes
        listed = ", ".join(f"version {v} ({op})" for v, op in changes)
        super().__init__(
            f"pipeline {pipeline!r}: the state table {path} was changed outside `microbatch` at "
            f"{listed}, after {head}. Continuing would count records the change removed as "
            "processed (or records it added as input). Undo it with `microbatch rewind SPEC "
            f"--to-batch {head.batch_id}` (or an earlier batch K): the state is restored to what "
            "that batch committed and the batches after it are replayed. Rewind is also the way "
            "to go back in time; a Delta RESTORE of the state is not.",
            pipeline=pipeline,
            path=path,
            position=head,
        )


class ConcurrentRunError(Transient, MicrobatchError):
    """Another writer moved a table between our read and our commit, and it was
    not a run of this pipeline committing the same batch. Retrying is safe."""


class StorageError(Transient, MicrobatchError):
    """A Delta table write failed in the storage layer (disk full, I/O error).

    Raised with the table's path and what the run was doing. Retrying is safe:
    a Delta commit either landed whole or not at all, and the next run finds
    out which (see `spark_jobs.core.delta_io.storage_errors`).
    """


class Terminated(Transient, MicrobatchError):
    """The run stopped at a protocol boundary because SIGTERM asked it to
    (see `spark_jobs.core.shutdown`). The next run resumes from there."""


class InternalError(Terminal, MicrobatchError):
    """A failure in this project's own code, which a retry replays the same
    way (the batch's plan, records and code are the same): the message says
    where, and how to get the pipeline going while it is fixed."""


class RewindError(Terminal, MicrobatchError):
    """A rewind request cannot be carried out."""


class QuarantineLimitError(Terminal, MicrobatchError):
    """A committed batch quarantined more than the spec's `quarantine` limits
    allow (`on_exceed: fail`). The batch stays committed (its bad records
    are in the quarantine table, and the next run starts after it); the run
    fails so that someone looks, and retrying would not un-quarantine them."""

    def __init__(self, pipeline: str, position: Position, quarantined: int, records: int, limit: str, path: str) -> None:
        self.quarantined, self.records = quarantined, records
        super().__init__(
            f"pipeline {pipeline}: {position} committed, but it quarantined {quarantined:,} of its {records:,} "
            f"records, over {limit}. They are in the quarantine table {path} with file, line and reason (the "
            "console's batch view lists them); fix the source or the spec: the next run goes on after this batch",
            pipeline=pipeline,
            path=path,
            position=position,
        )
