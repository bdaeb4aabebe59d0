"""A class-data sharing (AppCDS) archive for the Spark driver JVM.

One micro-batch per process means the JVM starts cold every run, and most of
Spark's start-up is loading and verifying some ten thousand classes. Java 17
can dump the classes a run loaded into an archive (``-XX:ArchiveClassesAtExit``)
and map it on later starts (``-XX:SharedArchiveFile``): measured here, Spark's
start went from 4.3 s to 2.2 s and a cold 100k-record batch from 11.3 s to 7.2 s
(docs/benchmarks.md).

`python -m spark_jobs.jvm_cache` (run by `make setup`) builds the archive with
a small real batch in a scratch folder. The JVM writes it when it exits, so
it is written under a temporary name and renamed into place only after the
JVM has exited: a run never maps a half-written archive. Runs use it only if
it exists. It is keyed by the pyspark version, the Java version and the
install location; a mismatch makes the JVM silently skip it
(``-Xshare:auto`` is the default; its log lines are switched off).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: A one-batch process lives for seconds: the C1 compiler alone reaches fast
#: enough code sooner than tiered C2 (cold 100k batch 7.1 s vs 8.6 s here), and
#: the serial collector starts cheapest. A long-lived session running many
#: batches wants C2 (warm batches 1.8 s vs 2.4 s), so it does not get these.
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


def _warm_up(workdir: str) -> None:
    """Run one small real batch (JSON, quarantine, transform, merge), then stop the JVM."""
    import yaml
    from pyspark import SparkContext

    from spark_jobs.clickstream import ORACLE_MERGE, ORACLE_TRANSFORM, write_wave
    from spark_jobs.protocol import run_batch
    from spark_jobs.spec import load_spec

    folder = Path(workdir)
    spec = {
        "name": "warm_up",
        "source": {"type": "files", "path": "in", "format": "json",
                   "schema": "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"},
        "transform": ORACLE_TRANSFORM,
        "state": {"path": "state", "keys": ["user_id"], "merge": ORACLE_MERGE},
        "checkpoint": "checkpoint",
    }
    (folder / "warm.yaml").write_text(yaml.safe_dump(spec))
    write_wave(folder / "in", 0, files=2, records_per_file=500, bad_every=50)
    run_batch(load_spec(folder / "warm.yaml"))
    # The archive is written when the JVM exits: end it and wait.
    gateway = SparkContext._gateway
    if gateway is not None:
        proc = gateway.proc
        gateway.shutdown()
        proc.stdin.close()
        proc.wait(timeout=300)


def build(force: bool = False) -> Path | None:
    """Build the archive if missing. Returns its path, or None if it could not be built."""
    target = archive_path()
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="microbatch-jvm-warm-")
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        env = {**os.environ, OPTIONS_ENV: f"{SHORT_JOB_JVM_OPTIONS} -XX:ArchiveClassesAtExit={partial}"}
        result = subprocess.run(
            [sys.executable, "-m", "spark_jobs.jvm_cache", "--warm-up", workdir],
            env=env, capture_output=True, text=True, timeout=600,
        )
        if result.returncode != 0 or not partial.is_file():
            sys.stderr.write(f"microbatch: no JVM class archive (runs work, start slower):\n{result.stderr[-2000:]}\n")
            return None
        os.replace(partial, target)
        return target
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        partial.unlink(missing_ok=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--warm-up":
        _warm_up(sys.argv[2])
        return
    path = build(force="--force" in sys.argv)
    print(f"JVM class archive: {path}" if path else "JVM class archive: not built")


if __name__ == "__main__":
    main()
