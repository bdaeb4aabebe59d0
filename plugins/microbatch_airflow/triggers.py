"""`NewDataTrigger`: waits in the triggerer until a pipeline has source data waiting.

The check (ledger read plus folder listing, no Spark) runs in a thread so the
triggerer's event loop never blocks on I/O.
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
        while True:
            try:
                count = await asyncio.to_thread(waiting, self.spec_path, self.kafka_conn_id)
            except Exception as exc:  # report, do not spin: the sensor fails with the message
                yield TriggerEvent({"status": "error", "message": str(exc)})
                return
            if count:
                yield TriggerEvent({"status": "ready", "waiting": count})
                return
            await asyncio.sleep(self.poll_seconds)
