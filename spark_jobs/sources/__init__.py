"""Sources: where records come from, and what a batch's range means.

`base.Source` is the protocol every source implements; `make_source` picks
the implementation for a spec's `source:` block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_jobs.sources.base import BatchRange, Caps, Lag, Source
from spark_jobs.sources.delta import DeltaSource
from spark_jobs.sources.files import FilesSource, LocalLister
from spark_jobs.sources.kafka import KafkaClient, KafkaSource
from spark_jobs.sources.s3 import S3Lister
from spark_jobs.storage.s3 import is_s3

if TYPE_CHECKING:
    from spark_jobs.core.spec import PipelineSpec

__all__ = ["BatchRange", "Caps", "Lag", "Source", "make_source"]


def make_source(spec: PipelineSpec) -> Source:
    """The source for a spec's `source:` block."""
    if spec.source.type == "kafka":
        client = KafkaClient.for_source(spec.source, spec.name)
        return KafkaSource(spec.source, client, max_records=spec.batch.max_records)
    path = spec.source_path
    if spec.source.type == "delta":
        return DeltaSource(
            path,
            read=spec.source.read,
            on_data_loss=spec.source.on_data_loss,
            max_versions=spec.batch.max_versions,
            reader=spec.source.reader,
            pipeline=spec.name,
            checkpoint=spec.checkpoint_path,
        )
    lister = S3Lister(path) if is_s3(path) else LocalLister(path)
    return FilesSource(
        lister,
        spec.source.format,
        csv_header=spec.source.csv.header,
        after_commit=spec.source.after_commit,
        archive=spec.archive_path,
    )
