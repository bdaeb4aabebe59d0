"""The Airflow assets a pipeline produces."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, AssetAlias, AssetWatcher

from spark_jobs.core.spec import PipelineSpec

__all__ = ["batches_alias", "new_batches", "source_asset", "state_asset"]


def state_asset(spec: PipelineSpec) -> Asset:
    """The state table as an asset; downstream DAGs schedule on it."""
    location = spec.state_path
    uri = location if "://" in location else Path(location).as_uri()
    return Asset(name=f"microbatch.{spec.name}.state", uri=uri, group="microbatch")


def source_asset(spec: PipelineSpec, poll_seconds: float, refire_seconds: float, kafka_conn_id: str | None = None) -> Asset:
    """New data in the pipeline's source, watched from the triggerer
    (`airflow.run_on_data`): the DAG schedules on it, so a run exists only
    once data waits. Named for the pipeline, not the folder: two pipelines
    may read one source, each at its own offsets."""
    from microbatch_airflow.triggers import NewDataEventTrigger

    trigger = NewDataEventTrigger(
        spec_path=spec.spec_path, poll_seconds=poll_seconds, refire_seconds=refire_seconds, kafka_conn_id=kafka_conn_id
    )
    return Asset(
        name=f"microbatch.{spec.name}.new_data",
        uri=f"microbatch://{spec.name}/new_data",
        group="microbatch",
        watchers=[AssetWatcher(name=f"microbatch.{spec.name}.source_watcher", trigger=trigger)],
    )


def batches_alias(spec: PipelineSpec) -> AssetAlias:
    """The batch task's outlet.

    An alias, not the asset itself: Airflow emits an event for every static
    outlet of a successful task, and a run that found nothing new must not
    wake downstream DAGs. Through the alias the task adds an event only when
    it committed a batch.
    """
    return AssetAlias(name=f"microbatch.{spec.name}.batches", group="microbatch")


def new_batches(triggering_asset_events: Mapping[Any, Any] | None) -> list[dict[str, Any]]:
    """The batches (and rewinds) behind a downstream run, each once, oldest first.

    Airflow lists an event added through an alias under the asset and under
    the alias; counting both would process every batch twice. An event is
    known by its pipeline, epoch and batch (or rewind) id.
    """
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for events in (triggering_asset_events or {}).values():
        for event in events:
            extra = dict(event.extra or {})
            key = (extra.get("pipeline"), extra.get("epoch"), extra.get("batch_id"), extra.get("rewound_to_batch"), extra.get("state_version"))
            found.setdefault(key, extra)
    return sorted(found.values(), key=lambda e: (e.get("state_version") or 0))
