"""Build the JVM class archives (`spark_jobs.engine.jvm_cache`).

`python -m spark_jobs.demo.warm_jvm` (run by `make setup`) runs one small real
batch (JSON, quarantine, transform, merge) in a child process whose JVMs (the
driver, and `spark-submit`'s launcher before it) dump the classes they
loaded when they exit. Each archive is written under a temporary name and
renamed into place only after its JVM has exited: a run never maps a
half-written archive. Present archives are kept; `--force` rebuilds them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from spark_jobs.engine.jvm_cache import LAUNCHER_ENV, OPTIONS_ENV, SHORT_JOB_JVM_OPTIONS, archive_path, launcher_archive_path


def _warm_up(workdir: str) -> None:
    """Run one small real batch, then stop the JVM so that it writes the archive."""
    import yaml
    from pyspark import SparkContext

    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import ORACLE_MERGE, ORACLE_TRANSFORM, write_wave
    from spark_jobs.engine import compute_factory

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
    loaded = load_spec(folder / "warm.yaml")
    factory = compute_factory(loaded)
    run_batch(factory.spec, RunOptions(run_id="warm-jvm"), factory)
    # The archive is written when the JVM exits: end it and wait.
    gateway = SparkContext._gateway
    if gateway is not None:
        proc = gateway.proc
        gateway.shutdown()
        proc.stdin.close()
        proc.wait(timeout=300)


def build(force: bool = False) -> Path | None:
    """Build the archives if either is missing. Returns the driver's, or None if it could not be built."""
    targets = [archive_path(), launcher_archive_path()]
    if all(t.is_file() for t in targets) and not force:
        return targets[0]
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="microbatch-jvm-warm-")
    partials = [t.with_name(f".{t.name}.{os.getpid()}.tmp") for t in targets]
    try:
        env = {
            **os.environ,
            OPTIONS_ENV: f"{SHORT_JOB_JVM_OPTIONS} -XX:ArchiveClassesAtExit={partials[0]}",
            LAUNCHER_ENV: f"{SHORT_JOB_JVM_OPTIONS} -XX:ArchiveClassesAtExit={partials[1]}",
        }
        result = subprocess.run(
            [sys.executable, "-m", "spark_jobs.demo.warm_jvm", "--warm-up", workdir],
            env=env, capture_output=True, text=True, timeout=600,
        )
        if result.returncode != 0 or not partials[0].is_file():
            sys.stderr.write(f"microbatch: no JVM class archive (runs work, start slower):\n{result.stderr[-2000:]}\n")
            return None
        for partial, target in zip(partials, targets):
            if partial.is_file():  # (the launcher's is a bonus: runs work without it)
                os.replace(partial, target)
        return targets[0]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        for partial in partials:
            partial.unlink(missing_ok=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--warm-up":
        _warm_up(sys.argv[2])
        return
    path = build(force="--force" in sys.argv)
    print(f"JVM class archive: {path}" if path else "JVM class archive: not built")


if __name__ == "__main__":
    main()
