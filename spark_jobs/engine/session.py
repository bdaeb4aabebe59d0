"""Spark sessions for micro-batches: local, standalone cluster or Spark Connect.

Which master a run uses is decided once, by `resolve_master`; the session is
tuned for short batches (few shuffle partitions, UTC, no UI) and, for a
process that runs one batch, for a fast JVM start (`jvm_cache`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from spark_jobs.core.spec import PipelineSpec
from spark_jobs.engine.jvm_cache import LAUNCHER_ENV, driver_java_options, launcher_java_options
from spark_jobs.engine.jvm_output import relayed_output

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["connect_session", "default_session", "redact_master", "resolve_master", "under_spark_submit"]


def default_session(master: str | None = None, app_name: str = "microbatch", *, short_lived: bool = True) -> SparkSession:
    """A Spark session tuned for micro-batches.

    Few shuffle partitions, UTC session time zone so timestamps mean the
    same everywhere, no UI. `short_lived`: the process runs one batch and
    exits (CLI, Airflow task), which picks JVM flags for a fast start
    (`spark_jobs.engine.jvm_cache`) and no adaptive re-planning; pass False
    for a session that runs many batches.
    """
    from pyspark.sql import SparkSession

    if master is None and not under_spark_submit():
        master = os.environ.get("MICROBATCH_SPARK_MASTER", "local[*]")
    # Python workers (S3 fetches, Arrow transfers) need this interpreter's
    # packages; Spark's default is whatever `python3` is on the PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master and master.startswith("local"):
        # Bind the driver to loopback: nothing local needs another interface.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name)
    if master is not None:  # else spark-submit's --master applies
        builder = builder.master(master)
    builder = (
        builder
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", os.environ.get("MICROBATCH_SHUFFLE_PARTITIONS", "8"))
        # Adaptive execution re-plans between stages: worth it for big
        # shuffles, but in a one-batch process, on a cold JVM, its planning
        # cost a third of a second a batch (measured: docs/benchmarks.md).
        .config("spark.sql.adaptive.enabled", "false" if short_lived else "true")
        .config("spark.driver.memory", os.environ.get("MICROBATCH_DRIVER_MEMORY", "2g"))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.extraJavaOptions", driver_java_options(short_lived))
        # Hadoop's default local file system looks for a `.<name>.crc` beside
        # each file it reads, and cannot even form that name for a file whose
        # name holds a ':' (common in timestamped names). Source files never
        # have Hadoop checksums, so read them through the raw file system.
        .config("spark.hadoop.fs.file.impl", "org.apache.hadoop.fs.RawLocalFileSystem")
    )
    from pyspark import SparkContext

    if SparkContext._active_spark_context is None and not under_spark_submit():
        # A new driver JVM: its console output goes to logging at its own
        # level, not to stderr (which Airflow shows as errors).
        _import_pandas_meanwhile()
        with relayed_output(), _launcher_options():
            session = builder.getOrCreate()
    else:
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel(os.environ.get("MICROBATCH_SPARK_LOG_LEVEL", "ERROR"))
    return session


def _import_pandas_meanwhile() -> None:
    """Import pandas on a thread while the driver JVM boots.

    pyspark's first call into a new JVM passes its configuration through a
    py4j converter whose check imports `pyspark.testing.utils`, and so
    pandas: a third of a second of Python on the start's critical path while
    the JVM waits. Begun now, the import runs during the second or so that
    Python only waits for the JVM (measured: docs/benchmarks.md). Only pandas,
    which imports nothing of pyspark: importing pyspark modules from two
    threads at once can meet a partly initialised module.
    """
    if "pandas" in sys.modules:
        return

    def load() -> None:
        try:
            importlib.import_module("pandas")
        except ImportError:  # pyspark then reports it, on its own path
            pass

    threading.Thread(target=load, name="microbatch-import-pandas", daemon=True).start()


@contextmanager
def _launcher_options() -> Iterator[None]:
    """`spark-submit`'s launcher JVM with its class archive, for this launch only."""
    options = launcher_java_options()
    if options is None:
        yield
        return
    os.environ[LAUNCHER_ENV] = options
    try:
        yield
    finally:
        os.environ.pop(LAUNCHER_ENV, None)


def under_spark_submit() -> bool:
    """True in a driver launched by `spark-submit` (its JVM is already running)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def resolve_master(explicit: str | None, spec: PipelineSpec) -> str | None:
    """The Spark master for a run; None means "the one spark-submit configured".

    Precedence: an explicit choice (CLI `--master`, the operator's
    `spark_master` / `spark_conn_id`), then `spark-submit --master`, then the
    spec's `engine.master`, then ``MICROBATCH_SPARK_MASTER``, then `local[*]`.
    """
    if explicit:
        return explicit
    if under_spark_submit():
        return None
    return spec.engine.master or os.environ.get("MICROBATCH_SPARK_MASTER") or "local[*]"


def redact_master(master: str | None) -> str:
    """`master` fit for a log line: a Spark Connect URL's bearer token hidden."""
    if master is None:
        return "from spark-submit"
    return re.sub(r"(?i)(;token=)[^;]*", r"\1***", master)


def connect_session(url: str) -> SparkSession:
    """A Spark Connect client session for ``sc://host:port``."""
    from pyspark.sql import SparkSession

    session = SparkSession.builder.remote(url).getOrCreate()
    # Per-session settings the server's defaults may not match; the same
    # meaning of timestamps as in local runs matters for exactness.
    session.conf.set("spark.sql.session.timeZone", "UTC")
    session.conf.set("spark.sql.shuffle.partitions", os.environ.get("MICROBATCH_SHUFFLE_PARTITIONS", "8"))
    return session
