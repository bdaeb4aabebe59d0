"""What a run did: the outcome the CLI prints and Airflow returns as XCom."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

__all__ = ["BatchOutcome", "Outcome"]


class Outcome(StrEnum):
    """How a run ended, when it did not raise. Distinct from a ledger row's
    status (`spark_jobs.core.ledger.RowStatus`), which records events."""

    COMMITTED = "committed"  # this run committed a batch
    NO_NEW_DATA = "no_new_data"  # nothing waited (within the run's bound)
    ALREADY_COMMITTED = "already_committed"  # another run committed the batch, or rewound the pipeline, first
    DRY_RUN = "dry_run"  # planned and shown, nothing written
    REWOUND = "rewound"  # a rewind moved the pipeline to an earlier batch in a new epoch


@dataclass(frozen=True)
class BatchOutcome:
    status: Outcome
    pipeline: str
    message: str
    run_id: str
    epoch: int | None = None
    batch_id: int | None = None
    start_offsets: dict[str, Any] | None = None
    end_offsets: dict[str, Any] | None = None
    #: What the batch read, named for people (file names for a files source).
    inputs: tuple[str, ...] = ()
    records_in: int | None = None
    records_quarantined: int | None = None
    #: Event time: records older than the batch's watermark, and the watermark it left.
    records_late: int | None = None
    watermark: datetime | None = None
    #: Duplicates: the records the batch dropped as such (`dedup`).
    records_duplicate: int | None = None
    keys_updated: int | None = None
    state_version: int | None = None
    duration_ms: int | None = None
    #: Milliseconds in each protocol step the run went through (reconcile,
    #: plan, engine_start, read, commit, project): where a batch's time goes.
    steps_ms: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = str(self.status)
        out["inputs"] = list(self.inputs)
        out["watermark"] = self.watermark.isoformat() if self.watermark else None
        return out
