"""The `airflow:` block of a pipeline spec: the settings only Airflow reads.

The job's spec model (`spark_jobs.core.spec`) keeps this block as an opaque
mapping and never reads it; this module owns and validates it, with the same
"line N, field `airflow.x`" errors as the rest of the spec, so a mistake here
is a broken spec in the UI (`scan_specs`) before any run.

    airflow:
      schedule: "@hourly"          # cron or preset; runs get real data intervals
      start_date: 2026-01-01
      catchup: false
      tags: [clicks]
      retries: 3                   # default: the DAG's default_args, else 2
      retry_delay_seconds: 30
      wait_for_data: {poll_seconds: 30, timeout_seconds: 3600}
      run_on_data: {poll_seconds: 30}   # instead of a schedule: a run only when data waits
      spark_conn_id: microbatch_spark
      kafka_conn_id: kafka_clicks
      aws_conn_id: aws_default
      maintenance_schedule: "@daily"
      lag_alert: {count: 100, age_seconds: 3600}   # the console's status turns red
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from spark_jobs.core.spec import PipelineSpec, check_cron, field_problems
from spark_jobs.errors import SpecError

__all__ = ["DEFAULT_RETRIES", "AirflowSpec", "LagAlert", "RunOnData", "WaitForData", "airflow_spec"]

#: Retries when neither the spec nor the DAG's default_args say: every retry
#: re-enters the commit protocol, so retrying is always safe.
DEFAULT_RETRIES = 2

_CONN_ID = r"^[A-Za-z0-9_.\-]{1,250}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WaitForData(_Model):
    """Put a sensor before the batch task that waits for source data."""

    poll_seconds: float = Field(default=30, gt=0)
    timeout_seconds: float = Field(default=3600, gt=0)
    soft_fail: bool = True
    #: Wait in the triggerer (no worker slot held); default: Airflow's `[operators] default_deferrable`.
    deferrable: bool | None = None


class RunOnData(_Model):
    """Schedule the DAG on its source: a run is created only when data waits.

    A watcher in the triggerer (`microbatch_airflow.triggers.NewDataEventTrigger`)
    polls the source and emits an asset event when something waits; the DAG
    is scheduled on that asset. While nothing arrives there is no DAG run,
    no task and no JVM: an idle pipeline costs only the watcher's polls
    (docs/fleet.md). The default for fleets.
    """

    poll_seconds: float = Field(default=30.0, ge=1)
    #: Emit again while data still waits unchanged this long after the last
    #: event (a run that failed, an event lost): the watcher's safety net.
    refire_seconds: float = Field(default=600.0, ge=1)


class LagAlert(_Model):
    """When the console shows the pipeline red ("lagging"): this much waits in
    the source, or its oldest data has waited this long; either, or both."""

    count: int | None = Field(default=None, ge=1)
    age_seconds: float | None = Field(default=None, gt=0)


class AirflowSpec(_Model):
    schedule: str | None = None
    catchup: bool = False
    start_date: datetime = datetime(2026, 1, 1, tzinfo=timezone.utc)
    tags: list[str] = Field(default_factory=list)
    wait_for_data: WaitForData | None = None
    #: A run only when source data waits, in place of `schedule` (see `RunOnData`).
    run_on_data: RunOnData | None = None
    #: Task retries; None: the DAG's default_args, else `DEFAULT_RETRIES`.
    retries: int | None = Field(default=None, ge=0, le=100)
    retry_delay_seconds: float | None = Field(default=None, gt=0)
    #: The Spark provider's connection naming the master (see `hooks.spark_master`).
    spark_conn_id: str | None = Field(default=None, pattern=_CONN_ID)
    #: The apache-kafka provider's connection holding librdkafka settings and secrets.
    kafka_conn_id: str | None = Field(default=None, pattern=_CONN_ID)
    #: The amazon provider's connection for S3; None: ``aws_default`` if defined, else boto3's chain.
    aws_conn_id: str | None = Field(default=None, pattern=_CONN_ID)
    #: Run `microbatch maintain` on this cron schedule, in a DAG of its own.
    maintenance_schedule: str | None = None
    #: The console's red status (see `LagAlert`).
    lag_alert: LagAlert | None = None

    @field_validator("schedule", "maintenance_schedule")
    @classmethod
    def _cron(cls, schedule: str | None) -> str | None:
        return check_cron(schedule)

    @field_validator("run_on_data")
    @classmethod
    def _alone(cls, value: RunOnData | None, info: ValidationInfo) -> RunOnData | None:
        # Fields validate in order: `schedule` and `wait_for_data` are in info.data by now.
        if value is not None and info.data.get("schedule"):
            raise ValueError(
                "a pipeline runs either on a clock (`airflow.schedule`) or when data waits (`airflow.run_on_data`); "
                "remove one of them"
            )
        if value is not None and info.data.get("wait_for_data"):
            raise ValueError(
                "a run scheduled on data starts only once data waits, so `airflow.wait_for_data` has nothing to "
                "wait for; remove it"
            )
        return value

    @field_validator("start_date")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def airflow_spec(spec: PipelineSpec) -> AirflowSpec:
    """The validated `airflow:` block of `spec`; `SpecError` naming the line and field."""
    try:
        return AirflowSpec.model_validate(spec.airflow)
    except ValidationError as exc:
        try:
            text = Path(spec.spec_path).read_text(encoding="utf-8")
        except OSError:
            text = ""
        raise SpecError(spec.spec_path, field_problems(exc, text, ("airflow",))) from None
