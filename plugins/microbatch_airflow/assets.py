"""The Airflow assets a pipeline produces."""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import Asset, AssetAlias

from spark_jobs.core.spec import PipelineSpec

__all__ = ["batches_alias", "state_asset"]


def state_asset(spec: PipelineSpec) -> Asset:
    """The state table as an asset; downstream DAGs schedule on it."""
    location = spec.state_path
    uri = location if "://" in location else Path(location).as_uri()
    return Asset(name=f"microbatch.{spec.name}.state", uri=uri, group="microbatch")


def batches_alias(spec: PipelineSpec) -> AssetAlias:
    """The batch task's outlet.

    An alias, not the asset itself: Airflow emits an event for every static
    outlet of a successful task, and a run that found nothing new must not
    wake downstream DAGs. Through the alias the task adds an event only when
    it committed a batch.
    """
    return AssetAlias(name=f"microbatch.{spec.name}.batches", group="microbatch")
