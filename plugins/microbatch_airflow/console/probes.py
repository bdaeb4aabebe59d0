"""Pipeline status probes for the console: in parallel, cached, never waited on for long.

A pipeline's status reads its ledger and state (tens of milliseconds) and
asks its source what waits (a folder listing, a Kafka broker, a Delta
log). One source that does not answer (a broker that is down: librdkafka
waits out its timeouts) must not hold up the page for the others, and a
console with 200 pipelines must not probe them one after another.

So a probe runs in a bounded thread pool. A value is reused for
`fresh_s`, or for twice what a round of probes of every pipeline takes,
if that is longer (a status is tens of milliseconds of mostly
Python: 200 pipelines would otherwise keep the API server's CPU busy
re-probing); an older one is shown at once, with its age, while a new probe
runs (stale while revalidating). Only a pipeline with no value yet is
waited for, `wait_s` at most from its probe's start, and then shown as
"probing". A probe that hangs holds one worker, not the page, and its
answer is kept when it comes.

A commit is never shown stale, though: the row sits beside the batch
table, which reads the ledger afresh, and a row that says "batch 1" under
a table that shows batch 2 is wrong, not old. So each request also reads
each pipeline's ledger mark (`mark`: the newest entry of its Delta log, a
listing of one folder, `ledger_mark`). A value probed before the ledger
moved is not reused: a new probe starts, even beside an older one that
still runs (a slow source must not hold a commit back), and the request
waits for it as for a first probe; only a probe started after the move
can answer for it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from spark_jobs.core.spec import PipelineSpec

__all__ = ["SUMMARY_FIELDS", "Probes", "ledger_mark"]

#: The fields of a pipeline's summary (`GET /api/pipelines`): every answer has
#: them all, None where not known (yet).
SUMMARY_FIELDS = (
    "name", "dag_id", "source", "spec_path", "epoch", "batch_id", "status", "state_version", "lag",
    "last_committed_at", "problems", "oldest_rewindable", "end_offsets", "quarantined", "watermark", "late_policy", "final",
    "merged_on_read",
)


@dataclass
class _Entry:
    value: dict[str, Any] | None = None
    at: float = 0.0  # time.monotonic() of the value
    at_wall: datetime | None = None
    running: Future[dict[str, Any]] | None = None
    started: float = 0.0
    #: The ledger mark the value was probed at and when its probe started;
    #: the running probe's mark.
    value_mark: object = None
    value_started: float = -1.0
    running_mark: object = None


def ledger_mark(spec: PipelineSpec) -> object:
    """The newest entry of the pipeline's ledger log, which every commit and
    rewind adds to: a listing of one local folder (a fraction of a
    millisecond). None for a ledger elsewhere (S3: there the values'
    freshness alone applies) or with no log yet."""
    from spark_jobs.storage.s3 import is_s3

    if is_s3(spec.ledger_path):
        return None
    try:
        with os.scandir(os.path.join(spec.ledger_path, "_delta_log")) as entries:
            return max((e.name for e in entries if e.name.endswith(".json")), default=None)
    except OSError:
        return None


@dataclass
class Probes:
    """Status probes of many pipelines, cached by pipeline name and spec file."""

    probe: Callable[[PipelineSpec], dict[str, Any]]
    #: What moves when the pipeline commits (`ledger_mark`); None never moves.
    mark: Callable[[PipelineSpec], object] = lambda spec: None
    workers: int = 8
    fresh_s: float = 5.0
    wait_s: float = 1.5
    #: A probe's mean duration (exponentially weighted), for the freshness of a fleet.
    mean_probe_s: float = 0.0
    _entries: dict[tuple[str, str], _Entry] = field(default_factory=dict)
    # Re-entrant: a probe that is done before its callback is added runs the
    # callback at once, in the thread that holds the lock.
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _pool: ThreadPoolExecutor | None = None

    def _start(self, key: tuple[str, str], spec: PipelineSpec, mark: object) -> Future[dict[str, Any]]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="microbatch-probe")
        entry = self._entries.setdefault(key, _Entry())
        future = self._pool.submit(self.probe, spec)
        entry.running, entry.started, entry.running_mark = future, time.monotonic(), mark
        started = entry.started

        def keep(done: Future[dict[str, Any]]) -> None:
            with self._lock:
                if entry.running is done:
                    entry.running = None
                # (A probe that ends after a later-started one answered is not kept.)
                if not done.cancelled() and done.exception() is None and started >= entry.value_started:
                    entry.value, entry.at, entry.at_wall = done.result(), time.monotonic(), datetime.now(timezone.utc)
                    entry.value_mark, entry.value_started = mark, started
                    took = entry.at - started
                    self.mean_probe_s = took if not self.mean_probe_s else 0.8 * self.mean_probe_s + 0.2 * took

        future.add_done_callback(keep)
        return future

    async def summaries(self, specs: Iterable[PipelineSpec]) -> list[dict[str, Any]]:
        """Each spec's summary, in order. Waits only for pipelines with no
        value yet, and for each no longer than `wait_s` from its probe's start."""
        specs = list(specs)
        marks = await asyncio.to_thread(lambda: [self.mark(spec) for spec in specs])
        entries: list[_Entry] = []
        waiting: list[tuple[Future[dict[str, Any]], float]] = []
        now = time.monotonic()
        with self._lock:
            # A probe's duration is measured with the pool's others running beside it.
            fresh = max(self.fresh_s, 2 * self.mean_probe_s * len(self._entries or specs) / self.workers)
            for spec, mark in zip(specs, marks):
                key = (spec.name, str(spec.spec_path))
                entry = self._entries.get(key)
                moved = entry is not None and entry.value is not None and entry.value_mark != mark
                stale = entry is None or entry.value is None or now - entry.at >= fresh
                if (moved and (entry.running is None or entry.running_mark != mark)) or (
                    stale and (entry is None or entry.running is None)
                ):
                    self._start(key, spec, mark)
                entry = self._entries[key]
                entries.append(entry)  # kept: another request may forget the key meanwhile
                if (entry.value is None or moved) and entry.running is not None:
                    remaining = self.wait_s - (now - entry.started)
                    if remaining > 0:
                        waiting.append((entry.running, remaining))
        if waiting:
            await asyncio.wait([asyncio.wrap_future(f) for f, _ in waiting], timeout=max(r for _, r in waiting))
        with self._lock:
            return [self._shown(spec, entry) for spec, entry in zip(specs, entries)]

    def forget_all_but(self, specs: Iterable[PipelineSpec]) -> None:
        """Drop the cached values of pipelines whose spec is gone (`specs`:
        every spec in the folder, not only those one caller may see)."""
        keep = {(spec.name, str(spec.spec_path)) for spec in specs}
        with self._lock:
            for gone in set(self._entries) - keep:
                del self._entries[gone]

    def _shown(self, spec: PipelineSpec, entry: _Entry) -> dict[str, Any]:
        now = time.monotonic()
        probing = entry.running is not None
        if entry.value is None:
            return {
                **dict.fromkeys(SUMMARY_FIELDS),
                "name": spec.name, "dag_id": spec.name, "spec_path": str(spec.spec_path), "status": "probing",
                "problems": [], "probing": True, "probed_at": None, "probe_age_s": None,
                "probing_for_s": round(now - entry.started, 1) if probing else None,
            }
        return {
            **entry.value,
            "probing": probing,
            "probed_at": entry.at_wall.isoformat() if entry.at_wall else None,
            "probe_age_s": round(now - entry.at, 1),
            "probing_for_s": round(now - entry.started, 1) if probing else None,
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
