"""The quarantine table: records that failed parsing or validation.

One append per batch, fenced so that a replay of the same batch (a retry, or
a second run racing the first) does not write its records twice
(`spark_jobs.core.batch_append`). Rows carry the epoch and batch id: after a
rewind, the records quarantined by the abandoned batches stay for audit,
and the live ones are those whose (epoch, batch_id) is in the ledger's
lineage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from spark_jobs.core.batch_append import BatchAppend
from spark_jobs.core.fencing import QUARANTINE_FENCE, Position
from spark_jobs.core.ledger import POSITION_COLUMNS, utcnow
from spark_jobs.errors import QuarantineLimitError

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


class Quarantine(BatchAppend):
    """The quarantine table of one pipeline (`spec.quarantine_path`): one
    batch's records (QUARANTINE_COLUMNS, or the files the executors wrote
    with their positions) appended once (`BatchAppend.write`)."""

    what = "quarantine"
    schema = SCHEMA

    def __init__(self, path: str, pipeline: str, untracked_hours: float) -> None:
        super().__init__(path, pipeline, untracked_hours, QUARANTINE_FENCE)

    def rows(self, data: pa.Table, position: Position) -> pa.Table:
        n = data.num_rows
        columns = {name: data.column(name) for name in ("file", "line", "raw", "reason")}
        stamped = {"quarantined_at": pa.array([utcnow()] * n, pa.timestamp("us", tz="UTC"))}
        return pa.table({**self.positioned(n, position), **columns, **stamped}, schema=SCHEMA)


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
