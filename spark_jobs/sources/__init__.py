"""Sources: where records come from, and how a batch's range is described.

A source plans in plain Python (no JVM), so a run with nothing new ends
without starting Spark. The compute engine reads exactly the planned range.
"""

from __future__ import annotations

from spark_jobs.sources.base import BatchRange
from spark_jobs.sources.files import FilesSource
from spark_jobs.spec import PipelineSpec

__all__ = ["BatchRange", "FilesSource", "make_source"]


def make_source(spec: PipelineSpec) -> FilesSource:
    """The source object for a spec's `source:` block."""
    if spec.source.type == "files":
        return FilesSource(spec.source_path, spec.source.format, csv_header=spec.source.csv.header)
    raise ValueError(f"unknown source type {spec.source.type!r}")  # spec validation prevents this
