"""Read the Flink anchor's output and checkpoints with plain Python (no Flink import).

`flink_clicks.py` writes the aggregate's changelog with Flink's `FileSink`: one
text line per change, `+I[user000123, 3, 57.1, 1234567890123, 2026-01-01T00:59:58Z]`
(Flink's `Row.toString()`: row kind, then key, events, amount, idhash,
last_seen). A part file is renamed to its final, visible name only when the
checkpoint that covers it completes; until then it is hidden (`.name.inprogress.*`).
So reading only visible files gives exactly the effect of the completed checkpoints.

This module is importable from the project's main env (the benchmark harness)
and from the Flink venv.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

__all__ = ["Agg", "Tail", "finalized_files", "fold_output", "latest_checkpoint", "parse_line", "record_hash"]


class Agg(NamedTuple):
    """Current aggregate of one user: what the Spark pipeline keeps in its state table."""

    events: int
    amount: float
    idhash: int
    last_seen: datetime | None


def record_hash(event_id: str) -> int:
    """Same as `spark_jobs.demo.clickstream.record_hash` (copied: the Flink venv cannot import the project)."""
    return int(hashlib.sha256(event_id.encode()).hexdigest()[:10], 16)


def finalized_files(out_dir: str | Path) -> list[Path]:
    """Visible (committed) part files, oldest first; in-progress/pending files start with '.'."""
    root = Path(out_dir)
    if not root.is_dir():
        return []
    files = [
        p for p in root.rglob("*") if p.is_file() and not any(part[0] in "._" for part in p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))


def parse_line(line: str) -> tuple[str, str, Agg] | None:
    """`+U[user, events, amount, idhash, last_seen]` -> (kind, user, Agg); None for a blank line.

    Splitting on ', ' is safe for this workload: user ids and ISO timestamps contain no commas.
    """
    line = line.strip()
    if not line:
        return None
    if len(line) < 4 or line[2] != "[" or line[-1] != "]":
        raise ValueError(f"not a changelog line (expected '+U[...]'): {line[:120]!r}")
    user, events, amount, idhash, last_seen = line[3:-1].split(", ")
    seen = None if last_seen == "null" else datetime.fromisoformat(last_seen.replace("Z", "+00:00"))
    return line[:2], user, Agg(int(events), float(amount), int(idhash), seen)


def _fold_into(state: dict[str, Agg], files: Iterable[Path]) -> set[str]:
    """Fold changelog files into `state`; returns the keys whose row changed.

    Only +I/+U rows carry the new value (the sink asks for an upsert changelog, so
    there are no -U rows; -D never occurs: the aggregate only grows). `events` grows
    with every update of a key, so the row with the most events is the latest: the
    fold does not depend on the order in which files are read, and a row read twice
    (e.g. re-emitted after a restore) changes nothing.
    """
    changed = set()
    for path in files:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                parsed = parse_line(line)
                if parsed is None or parsed[0] not in ("+I", "+U"):
                    continue
                _, user, agg = parsed
                old = state.get(user)
                if old is None or agg.events > old.events:
                    state[user] = agg
                    changed.add(user)
    return changed


def fold_output(out_dir: str | Path) -> dict[str, Agg]:
    """Current aggregate per user_id from the finalized output only (what a reader may see)."""
    state: dict[str, Agg] = {}
    _fold_into(state, finalized_files(out_dir))
    return state


class Tail:
    """Incremental `fold_output` for polling: each finalized file is read once.

    Finalized part files never change after their rename, so reading only new
    ones is exact. Use it to time visibility: land a record at t0, then poll
    until `tail.state[user].events` reaches the expected count.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.state: dict[str, Agg] = {}
        self._read: set[Path] = set()

    def poll(self) -> set[str]:
        """Read newly finalized files; returns the user_ids whose aggregate changed."""
        new = [p for p in finalized_files(self.out_dir) if p not in self._read]
        self._read.update(new)
        return _fold_into(self.state, new)


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """Newest retained checkpoint or savepoint under `checkpoints_dir`, for `--restore`.

    Flink writes `<dir>/<job-id>/chk-<n>/_metadata` last, when checkpoint n is
    complete (and `savepoint-*/_metadata` for a stop with savepoint); a `chk-<n>`
    without `_metadata` was cut short (kill -9) and cannot be restored. Retained
    checkpoints of several runs (one job id each) can sit side by side: the newest
    `_metadata` wins.
    """
    root = Path(checkpoints_dir)
    candidates = [m for m in root.glob("*/chk-*/_metadata") if m.stat().st_size > 0]
    candidates += [m for m in root.glob("savepoints/savepoint-*/_metadata") if m.stat().st_size > 0]
    if not candidates:
        return None
    return max(candidates, key=lambda m: m.stat().st_mtime_ns).parent
