"""OpenLineage for a micro-batch task, as Airflow's OpenLineage provider asks
for it (`MicroBatchOperator.get_openlineage_facets_on_complete`).

The input dataset is the pipeline's source, the output its state table, both
named by OpenLineage's naming conventions (a local path under namespace
``file``, an S3 prefix under ``s3://bucket``, a topic under
``kafka://host:port``). The run carries a ``microbatch`` facet with the batch
itself: epoch, batch id, offsets and record counts, the same figures as the
ledger row, so a lineage backend shows which offsets each run consumed.
Nothing secret goes in: no settings, no credentials; offsets only.

The names are made in every task, the facet only when the provider asks:
the facet's module imports OpenLineage's client (a quarter of a CPU-second a
task, for a deployment with lineage switched off too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

    from spark_jobs.core.spec import PipelineSpec

__all__ = ["operator_lineage", "source_dataset", "state_dataset"]


def _path_dataset(location: str) -> tuple[str, str]:
    if location.startswith(("s3://", "s3a://")):
        bucket, _, key = location.split("://", 1)[1].partition("/")
        return f"s3://{bucket}", key.rstrip("/") or "/"
    return "file", location.removeprefix("file://")


def source_dataset(spec: PipelineSpec) -> tuple[str, str]:
    """(namespace, name) of the pipeline's source. For Kafka the first
    bootstrap server, as resolved for the run (spec, environment or
    connection), names the cluster; call it where the run's connections hold."""
    if spec.source.type == "kafka":
        from spark_jobs.sources.kafka import KafkaClient

        server = KafkaClient.for_source(spec.source, spec.name).servers.split(",")[0].strip()
        return f"kafka://{server.split('://', 1)[-1]}", spec.source.topic
    return _path_dataset(spec.source_path)


def state_dataset(spec: PipelineSpec) -> tuple[str, str]:
    """(namespace, name) of the pipeline's state table."""
    return _path_dataset(spec.state_path)


def operator_lineage(source: tuple[str, str], state: tuple[str, str], summary: dict[str, Any] | None) -> OperatorLineage:
    """The task's lineage: source in, state out, and the batch as a run facet."""
    from airflow.providers.common.compat.openlineage.facet import Dataset
    from airflow.providers.openlineage.extractors import OperatorLineage

    from microbatch_airflow.lineage_facet import MicrobatchRunFacet

    run_facets: dict[str, Any] = {}
    if summary is not None:
        run_facets["microbatch"] = MicrobatchRunFacet(
            status=str(summary.get("status")),
            epoch=summary.get("epoch"),
            batchId=summary.get("batch_id"),
            startOffsets=summary.get("start_offsets"),
            endOffsets=summary.get("end_offsets"),
            recordsIn=summary.get("records_in"),
            recordsQuarantined=summary.get("records_quarantined"),
            stateVersion=summary.get("state_version"),
        )
    return OperatorLineage(
        inputs=[Dataset(namespace=source[0], name=source[1])],
        outputs=[Dataset(namespace=state[0], name=state[1])],
        run_facets=run_facets,
    )
