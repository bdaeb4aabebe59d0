"""The Spark Connect server the project starts: a spark-submit application.

    spark-submit [--master ...] [--conf ...] spark_jobs/engine/connect_server.py

`make airflow ENGINE=connect`, the compose file's `spark-connect` service and
the tests start this rather than Spark's own `SparkConnectServer` class.
The difference is in its settings: Spark's class forces
`spark.sql.artifact.isolation.enabled` and `...alwaysApplyClassloader` on,
which gives every client session its own class loader, on the driver and in
the executors. Spark keys its cache of compiled code by class loader, and
every Airflow task is a new Connect session. So every batch compiled its
whole-stage code anew, with Janino resolving each name through the session's
loader: about fourteen classes, and 0.50 of the server's 1.47 CPU-s a batch
in a fleet of small pipelines (a JFR profile, docs/fleet.md). Here the
sessions share the application's loader, and code compiled for one batch
serves the next: the same batch cost 0.97 CPU-s.

What that gives up: artifacts that a client adds to its session (JARs and
class files that a Scala client uploads, `addArtifacts`) are visible to the
other sessions. The project's clients add none. A server shared with clients
that must not see each other's code should run Spark's class instead; the
jobs run the same on both.

Its launchers (`make airflow ENGINE=connect`, the compose file, the tests)
also start its JVM with `JVM_OPTIONS`: the C1 compiler alone. A fleet's
small batch is mostly Spark planning it (analysing, optimising, serialising
tasks), code that C2 kept compiling batch after batch: on loopback, a
pipeline's first batch after 40 others cost the server 1.18 CPU-s with the
JVM's tiered compilation, 0.54 of them in C2's threads, and 0.57 with C1
alone, in the same wall time. The price is in large batches whose rows the
server's own JVM processes (`local[*]`, as `make airflow` runs it; in the
compose stack the executors are the workers' JVMs, which keep C2): a batch
of 300,000 records cost the same either way, one of 1,000,000 about 1.3x
the CPU as a pipeline's first batch and 2.5x as its second
(docs/fleet.md). They are `spark.driver.defaultJavaOptions`, which replaces
one set in `spark-defaults.conf`; a server's own options belong in
`spark.driver.extraJavaOptions` (`make airflow CONNECT_JAVA_OPTIONS=...`),
which come after them: `-XX:TieredStopAtLevel=4` there brings C2 back.

Everything else is Spark's server as `SparkConnectService.start` makes it,
with the settings given on the command line. It stops on SIGTERM or SIGINT,
and with its JVM. It imports nothing from this package: the compose image
runs it as a file.
"""

from __future__ import annotations

import os
import signal
import threading

#: Off: sessions share the application's class loader and its compiled code (see above).
SHARED_CODE = {
    "spark.sql.artifact.isolation.enabled": "false",
    "spark.sql.artifact.isolation.alwaysApplyClassloader": "false",
}

#: How many compiled classes the server keeps, unless the command line says:
#: Spark's default, 100, holds the classes of a few dozen distinct
#: pipelines (a first batch compiles a dozen, the next pipeline's two or
#: three of its own), past which every batch compiles again (least recently
#: used first out). A thousand small generated classes take tens of MB.
CODE_CACHE = ("spark.sql.codegen.cache.maxEntries", "1000")


#: The server JVM's options (`spark.driver.defaultJavaOptions`), given by its
#: launchers on spark-submit's command line: the JVM is running by the
#: time this file is.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1"


#: What PySpark leaves in a process's environment once it opened a Connect
#: session; a server started from such a process (a test's, say) would
#: inherit it and take itself for a Connect client. (`SPARK_REMOTE` is not
#: among them: spark-submit itself refuses to start with it set.)
CLIENT_MARKS = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE")


def main() -> None:
    for name in CLIENT_MARKS:
        os.environ.pop(name, None)
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    SparkContext._ensure_initialized()  # the JVM spark-submit started, with the command line's settings
    builder = SparkSession.builder
    for key, value in SHARED_CODE.items():
        builder = builder.config(key, value)
    if not SparkConf().contains(CODE_CACHE[0]):
        builder = builder.config(*CODE_CACHE)
    spark = builder.getOrCreate()
    # New Connect sessions are made from this default session
    # (`newSession()`), so they inherit its settings.
    service = spark._jvm.org.apache.spark.sql.connect.service.SparkConnectService
    service.start(spark.sparkContext._jsc.sc())
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # This process is the JVM's child (spark-submit runs a Python
    # application that way): a JVM stopped on its own must not leave it behind.
    while not stop.wait(5):
        if not _alive(spark):
            return
    if _alive(spark):
        spark.stop()


def _alive(spark: object) -> bool:
    """Whether the JVM still answers and its SparkContext runs."""
    try:
        return not spark.sparkContext._jsc.sc().isStopped()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - any failure to reach the JVM means it is gone
        return False


if __name__ == "__main__":
    main()
