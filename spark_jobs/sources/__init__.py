"""Sources: where records come from, and how a batch's range is described.

A source plans in plain Python (no JVM), so a run with nothing new ends
without starting Spark. The compute engine reads exactly the planned range.
"""

from __future__ import annotations

from spark_jobs.sources.base import BatchRange
from spark_jobs.sources.files import FilesSource
from spark_jobs.sources.s3 import S3FilesSource
from spark_jobs.spec import PipelineSpec
from spark_jobs.storage import is_s3

__all__ = ["BatchRange", "FilesSource", "S3FilesSource", "make_source"]


def make_source(spec: PipelineSpec) -> FilesSource:
    """The source object for a spec's `source:` block."""
    if spec.source.type == "files":
        kind = S3FilesSource if is_s3(spec.source_path) else FilesSource
        return kind(spec.source_path, spec.source.format, csv_header=spec.source.csv.header)
    raise ValueError(f"unknown source type {spec.source.type!r}")  # spec validation prevents this
