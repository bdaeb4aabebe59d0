"""The driver JVM's flags, and its class-data sharing (AppCDS) archive.

One micro-batch per process means the JVM starts cold every run, and most of
Spark's start-up is loading and verifying some ten thousand classes. Java 17
can dump the classes a run loaded into an archive (``-XX:ArchiveClassesAtExit``)
and map it on later starts (``-XX:SharedArchiveFile``), which roughly halves
Spark's start (figures in docs/benchmarks.md).

This module only names the archive and picks the flags, so a session can
import it without importing the protocol. `python -m spark_jobs.demo.warm_jvm`
(run by `make setup`) builds the archive with a small real batch. Runs use it
only if it exists. It is keyed by the pyspark version, the Java version and
the install location; a mismatch makes the JVM silently skip it
(``-Xshare:auto`` is the default; its log lines are switched off).
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path

__all__ = ["CACHE_ENV", "OPTIONS_ENV", "SHORT_JOB_JVM_OPTIONS", "archive_path", "driver_java_options"]

#: A one-batch process lives for seconds: the C1 compiler alone reaches fast
#: enough code sooner than tiered C2, and the serial collector starts
#: cheapest. A long-lived session running many batches wants C2, so it does
#: not get these (both measured in docs/benchmarks.md).
SHORT_JOB_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
OPTIONS_ENV = "MICROBATCH_DRIVER_JAVA_OPTIONS"
CACHE_ENV = "MICROBATCH_CACHE_DIR"


@functools.cache
def _java_version() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.splitlines()[0] if out else "unknown"


def archive_path() -> Path:
    import pyspark

    key = hashlib.sha256(f"{pyspark.__version__}|{_java_version()}|{pyspark.__file__}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "microbatch")
    return cache / f"spark-driver-{pyspark.__version__}-{key}.jsa"


def driver_java_options(short_lived: bool = True) -> str:
    """JVM options for the driver: the env override, else the flags for the
    session's life span plus the class archive if it has been built."""
    if OPTIONS_ENV in os.environ:
        return os.environ[OPTIONS_ENV]
    options = [SHORT_JOB_JVM_OPTIONS] if short_lived else []
    archive = archive_path()
    if archive.is_file():
        options.append(f"-XX:SharedArchiveFile={archive} -Xlog:cds=off -Xlog:cds+dynamic=off")
    return " ".join(options)
