"""What a state commit says about itself: typed, versioned commit metadata.

The state table's commit is the protocol's commit point, so it carries, in
Delta's commit info under the key `METADATA_KEY`, everything the ledger's
row for it needs: the position, the offsets and manifest, the run and its
metrics. `CommitMetadata` is that record, written by step 4 and by a rewind,
and read back by reconcile and status. It is versioned like Spark's offset
log (`OffsetSeqLog.validateVersion`): a reader refuses a version newer than
the one it knows, rather than misread it.

Offsets and manifests stay JSON objects here, as in the ledger: the storage
layer does not know sources. `spark_jobs.sources.base.Source.decode` turns
them into a source's own types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any

from spark_jobs.core.fencing import Position
from spark_jobs.errors import NewerFormatError

__all__ = ["FORMAT_VERSION", "METADATA_KEY", "BatchRecord", "CommitKind", "CommitMetadata", "StateCommit"]

#: The metadata format this code writes, and the newest it reads (2: pipeline
#: id and spec identity; version 1 commits have neither and are read as such).
FORMAT_VERSION = 2
#: Key of the commit info entry that makes a state commit self-describing.
METADATA_KEY = "microbatch"


class CommitKind(StrEnum):
    BATCH = "batch"  # a batch merged into the state (step 4)
    REWIND = "rewind"  # the state restored to an earlier batch, in a new epoch


@dataclass(frozen=True, kw_only=True)
class BatchRecord:
    """What a batch event records in the state's commit metadata and in the
    ledger row alike: its range, who ran it, its data interval, its counts."""

    pipeline: str
    start_offsets: dict[str, Any]
    end_offsets: dict[str, Any]
    #: Source-specific detail of the range (for files: which files).
    manifest: dict[str, Any] = field(default_factory=dict)
    #: The pipeline's id (`spark_jobs.core.identity`); None in records older than ids.
    pipeline_id: str | None = None
    #: The spec that made this batch: its `SpecIdentity` as a dict, and its fingerprint.
    spec: dict[str, Any] | None = None
    spec_fingerprint: str | None = None
    run_id: str | None = None
    attempt: int | None = None
    interval_start: datetime | None = None
    interval_end: datetime | None = None
    planned_at: datetime | None = None
    records_in: int | None = None
    records_quarantined: int | None = None
    duration_ms: int | None = None
    #: What still waited in the source after this batch when it was planned
    #: (`BatchRange.waiting_after`); None in records older than it.
    waiting_after: int | None = None

    def record(self) -> dict[str, Any]:
        """These fields alone, to carry them from one record to the other."""
        return {f.name: getattr(self, f.name) for f in fields(BatchRecord)}


@dataclass(frozen=True)
class CommitMetadata(BatchRecord):
    kind: CommitKind
    position: Position
    #: Tells a batch commit from any other at the same position (a store can
    #: report a failure for a commit that landed; see step 4).
    commit_token: str | None = None
    #: Rewinds: where the pipeline was, and the state version restored (None: empty).
    rewound_from: str | None = None
    restored_version: int | None = None
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "kind": str(self.kind),
            "pipeline": self.pipeline,
            "txn": self.position.encode(),
            "epoch": self.position.epoch,
            "batch_id": self.position.batch_id,
            "start_offsets": self.start_offsets,
            "end_offsets": self.end_offsets,
            "run_id": self.run_id,
            "pipeline_id": self.pipeline_id,
            "spec": self.spec,
            "spec_fingerprint": self.spec_fingerprint,
        }
        if self.kind is CommitKind.BATCH:
            out.update(
                manifest=self.manifest,
                attempt=self.attempt,
                records_in=self.records_in,
                records_quarantined=self.records_quarantined,
                interval_start=_iso(self.interval_start),
                interval_end=_iso(self.interval_end),
                planned_at=_iso(self.planned_at),
                duration_ms=self.duration_ms,
                waiting_after=self.waiting_after,
                commit_token=self.commit_token,
            )
        else:
            out.update(rewound_from=self.rewound_from, restored_version=self.restored_version)
        return out

    def to_json(self) -> str:
        """The text stored in the commit info."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str) -> CommitMetadata:
        """Read metadata back; `where` names the commit in errors (table and version)."""
        version = int(data.get("format_version") or 1)
        if version > FORMAT_VERSION:
            raise NewerFormatError(f"the state commit {where}", version, FORMAT_VERSION, pipeline=data.get("pipeline"))
        return cls(
            kind=CommitKind(data["kind"]),
            pipeline=data["pipeline"],
            position=Position(int(data["epoch"]), int(data["batch_id"])),
            start_offsets=data.get("start_offsets") or {},
            end_offsets=data.get("end_offsets") or {},
            run_id=data.get("run_id"),
            manifest=data.get("manifest") or {},
            pipeline_id=data.get("pipeline_id"),
            spec=data.get("spec"),
            spec_fingerprint=data.get("spec_fingerprint"),
            attempt=data.get("attempt"),
            records_in=data.get("records_in"),
            records_quarantined=data.get("records_quarantined"),
            interval_start=_parse_iso(data.get("interval_start")),
            interval_end=_parse_iso(data.get("interval_end")),
            planned_at=_parse_iso(data.get("planned_at")),
            duration_ms=data.get("duration_ms"),
            waiting_after=data.get("waiting_after"),
            commit_token=data.get("commit_token"),
            rewound_from=data.get("rewound_from"),
            restored_version=data.get("restored_version"),
            format_version=version,
        )


@dataclass(frozen=True)
class StateCommit:
    """A state commit made by this job, read back from the table's history."""

    version: int
    metadata: CommitMetadata
    operation_metrics: dict[str, int]
    timestamp: datetime

    @property
    def keys_updated(self) -> int:
        """Keys the commit inserted or updated (delta-rs's MERGE metrics; an empty batch's append adds none)."""
        m = self.operation_metrics
        return m.get("num_target_rows_inserted", m.get("num_added_rows", 0)) + m.get("num_target_rows_updated", 0)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _parse_iso(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None
