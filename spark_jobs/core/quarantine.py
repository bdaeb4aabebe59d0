"""The quarantine table: records that failed parsing or validation.

One append per batch, fenced so that a replay of the same batch (a retry, or
a second run racing the first) does not write its records twice. Rows carry
the epoch and batch id: after a rewind, the records quarantined by the
abandoned batches stay for audit, and the live ones are those whose
(epoch, batch_id) is in the ledger's lineage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
from deltalake import write_deltalake

from spark_jobs.core.delta_io import ensure_table, is_commit_conflict
from spark_jobs.core.fencing import QUARANTINE_FENCE, Position, commit_properties, transaction_position
from spark_jobs.core.ledger import POSITION_COLUMNS, scoped, utcnow
from spark_jobs.core.staged import Staged, commit_files, require_written
from spark_jobs.errors import ConcurrentRunError, QuarantineLimitError

if TYPE_CHECKING:
    from spark_jobs.core.commits import BatchRecord
    from spark_jobs.core.outcome import BatchOutcome
    from spark_jobs.core.spec import PipelineSpec

__all__ = ["SCHEMA", "Quarantine", "over_limit"]

SCHEMA = pa.schema(
    [
        *POSITION_COLUMNS,
        ("file", pa.string()),
        ("line", pa.int64()),
        ("raw", pa.string()),
        ("reason", pa.string()),
        ("quarantined_at", pa.timestamp("us", tz="UTC")),
    ]
)

#: How often a batch's append is tried again after another commit with the
#: quarantine fence landed first (most likely the same batch's, by a racing
#: run: the next try sees it and writes nothing).
APPEND_TRIES = 3


class Quarantine:
    def __init__(self, path: str, pipeline: str, untracked_hours: float) -> None:
        self.path = path
        self.pipeline = pipeline
        self.fence = scoped(QUARANTINE_FENCE, pipeline)
        #: `maintenance.untracked_files_hours`: how old the executors' files may be when committed (`require_written`).
        self.untracked_hours = untracked_hours

    def write(self, records: pa.Table | Staged, position: Position) -> bool:
        """Append one batch's quarantined records, once. True if we wrote them.

        `records` may be files the executors wrote into the table's folder
        (bookkeeping columns included): then they are committed as they are."""
        for _ in range(APPEND_TRIES):
            table = ensure_table(self.path, SCHEMA, name=f"{self.pipeline} quarantine")
            if transaction_position(table, self.fence) >= position:
                # An earlier attempt at this batch wrote them. (Files of ours
                # stay: a store may report a failure for a commit of ours that
                # landed; `maintain` removes them if no commit names them.)
                return False
            props = commit_properties(self.fence, position, {"microbatch.event": "quarantine"})
            if isinstance(records, Staged):
                require_written(records.root, records.files, self.untracked_hours, f"pipeline {self.pipeline}: quarantine of {position}")
                try:
                    commit_files(table, records.files, table.schema(), props)
                    return True
                except Exception as exc:
                    if not is_commit_conflict(exc):
                        raise
                    continue  # (probably the same batch's, by a racing run: the next try sees it)
            n = records.num_rows
            rows = pa.table(
                {
                    "pipeline": pa.array([self.pipeline] * n, pa.string()),
                    "epoch": pa.array([position.epoch] * n, pa.int64()),
                    "batch_id": pa.array([position.batch_id] * n, pa.int64()),
                    "file": records.column("file"),
                    "line": records.column("line"),
                    "raw": records.column("raw"),
                    "reason": records.column("reason"),
                    "quarantined_at": pa.array([utcnow()] * n, pa.timestamp("us", tz="UTC")),
                },
                schema=SCHEMA,
            )
            try:
                write_deltalake(table, rows, mode="append", commit_properties=props)
                return True
            except Exception as exc:
                if not is_commit_conflict(exc):
                    raise
                # Someone else committed with the quarantine fence since our
                # snapshot: look again (it was probably the same batch).
        # Fail closed: committing the state without its quarantined records
        # would lose them.
        raise ConcurrentRunError(
            f"pipeline {self.pipeline}: could not write the quarantine for {position} "
            "(the table kept changing); nothing was committed, run again",
            pipeline=self.pipeline,
            path=self.path,
            position=position,
        )


def over_limit(spec: PipelineSpec, outcome: BatchOutcome | BatchRecord) -> QuarantineLimitError | None:
    """What a committed batch's quarantine crossed of the spec's `quarantine`
    limits (the error a run with `on_exceed: fail` raises after its commit,
    or whose text a `warn` logs), or None within them. `outcome`: a run's
    outcome, or a ledger row (an earlier attempt's batch)."""
    limits = spec.quarantine
    quarantined, records = outcome.records_quarantined or 0, outcome.records_in or 0
    if outcome.epoch is None or outcome.batch_id is None or not quarantined:
        return None
    crossed = None
    if limits.max_records is not None and quarantined > limits.max_records:
        crossed = f"quarantine.max_records ({limits.max_records:,})"
    elif limits.max_fraction is not None and records and quarantined / records > limits.max_fraction:
        crossed = f"quarantine.max_fraction ({limits.max_fraction:g}: {quarantined / records:.1%} of the batch)"
    if crossed is None:
        return None
    return QuarantineLimitError(
        spec.name, Position(outcome.epoch, outcome.batch_id), quarantined, records, crossed, spec.quarantine_path
    )
