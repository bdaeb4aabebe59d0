"""Triggers that watch a pipeline's source from the triggerer.

`NewDataTrigger` waits for the deferrable sensor (`wait_for_data`) until
source data waits, then ends. `NewDataEventTrigger` is an asset watcher
(`run_on_data`): it never ends, and emits an event each time data is found
waiting, which the scheduler turns into a DAG run; with nothing arriving
there is no run at all.

The check (ledger read plus folder listing, no Spark) runs in a thread so the
triggerer's event loop never blocks on I/O. Between checks, a poll first
takes the source's fingerprint (`spark_jobs.engine.idle_hint.fingerprint`:
the folder's listing and the ledger's newest entry, about a millisecond
where both are local) and checks again only when it changed: a full check
(the spec parsed, the ledger's head read) cost 20 ms of CPU, which at a
poll every 30 s is 2.4 CPU-s an idle pipeline-hour (docs/fleet.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import time

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

__all__ = ["NewDataEventTrigger", "NewDataTrigger", "waiting"]


def waiting(spec_path: str, kafka_conn_id: str | None = None) -> int:
    """How much source data waits for the pipeline in `spec_path`, in the source's own unit (files for a files source).

    A source that cannot be read (a missing folder, say) raises: a sensor
    must fail with the reason, not poll "0 waiting" until it times out.
    """
    from microbatch_airflow.hooks import connections
    from spark_jobs.core.inspect import lag
    from spark_jobs.core.spec import load_spec

    spec = load_spec(spec_path)
    with connections(spec, kafka_conn_id=kafka_conn_id):
        return lag(spec).count


def _check(spec_path: str, kafka_conn_id: str | None = None) -> tuple[int, tuple[int, int]]:
    """`waiting`, with the ledger position it counts from (epoch, batch):
    the watcher's full check."""
    from microbatch_airflow.hooks import connections
    from spark_jobs.core.inspect import lag_after
    from spark_jobs.core.spec import load_spec

    spec = load_spec(spec_path)
    with connections(spec, kafka_conn_id=kafka_conn_id):
        found, position = lag_after(spec)
    return found.count, (position.epoch, position.batch_id)


class NewDataTrigger(BaseTrigger):
    def __init__(self, spec_path: str, poll_seconds: float = 30.0, kafka_conn_id: str | None = None) -> None:
        super().__init__()
        self.spec_path = spec_path
        self.poll_seconds = poll_seconds
        self.kafka_conn_id = kafka_conn_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "microbatch_airflow.triggers.NewDataTrigger",
            {"spec_path": self.spec_path, "poll_seconds": self.poll_seconds, "kafka_conn_id": self.kafka_conn_id},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        checked: _Fingerprint | None = None  # at the last full check
        while True:
            try:
                now = await asyncio.to_thread(_fingerprint, self.spec_path)
                if now is None or now != checked:
                    count = await asyncio.to_thread(waiting, self.spec_path, self.kafka_conn_id)
                    if count:
                        yield TriggerEvent({"status": "ready", "waiting": count})
                        return
                    checked = now
            except Exception as exc:  # report, do not spin: the sensor fails with the message
                yield TriggerEvent({"status": "error", "message": str(exc)})
                return
            await asyncio.sleep(self.poll_seconds)


class NewDataEventTrigger(BaseEventTrigger):
    """The watcher of a pipeline's source asset (`airflow.run_on_data`).

    Between full checks a poll takes the fingerprint, as `NewDataTrigger`
    does (sources on S3 and Kafka have none: each of their polls is a full
    check). A full check emits an event when data waits and it is news:
    files landed (the source's half of the fingerprint moved), the waiting
    count moved, or the ledger's committed position moved (a commit that
    left data behind, a rewind that made consumed data new). A batch that
    only starts writes a planned row, which moves none of them: its commit
    will be the next news. Events that come while a run is active wait in
    Airflow's queue until it ends (`max_active_runs=1`), then make one run.
    While data waits with no news for `refire_seconds` after the last event
    (a run that failed for good, say), it emits again. An extra event costs
    a run that finds nothing; data never waits without one to come.

    A source that cannot be read emits an error event for a message not
    emitted in the last `refire_seconds` (an error that comes and goes makes
    no run a poll): the run it makes meets the same error and fails with
    it, where people look (the triggerer's log has the message too).
    """

    def __init__(
        self, spec_path: str, poll_seconds: float = 30.0, refire_seconds: float = 600.0, kafka_conn_id: str | None = None
    ) -> None:
        super().__init__()
        self.spec_path = spec_path
        self.poll_seconds = poll_seconds
        self.refire_seconds = refire_seconds
        self.kafka_conn_id = kafka_conn_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "microbatch_airflow.triggers.NewDataEventTrigger",
            {
                "spec_path": self.spec_path,
                "poll_seconds": self.poll_seconds,
                "refire_seconds": self.refire_seconds,
                "kafka_conn_id": self.kafka_conn_id,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        checked: _Fingerprint | None = None  # at the last full check
        seen: str | None = None  # the source's digest that check's news covers
        count, position = 0, None  # what that check found waiting, and after which commit
        fired_at = -float("inf")
        error: tuple[str, float] | None = None  # the last error event's message and time
        while True:
            try:
                now = await asyncio.to_thread(_fingerprint, self.spec_path)
                if now is None or now != checked:
                    before = (count, position)
                    count, position = await asyncio.to_thread(_check, self.spec_path, self.kafka_conn_id)
                    landed = now is not None and now[2] != seen
                    checked, seen = now, (now[2] if now is not None else None)
                    if count and ((count, position) != before or landed):
                        fired_at = -float("inf")  # news: emit now
                        seen = await asyncio.to_thread(_digest_after, self.spec_path, seen)
                if count and time.monotonic() - fired_at >= self.refire_seconds:
                    yield TriggerEvent({"status": "ready", "waiting": count, "spec_path": self.spec_path})
                    fired_at = time.monotonic()
            except Exception as exc:  # keep watching: the source may come back
                checked = seen = None
                message = str(exc)
                self.log.warning("%s: %s", self.spec_path, message)
                if error is None or error[0] != message or time.monotonic() - error[1] >= self.refire_seconds:
                    error = (message, time.monotonic())
                    yield TriggerEvent({"status": "error", "message": message, "spec_path": self.spec_path})
            await asyncio.sleep(self.poll_seconds)


#: What `_fingerprint` last read of a spec, by path: (the file's mtime,
#: what its fingerprint looks at: `idle_hint.watched`).
_SPECS: dict[str, tuple[float, tuple[str, str, str]]] = {}

#: (the spec file's mtime, the ledger's newest entry, the source's digest).
_Fingerprint = tuple[float, str, str]


def _fingerprint(spec_path: str) -> _Fingerprint | None:
    """The spec file's mtime and its source's fingerprint, None without one
    (then every poll checks in full). The spec is parsed, and its locations
    resolved, again only when its file changed, so an edited spec is
    checked afresh; an idle poll is a stat and the two folders listed
    (resolving the locations every poll, a poll took 0.084 ms of CPU; kept,
    0.031 ms: docs/fleet.md)."""
    import os

    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.idle_hint import fingerprint_at, watched

    try:
        mtime = os.stat(spec_path).st_mtime
    except OSError:
        return None  # the full check says what is wrong with it
    cached = _SPECS.get(spec_path)
    if cached is None or cached[0] != mtime:
        cached = _SPECS[spec_path] = (mtime, watched(load_spec(spec_path)))
    parts = fingerprint_at(*cached[1])
    return (mtime, *parts) if parts is not None else None


def _digest_after(spec_path: str, digest: str | None) -> str | None:
    """The source's digest once a full check found news, or `digest` (the
    one taken before it) when it cannot be taken.

    The event about to go out makes a run that reads the source as it is
    then, so what changed while the check ran is that event's too: a file
    that landed between the poll's fingerprint and the check, counted by
    it, is not news again at the next poll (once, on CI, the same file made
    two events and a run that found nothing). Without news the digest
    before the check is kept, so a change the check did not count (a file
    replaced by another, the count the same) is news at the next poll.
    """
    try:
        after = _fingerprint(spec_path)
    except Exception:  # a spec caught mid-save: the news stands, the next poll checks again
        return digest
    return after[2] if after is not None else digest
