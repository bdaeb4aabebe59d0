"""What a pipeline's history depends on: its id, and the spec that made it.

A state is the fold of every batch in its lineage under one meaning: the
same keys, merge rules, source and transform. Change one of them silently
and the next batch is merged under another meaning (a `sum` becomes a
`max` over old totals; keys `[user_id, day]` become `[user_id]` and old rows
stop matching). So every ledger row and state commit records the spec's
`SpecIdentity` and its short fingerprint, and a run compares the current
spec with the one that produced the lineage's last batch before it writes:

* incompatible (refused, exit 2): keys changed, a merge rule changed, a
  merge column removed or renamed, the source's type, location or format
  changed, a source column removed or its type narrowed, the state moved;
* compatible (recorded, the run goes on): a new transform text, a new merge
  column (the state gains it; old rows hold null), a new source column or a
  widened source type.

The pipeline id is a random id minted by the first run's plan and carried by
every ledger row and state commit after it. Names are not identities: two
specs named alike with their own checkpoints but one state table must not
take each other's batches for their own.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from spark_jobs.core.spec import PipelineSpec

__all__ = ["SpecIdentity", "changes", "new_pipeline_id"]

#: Source types that only ever widen along these chains (Spark casts up without loss).
_WIDENING = (("TINYINT", "SMALLINT", "INT", "BIGINT"), ("FLOAT", "DOUBLE"))
_DECIMAL = re.compile(r"DECIMAL\((\d+),(\d+)\)")


def new_pipeline_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class SpecIdentity:
    """The parts of a spec that give the state its meaning."""

    keys: tuple[str, ...]
    merge: dict[str, str]
    source: dict[str, Any]  # type, location, format, schema: [[name, type, nullable], ...]
    state: str
    transform: str

    @classmethod
    def of(cls, spec: PipelineSpec) -> SpecIdentity:
        return cls(
            keys=tuple(spec.state.keys),
            merge=dict(spec.state.merge),
            source={
                "type": spec.source.type,
                "location": spec.source_path,
                "format": spec.source.format,
                "schema": [[f.name, f.type, f.nullable] for f in spec.source.fields],
            },
            state=spec.state_path,
            transform=spec.transform.strip(),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "merge": self.merge, "source": self.source, "state": self.state, "transform": self.transform}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecIdentity:
        return cls(tuple(data["keys"]), dict(data["merge"]), dict(data["source"]), data["state"], data["transform"])

    @property
    def fingerprint(self) -> str:
        """16 hex digits of a hash of the canonical identity: equal specs, equal fingerprints."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def changes(old: SpecIdentity, new: SpecIdentity) -> tuple[list[str], list[str]]:
    """(incompatible, compatible) differences from `old` to `new`, each a phrase for people."""
    refused: list[str] = []
    allowed: list[str] = []
    if old.keys != new.keys:
        refused.append(f"state.keys changed from {list(old.keys)} to {list(new.keys)}")
    for column, rule in old.merge.items():
        if column not in new.merge:
            refused.append(f"merge column {column!r} ({rule}) was removed or renamed")
        elif new.merge[column] != rule:
            refused.append(f"merge rule of {column!r} changed from {rule} to {new.merge[column]}")
    allowed += [f"new merge column {c!r} ({r}): old rows hold null" for c, r in new.merge.items() if c not in old.merge]
    for part in ("type", "location", "format"):
        if old.source[part] != new.source[part]:
            refused.append(f"source {part} changed from {old.source[part]!r} to {new.source[part]!r}")
    old_fields = {name: kind for name, kind, _ in old.source["schema"]}
    new_fields = {name: kind for name, kind, _ in new.source["schema"]}
    for name, kind in old_fields.items():
        if name not in new_fields:
            refused.append(f"source column {name!r} was removed or renamed")
        elif new_fields[name] != kind:
            change = f"source column {name!r} changed type from {kind} to {new_fields[name]}"
            (allowed if _widens(kind, new_fields[name]) else refused).append(change)
    allowed += [f"new source column {n!r}" for n in new_fields if n not in old_fields]
    if old.state != new.state:
        refused.append(f"state.path changed from {old.state} to {new.state}")
    if old.transform != new.transform:
        allowed.append("new transform text")
    return refused, allowed


def _widens(old: str, new: str) -> bool:
    """Whether every value of type `old` is a value of type `new`."""
    for chain in _WIDENING:
        if old in chain and new in chain:
            return chain.index(new) > chain.index(old)
    a, b = _DECIMAL.fullmatch(old), _DECIMAL.fullmatch(new)
    if a and b:
        (p1, s1), (p2, s2) = (int(x) for x in a.groups()), (int(x) for x in b.groups())
        return s2 >= s1 and p2 - s2 >= p1 - s1
    return False
