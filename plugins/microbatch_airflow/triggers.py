"""`NewDataTrigger`: waits in the triggerer until a pipeline has source data waiting.

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

from airflow.triggers.base import BaseTrigger, TriggerEvent

__all__ = ["NewDataTrigger", "waiting"]


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
        checked: tuple[float, str | None] | None = None  # (spec file's mtime, fingerprint) at the last full check
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


#: The spec last parsed by `_fingerprint`, by path: (file's mtime, spec).
_SPECS: dict[str, tuple[float, Any]] = {}


def _fingerprint(spec_path: str) -> tuple[float, str | None] | None:
    """The spec file's mtime and its source's fingerprint, None without one
    (then every poll checks in full). The spec is parsed again only when its
    file changed, so an edited spec is checked afresh."""
    import os

    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.idle_hint import fingerprint

    try:
        mtime = os.stat(spec_path).st_mtime
    except OSError:
        return None  # the full check says what is wrong with it
    cached = _SPECS.get(spec_path)
    if cached is None or cached[0] != mtime:
        cached = _SPECS[spec_path] = (mtime, load_spec(spec_path))
    digest = fingerprint(cached[1])
    return (mtime, digest) if digest is not None else None
