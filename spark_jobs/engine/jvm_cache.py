"""The driver JVM's flags, and its class-data sharing (AppCDS) archives.

One micro-batch per process means the JVM starts cold every run, and most of
Spark's start-up is loading and verifying some ten thousand classes. Java 17
can dump the classes a run loaded into an archive (``-XX:ArchiveClassesAtExit``)
and map it on later starts (``-XX:SharedArchiveFile``), which roughly halves
Spark's start (figures in docs/benchmarks.md). `spark-submit` first runs a
small launcher JVM that only works out the driver's command line; it gets an
archive of its own and the same short-lived flags (``SPARK_LAUNCHER_OPTS``).

This module only names the archives and picks the flags, so a session can
import it without importing the protocol. `python -m spark_jobs.demo.warm_jvm`
(run by `make setup`) builds the archives with a small real batch. Runs use
them only if they exist. They are keyed by the pyspark version and install
location and by the Java binary (its resolved path, size and modification
time: a stat, not a `java -version`, which cost a tenth of a second a run);
a mismatch makes the JVM silently skip an archive (``-Xshare:auto`` is the
default; its log lines are switched off).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path

from spark_jobs.local_cache import CACHE_ENV, cache_home

__all__ = [
    "CACHE_ENV",
    "LAUNCHER_ENV",
    "OPTIONS_ENV",
    "SHORT_JOB_JVM_OPTIONS",
    "archive_path",
    "driver_java_options",
    "launcher_archive_path",
    "launcher_java_options",
]

#: A one-batch process lives for seconds: the C1 compiler alone reaches fast
#: enough code sooner than tiered C2, and the serial collector starts
#: cheapest. A long-lived session running many batches wants C2, so it does
#: not get these (both measured in docs/benchmarks.md): it runs the JVM's
#: defaults. (C2 directives and higher tier-4 thresholds for it were tried
#: and taken out: re-measured in interleaved rounds, their gain was not
#: clear; docs/benchmarks.md, "JVM start-up choices".)
SHORT_JOB_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
OPTIONS_ENV = "MICROBATCH_DRIVER_JAVA_OPTIONS"
#: Read by `spark-class` for the launcher JVM that builds the driver's command line.
LAUNCHER_ENV = "SPARK_LAUNCHER_OPTS"


@functools.cache
def _java_identity() -> str:
    """The Java binary `spark-class` will run (``$JAVA_HOME/bin/java``, else
    the one on the PATH), as resolved path, size and modification time: a
    new or upgraded JDK gets new archives."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java:
        return "no java"
    try:
        real = os.path.realpath(java)
        st = os.stat(real)
    except OSError:
        return f"unreadable {java}"
    return f"{real}|{st.st_size}|{st.st_mtime_ns}"


@functools.cache
def _pyspark() -> tuple[str, str]:
    """pyspark's version and location, found without importing it: a run
    launches its driver before it imports pyspark (`spark_jobs.engine.driver`)."""
    found = importlib.util.find_spec("pyspark")
    return importlib.metadata.version("pyspark"), str(found.origin if found else None)


def _archive(jvm: str) -> Path:
    """Where the archive of `jvm` ("driver" or "launcher") lives."""
    version, location = _pyspark()
    key = hashlib.sha256(f"{version}|{_java_identity()}|{location}".encode()).hexdigest()[:16]
    return cache_home() / f"spark-{jvm}-{version}-{key}.jsa"


def _mapping(archive: Path) -> str:
    """The flags that map `archive`, quietly."""
    return f"-XX:SharedArchiveFile={archive} -Xlog:cds=off -Xlog:cds+dynamic=off"


def archive_path() -> Path:
    """The driver JVM's archive."""
    return _archive("driver")


def launcher_archive_path() -> Path:
    """The `spark-submit` launcher JVM's archive."""
    return _archive("launcher")


def driver_java_options(short_lived: bool = True) -> str:
    """JVM options for the driver: the env override, else the flags for the
    session's life span plus the class archive if it has been built."""
    if OPTIONS_ENV in os.environ:
        return os.environ[OPTIONS_ENV]
    options = [SHORT_JOB_JVM_OPTIONS] if short_lived else []
    archive = archive_path()
    if archive.is_file():
        options.append(_mapping(archive))
    return " ".join(options)


def launcher_java_options() -> str | None:
    """Options for `spark-submit`'s launcher JVM, or None to leave it alone
    (no archive yet, or ``SPARK_LAUNCHER_OPTS`` already set by the user).
    It runs for a tenth of a second, so it always gets the short-lived flags."""
    if LAUNCHER_ENV in os.environ:
        return None
    archive = launcher_archive_path()
    if not archive.is_file():
        return None
    return f"{SHORT_JOB_JVM_OPTIONS} {_mapping(archive)}"
