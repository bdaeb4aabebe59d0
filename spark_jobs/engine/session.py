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
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from weakref import WeakKeyDictionary

from spark_jobs.core.spec import PipelineSpec
from spark_jobs.engine.driver import DriverLaunch, EarlyDriver
from spark_jobs.engine.jvm_cache import driver_java_options
from spark_jobs.jar_cache import complete_dir
from spark_jobs.storage import s3

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: Set to 0 to start a run's driver JVM only once its batch has work (`launch_driver`).
EARLY_DRIVER_ENV = "MICROBATCH_EARLY_DRIVER"
#: A folder of JARs for sessions that query Delta instead of the fetched set
#: (`extra_jars`), or `none` for sessions with pyspark's own JARs alone.
SPARK_JARS_ENV = "MICROBATCH_SPARK_JARS"
#: What turns Delta's SQL on in a session: its parser and planner rules, and
#: its catalog for `spark_catalog` (delta-spark's own
#: `configure_spark_with_delta_pip` sets the same two).
DELTA_SQL = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
#: The most a task reads of a file source (`spark.sql.files.maxPartitionBytes`).
#: Spark's default reads in splits of up to 128 MB, or of the input over the
#: cores if smaller: a big batch on a few cores is then a few big tasks, which
#: balance badly (303 MB on 2 cores: 3 tasks, the last alone on one core) and
#: whose aggregation maps spill (3.3 GB at 30M distinct keys). In 32 MB splits
#: it is 15 tasks: that stage took 66 s instead of 104 s
#: (docs/state-at-scale.md). A batch of under 32 MB a core is split as before;
#: a split size the user set stays (`split_reads`).
SPLIT_BYTES = "32m"
_SPLIT_KEY = "spark.sql.files.maxPartitionBytes"
#: How a session spells Spark's own split size, when nothing set another
#: (Spark 4.2 gives the bytes; its definition says 128MB).
_SPARK_SPLIT = frozenset({"134217728b", "128MB"})

__all__ = [
    "DELTA_SQL",
    "EARLY_DRIVER_ENV",
    "SPARK_JARS_ENV",
    "SPLIT_BYTES",
    "built_once",
    "connect_session",
    "default_session",
    "extra_jars",
    "launch_driver",
    "redact_master",
    "resolve_master",
    "with_reader",
    "session_options",
    "split_reads",
    "under_spark_submit",
]


_T = TypeVar("_T")
#: Plan parts (`Column` lists and the like) built per session, by `built_once`.
_BUILT: WeakKeyDictionary[SparkSession, dict[Hashable, Any]] = WeakKeyDictionary()
_BUILT_LOCK = threading.Lock()


def built_once(spark: SparkSession, key: Hashable, build: Callable[[], _T]) -> _T:
    """`build()`, made once per session and `key`. For columns a batch's
    query is made of: they are plans' parts, not data, and building them
    is many calls into the JVM (a function's lookup alone is several), a
    tenth of a second a batch before they were kept."""
    with _BUILT_LOCK:  # reads run on several threads (`SparkCompute.reads_at_once`)
        built = _BUILT.setdefault(spark, {})
        if key not in built:
            built[key] = build()
        return built[key]


def default_session(
    master: str | None = None,
    app_name: str = "microbatch",
    *,
    short_lived: bool = True,
    early: EarlyDriver | None = None,
    delta: bool = False,
) -> SparkSession:
    """A Spark session tuned for micro-batches.

    Few shuffle partitions, UTC session time zone so timestamps mean the
    same everywhere, no UI. `short_lived`: the process runs one batch and
    exits (CLI, Airflow task), which picks JVM flags for a fast start
    (`spark_jobs.engine.jvm_cache`) and no adaptive re-planning; pass False
    for a session that runs many batches. `early`: a driver JVM launched
    ahead of need (`launch_driver`), taken if its settings are this
    session's; else the driver is launched now (and `early` stops its own).
    `delta`: load delta-spark (`extra_jars`, `DELTA_SQL`), for a session
    that queries Delta tables with Spark.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    options = session_options(master, app_name, short_lived=short_lived, delta=delta)
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    if SparkContext._gateway is None and not under_spark_submit():
        # The process's first driver JVM, launched by us
        # (`spark_jobs.engine.driver`): its console output goes to logging at
        # its own level, not to stderr (which Airflow shows as errors). (A
        # session stopped earlier in this process leaves its JVM running, and
        # pyspark starts the next context on it.)
        launch = (early.take(options) if early is not None else None) or DriverLaunch(options)
        _import_pandas_meanwhile()
        # pyspark attaches a new context to a gateway it has, instead of launching its own.
        SparkContext._ensure_initialized(gateway=launch.gateway())
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(os.environ.get("MICROBATCH_SPARK_LOG_LEVEL", "ERROR"))
    split_reads(session)
    return session


def split_reads(session: SparkSession) -> None:
    """Read file sources in splits of `SPLIT_BYTES`, unless a split size was
    set already (``--conf``, spark-defaults.conf, a Connect server's
    defaults, the session's owner): then that one stays."""
    if session.conf.get(_SPLIT_KEY) in _SPARK_SPLIT:
        session.conf.set(_SPLIT_KEY, SPLIT_BYTES)


def launch_driver(
    master: str | None = None, app_name: str = "microbatch", *, short_lived: bool = True, delta: bool = False
) -> EarlyDriver:
    """Start the driver JVM of this process's `default_session` (one batch, or
    many when not `short_lived`) now, on a thread; the launch's owner is
    returned. None is launched where that session would not start one (under spark-submit; a JVM already running in this
    process) or ``MICROBATCH_EARLY_DRIVER=0`` says not to (pipelines whose
    runs mostly find nothing new, where the launch costs each such run a
    tenth of a second and its JVM's first CPU)."""
    if os.environ.get(EARLY_DRIVER_ENV, "1") == "0":
        return EarlyDriver(None)
    if under_spark_submit() or ("pyspark" in sys.modules and _has_gateway()):
        return EarlyDriver(None)
    return EarlyDriver(DriverLaunch(session_options(master, app_name, short_lived=short_lived, delta=delta)))


def _has_gateway() -> bool:
    """Whether this process already has a driver JVM (a session, running or stopped)."""
    from pyspark import SparkContext

    return SparkContext._gateway is not None


def session_options(master: str | None, app_name: str, *, short_lived: bool, delta: bool = False) -> dict[str, str]:
    """The Spark configuration of `default_session` (and of its driver's launch)."""
    if master is None and not under_spark_submit():
        master = os.environ.get("MICROBATCH_SPARK_MASTER", "local[*]")
    # Python workers (S3 fetches, Arrow transfers) need this interpreter's
    # packages; Spark's default is whatever `python3` is on the PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master and master.startswith("local"):
        # Bind the driver to loopback: nothing local needs another interface.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    options = {"spark.app.name": app_name}
    if master is not None:  # else spark-submit's --master applies
        options["spark.master"] = master
    options.update({
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": _shuffle_partitions(),
        # Adaptive execution re-plans between stages: worth it for big
        # shuffles, but in a one-batch process, on a cold JVM, its planning
        # cost more than it saved (docs/benchmarks.md, "Figures behind the
        # code's choices").
        "spark.sql.adaptive.enabled": "false" if short_lived else "true",
        "spark.driver.memory": os.environ.get("MICROBATCH_DRIVER_MEMORY", "2g"),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.driver.extraJavaOptions": driver_java_options(short_lived),
        # Hadoop's default local file system looks for a `.<name>.crc` beside
        # each file it reads, and cannot even form that name for a file whose
        # name holds a ':' (common in timestamped names). Source files never
        # have Hadoop checksums, so read them through the raw file system.
        "spark.hadoop.fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    })
    jars = extra_jars() if delta else []
    if jars:
        # delta-spark, for a session that queries Delta with Spark (a
        # user's, the tests'): `format("delta")`, the change feed and Delta's
        # SQL need the JARs and the extension and catalog alike (Delta 4
        # refuses a read without them). The job's own sessions read and
        # write Delta through delta-rs and do without: Delta's extension made
        # a one-batch process's start half a second slower and a catch-up's
        # every batch about a sixth slower (docs/benchmarks.md, "Figures
        # behind the code's choices").
        options["spark.jars"] = ",".join(jars)
        options.update(DELTA_SQL)
        # Delta rebuilds a table's snapshot from its log in 50 tasks by
        # default, sized for logs far larger than a state's or a ledger's:
        # as many as a batch's shuffle made a first read of a 12-version
        # state 1.8 times faster (7.0 s against 12.5 s, docs/benchmarks.md).
        options["spark.databricks.delta.snapshotPartitions"] = options["spark.sql.shuffle.partitions"]
        # Tables on S3 too (`s3://` locations, through hadoop-aws in the same set).
        options.update(s3.spark_read_options())
    if not short_lived:
        # Hash aggregations go straight to Spark's main hash map, without
        # its small first-level map in front: at a batch's tens of
        # thousands of string keys that map overflows, and every row missing
        # it is looked up twice. Measured on a long-lived session's steady
        # batches (docs/benchmarks.md); a one-batch process keeps the default.
        options["spark.sql.codegen.aggregate.map.twolevel.enabled"] = "false"
    return options


def extra_jars() -> list[str]:
    """The JARs a session that queries Delta adds to pyspark's: delta-spark
    and Spark's Kafka connector (`jars/spark/pom.xml`), if set-up fetched
    them; never fetches.

    Through `spark.jars`, so Spark also ships them to a cluster's executors,
    and they sit behind Spark's own class path: a library both have is
    Spark's. Empty when they were not fetched (an installed package without
    its repository): the session is then pyspark's alone, as before, and
    only what needs delta-spark says so.
    """
    folder = os.environ.get(SPARK_JARS_ENV)
    if folder == "none":
        return []
    path = Path(folder) if folder else complete_dir("spark")
    return sorted(str(jar) for jar in path.glob("*.jar")) if path else []


def _shuffle_partitions() -> str:
    """Partitions of a batch's shuffle: a batch is small, and Spark's default
    (200) would be 200 tiny tasks; `MICROBATCH_SHUFFLE_PARTITIONS` overrides."""
    return os.environ.get("MICROBATCH_SHUFFLE_PARTITIONS", "8")


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


def with_reader(spec: PipelineSpec, master: str | None) -> PipelineSpec:
    """`spec` as a run on `master` reads it, its Delta source's `reader: auto`
    resolved: Spark's executors on a cluster or over Spark Connect, where the
    job's process may be a small Airflow task. On `local[*]` it stays
    `auto`: both share one machine, delta-rs reads the small batches chained
    pipelines make faster, and a big batch (`DeltaSource.plan` weighs it)
    is read by Spark's executors, its rows never in this process; the
    driver's, where delta-spark's JARs are not there (not fetched, or
    `MICROBATCH_SPARK_JARS=none`). Under spark-submit (`master`
    None) the driver's too: its session's classpath is spark-submit's, which
    may not hold delta-spark's JARs (`reader: spark` says they are there)."""
    if spec.source.type != "delta" or spec.source.reader != "auto":
        return spec
    remote = master is not None and master.startswith(("spark://", "sc://"))
    if not remote and master is not None and extra_jars():
        return spec  # `local[*]`: each batch by its size (`DeltaSource.plan`)
    source = spec.source.model_copy(update={"reader": "spark" if remote else "driver"})
    return spec.model_copy(update={"source": source})


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
    session.conf.set("spark.sql.shuffle.partitions", _shuffle_partitions())
    split_reads(session)
    return session
