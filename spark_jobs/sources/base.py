"""What every source hands to the protocol: a batch's range."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BatchRange:
    """Exactly which source records one batch covers.

    `start_offsets` / `end_offsets` are small JSON objects (one entry per
    source partition) such that batch N's start equals batch N-1's end.
    `manifest` holds whatever detail the source needs to re-read the range
    deterministically (for files: the list of files).
    """

    start_offsets: dict[str, Any]
    end_offsets: dict[str, Any]
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def uris(self) -> list[str]:
        return [f["uri"] for f in self.manifest.get("files", [])]
