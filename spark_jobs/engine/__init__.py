"""The Spark engine: the `Compute` the protocol runs batches on.

`spark_compute` reads a planned range, quarantines bad records and runs the
transform; `session` makes and configures Spark sessions (local, standalone
cluster, Spark Connect); `s3_read` fetches S3 objects on the executors;
`jvm_cache` supplies the driver JVM's flags and class archive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spark_jobs.core.compute import Compute
    from spark_jobs.core.spec import PipelineSpec

__all__ = ["compute_factory"]

log = logging.getLogger("microbatch")


def compute_factory(spec: PipelineSpec, master: str | None = None, *, process_ends: bool = False) -> Callable[[], Compute]:
    """Spark for `spec`'s runs, on `master` or the one `resolve_master` picks.

    The one place the CLI, the operator and the warm-up choose their engine.
    Returns a factory: the protocol calls it only when a batch has work, so a
    run with nothing new never imports pyspark or starts a JVM.
    `process_ends`: the process exits after the run (the CLI), so a driver
    JVM it started is left to end with it rather than stopped first.
    """
    from spark_jobs.engine.session import redact_master, resolve_master

    resolved = resolve_master(master, spec)

    def make() -> Compute:
        from spark_jobs.engine.spark_compute import SparkCompute

        log.info("Spark master: %s", redact_master(resolved))
        return SparkCompute(master=resolved, stop_on_close=not process_ends)

    return make
