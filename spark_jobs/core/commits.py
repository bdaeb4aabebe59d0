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
import types
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any, get_origin, get_type_hints

from spark_jobs.core.fencing import Position
from spark_jobs.errors import NewerFormatError

__all__ = ["FORMAT_VERSION", "METADATA_KEY", "RECORD_FIELDS", "BatchRecord", "CommitKind", "CommitMetadata", "RecordField", "StateCommit"]

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
    #: Event time (`spark_jobs.core.event_time`): the watermark after this
    #: batch, and how many of its records were late; None without `event_time`.
    watermark: datetime | None = None
    records_late: int | None = None
    #: Duplicates (`spark_jobs.core.dedup`): the records this batch dropped
    #: as such; None without `dedup`.
    records_duplicate: int | None = None

    def record(self) -> dict[str, Any]:
        """These fields alone, to carry them from one record to the other."""
        return {f.name: getattr(self, f.name) for f in fields(BatchRecord)}

    def encoded(self) -> dict[str, Any]:
        """These fields as JSON values (timestamps as ISO text)."""
        return {f.name: f.encode(getattr(self, f.name)) for f in RECORD_FIELDS}

    @staticmethod
    def decoded(data: dict[str, Any]) -> dict[str, Any]:
        """These fields from JSON values (`encoded`'s, or a ledger row's with
        its JSON columns parsed); a field an older record lacks reads as None
        (an empty object where the field is not optional)."""
        return {f.name: f.decode(data.get(f.name)) for f in RECORD_FIELDS}


@dataclass(frozen=True)
class RecordField:
    """One `BatchRecord` field and the kind of value it holds, read from its
    annotation, so that the commit metadata's JSON and the ledger's columns
    are both derived from the one declaration above."""

    name: str
    #: `str`, `int`, `datetime` or `dict` (a JSON object).
    kind: type
    optional: bool

    def encode(self, value: Any) -> Any:
        return value.isoformat() if self.kind is datetime and value is not None else value

    def decode(self, value: Any) -> Any:
        if self.kind is datetime and isinstance(value, str):  # JSON's ISO text; Arrow gives datetimes
            return datetime.fromisoformat(value)
        if self.kind is dict and not self.optional:
            return value or {}
        return value


def _record_fields() -> tuple[RecordField, ...]:
    hints = get_type_hints(BatchRecord)
    out = []
    for f in fields(BatchRecord):
        hint = hints[f.name]
        args = hint.__args__ if isinstance(hint, types.UnionType) else (hint,)
        (kind,) = [get_origin(a) or a for a in args if a is not type(None)]
        out.append(RecordField(f.name, kind, optional=type(None) in args))
    return tuple(out)


#: The batch record's fields, in declaration order.
RECORD_FIELDS = _record_fields()


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
        return {
            "format_version": self.format_version,
            "kind": str(self.kind),
            "txn": self.position.encode(),
            "epoch": self.position.epoch,
            "batch_id": self.position.batch_id,
            **self.encoded(),
            "commit_token": self.commit_token,
            "rewound_from": self.rewound_from,
            "restored_version": self.restored_version,
        }

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
            **cls.decoded(data),
            kind=CommitKind(data["kind"]),
            position=Position(int(data["epoch"]), int(data["batch_id"])),
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
        """Keys the commit inserted or updated (delta-rs's MERGE metrics, or
        delta-spark's; an empty batch's append adds none)."""
        m = self.operation_metrics
        if "numTargetRowsInserted" in m:
            return m["numTargetRowsInserted"] + m.get("numTargetRowsUpdated", 0)
        return m.get("num_target_rows_inserted", m.get("num_added_rows", 0)) + m.get("num_target_rows_updated", 0)

