"""`NewDataSensor`: wait for new source data without holding a worker slot."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.configuration import conf
from airflow.sdk import BaseSensorOperator, Context
from airflow.sdk.exceptions import AirflowException

from microbatch_airflow.triggers import NewDataTrigger, waiting

__all__ = ["NewDataSensor"]


class NewDataSensor(BaseSensorOperator):
    """Succeeds once the pipeline's source has data it has not consumed.

    Deferrable as ``[operators] default_deferrable`` says (as Airflow's
    provider sensors are), or as `deferrable` says: the waiting then
    happens in the triggerer, without holding a worker slot. `timeout`
    and `soft_fail` behave as for any sensor (soft fail: skip on timeout).
    """

    template_fields = ("spec_path", "kafka_conn_id")

    def __init__(
        self,
        *,
        spec_path: str,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        kafka_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.deferrable = deferrable
        #: For a Kafka source: the connection holding its settings (default: the spec's).
        self.kafka_conn_id = kafka_conn_id

    def poke(self, context: Context) -> bool:
        count = waiting(self.spec_path, self.kafka_conn_id)
        self.log.info("%d waiting", count)
        return count > 0

    def execute(self, context: Context) -> None:
        if not self.deferrable or self.poke(context):
            if not self.deferrable:
                super().execute(context)
            return
        self.defer(
            trigger=NewDataTrigger(spec_path=self.spec_path, poll_seconds=self.poke_interval, kafka_conn_id=self.kafka_conn_id),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> None:
        if not event or event.get("status") != "ready":
            raise AirflowException(f"waiting for data failed: {(event or {}).get('message', event)}")
        self.log.info("%s waiting; going on", event["waiting"])
