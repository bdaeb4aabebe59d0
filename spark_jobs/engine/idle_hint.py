"""Whether a run will likely find nothing new: a hint for launching the driver JVM early.

A one-batch run launches its driver JVM before it plans, so that the JVM
boots while the run reads the ledger and lists the source
(`spark_jobs.engine.driver`). A run that then finds nothing new stops the
JVM unused: 0.83 CPU-s and 0.57 s of wall time each (issue 36), which a
pipeline polled every minute pays sixty times an hour.

So a run that found nothing new leaves the source's *fingerprint* behind
(`record`), and the next run compares before launching (`unchanged`): the
same fingerprint means nothing arrived since that run found nothing, so the
JVM is not launched early. The run still plans as always, and starts Spark
if it finds a batch after all (a rewind in between, say): the hint only
decides whether the JVM boots during planning, never what a run reads.

Fingerprints (`fingerprint`) are what can be read in a millisecond without
a network call or a library import: a local folder's listing (names,
sizes, modification times) for a files source, or the newest log entry of a
local Delta source, with the newest log entry of the pipeline's local
ledger (so a rewind, which makes consumed data new again, changes it too).
Sources on S3 and Kafka topics have none (their listing or watermarks cost
a network round trip before the launch), and their runs launch early as
before. The deferrable sensor's trigger uses the same fingerprint between
its polls (`microbatch_airflow.triggers`). Hints live in ``$MICROBATCH_CACHE_DIR/idle`` (by
default ``~/.cache/microbatch/idle``), one small file per pipeline and
checkpoint, local to the machine: on another worker the hint is simply
absent.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from spark_jobs.local_cache import cache_home

if TYPE_CHECKING:
    from spark_jobs.core.spec import PipelineSpec

__all__ = ["IdleHint", "fingerprint", "fingerprint_at", "fingerprint_parts", "watched"]

log = logging.getLogger("microbatch")


class IdleHint:
    """The fingerprint of one pipeline's source, as its last idle run left it."""

    def __init__(self, spec: PipelineSpec) -> None:
        key = hashlib.sha256(f"{spec.name}\0{spec.checkpoint_path}\0{spec.source_path}".encode()).hexdigest()[:16]
        self._file = cache_home() / "idle" / f"{spec.name[:40]}-{key}"
        #: Taken before the run plans: data landing during the run changes the next run's.
        self._now = fingerprint(spec)

    def unchanged(self) -> bool:
        """Whether the source looks as it did when a run last found nothing new."""
        if self._now is None:
            return False
        try:
            return self._file.read_text() == self._now
        except OSError:
            return False

    def record(self, idle: bool) -> None:
        """After a run: it found nothing new (`idle`), or it processed or failed (forget the hint)."""
        try:
            if idle and self._now is not None:
                self._file.parent.mkdir(parents=True, exist_ok=True)
                temporary = self._file.with_name(f".{self._file.name}.{os.getpid()}")
                temporary.write_text(self._now)
                temporary.replace(self._file)
            else:
                self._file.unlink(missing_ok=True)
        except OSError as exc:  # a hint only: a read-only home costs early launches, nothing else
            log.debug("idle hint not kept (%s)", exc)


def fingerprint(spec: PipelineSpec) -> str | None:
    """A digest of what the source holds and of the ledger's newest entry, if
    both can be read locally in about a millisecond (see the module docstring); else None."""
    parts = fingerprint_parts(spec)
    return None if parts is None else hashlib.sha256("\0".join(parts).encode()).hexdigest()


def fingerprint_parts(spec: PipelineSpec) -> tuple[str, str] | None:
    """`fingerprint`'s two halves: (the ledger's newest entry, the source's
    digest). Apart, a watcher can tell data landing from the ledger moving."""
    return fingerprint_at(*watched(spec))


def watched(spec: PipelineSpec) -> tuple[str, str, str]:
    """What a fingerprint looks at: the source's type, its location and the
    ledger's, resolved (a caller that polls keeps them: resolving a path
    asks the file system about each of its folders)."""
    return spec.source.type, spec.source_path, spec.ledger_path


def fingerprint_at(source_type: str, source_path: str, ledger_path: str) -> tuple[str, str] | None:
    """`fingerprint_parts` of what `watched` named."""
    if source_type not in ("files", "delta"):
        return None
    source, ledger = _local(source_path), _local(ledger_path)
    if source is None or ledger is None:
        return None
    digest = hashlib.sha256()
    try:
        head = _newest_entry(ledger)
        if source_type == "delta":
            digest.update(_newest_entry(source).encode())
        else:
            for name, size, mtime in sorted(_walk(source)):
                digest.update(f"{name}\0{size}\0{mtime}\n".encode())
    except OSError:
        return None
    return head, digest.hexdigest()


def _local(location: str) -> Path | None:
    if "://" in location and not location.startswith("file:"):
        return None
    return Path(location.removeprefix("file://"))


def _newest_entry(table: Path) -> str:
    """The name of a local Delta table's newest log entry ('' before it has one)."""
    try:
        names = [e.name for e in os.scandir(table / "_delta_log") if e.name.endswith((".json", ".checkpoint.parquet"))]
    except FileNotFoundError:
        return ""
    return max(names, default="")


def _walk(folder: Path):
    """(relative name, size, mtime in ns) of every file under `folder` that
    the source's listing would take (`is_ready`): a file still being written
    under a hidden or in-progress name is no news yet."""
    from spark_jobs.sources.files import is_ready

    stack = [folder]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if not is_ready(entry.name):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                else:
                    info = entry.stat()
                    yield os.path.relpath(entry.path, folder), info.st_size, info.st_mtime_ns
