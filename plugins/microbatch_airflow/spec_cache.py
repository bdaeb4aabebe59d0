"""Specs kept, validated, between parses of the DAG files until their file changes.

Airflow parses each DAG file in a new process, every
`min_file_process_interval` (30 s by default), and each parse loaded and
validated every spec of the folder again: the same work, for files nobody
touched, two DAG files times N specs a cycle. A parse now loads a spec
only when its file changed since the parse that kept it.

What is kept: one file per folder of specs, under
``$MICROBATCH_CACHE_DIR/specs`` (by default ``~/.cache/microbatch/specs``),
holding each valid spec (pickled on its own, so that a task's parse
unpickles only the one it needs) with its file's identity (device, inode, size,
modification and change times). The change time moves on every write and
cannot be set back, so an edit is seen even when it keeps the size and
restores the modification time. The code that validated the specs is part
of the key too (a digest of the modules that load and check a spec), so an
upgrade or an edit of that code loads them afresh. A broken spec is not kept: its error is found again at each parse,
as before. The file is local to the machine and rewritten whole (a new file
renamed over the old), so two parses at once lose at most what one of them
loaded; a cache that cannot be read or written is only slower. A folder's
file that no parse rewrote for a week is deleted (the folder is gone, or
loads afresh once).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

from spark_jobs import errors as errors_module
from spark_jobs.core import spec as spec_module
from spark_jobs.core.spec import PipelineSpec, load_spec
from spark_jobs.engine.jvm_cache import CACHE_ENV

from microbatch_airflow import airflow_spec as airflow_spec_module

__all__ = ["SpecCache"]

log = logging.getLogger(__name__)

#: The layout of the cache file; a file of another layout is ignored.
_FORMAT = 2
#: A folder's file not rewritten for this long is deleted by another's write.
_FORGET_AFTER_S = 7 * 24 * 3600


class SpecCache:
    """The specs of one folder as the last parses left them."""

    def __init__(self, folder: Path) -> None:
        root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "microbatch") / "specs"
        digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
        self._file = root / f"{folder.name[:40]}-{digest}.pickle"
        self._code = _code_version()
        self._kept: dict[str, tuple[tuple[int, ...], bytes]] = self._read()
        self._changed = False

    def load(self, path: Path) -> PipelineSpec:
        """`load_spec(path)`, or the spec kept for the file as it is now."""
        try:
            signature = _signature(path)
        except OSError:
            return load_spec(path)  # which says what is wrong with the file
        key = str(path)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == signature:
            return pickle.loads(kept[1])  # noqa: S301 - this cache's own file
        spec = load_spec(path)
        self._kept[key] = (signature, pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        self._changed = True
        return spec

    def save(self, present: list[Path] | None = None) -> None:
        """Write what was loaded; `present`: every spec file of the folder
        (a full scan), whose absence drops a file's entry."""
        if present is not None:
            names = {str(p) for p in present}
            for gone in [k for k in self._kept if k not in names]:
                del self._kept[gone]
                self._changed = True
        if not self._changed:
            return
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self._file.parent, prefix=".tmp-", delete=False) as out:
                pickle.dump({"format": _FORMAT, "code": self._code, "specs": self._kept}, out, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(out.name, self._file)
            _forget_old(self._file.parent)
        except OSError as exc:
            log.debug("could not keep the specs in %s (%s): the next parse loads them again", self._file, exc)
            try:
                os.unlink(out.name)
            except (OSError, UnboundLocalError):
                pass
        self._changed = False

    def _read(self) -> dict[str, tuple[tuple[int, ...], bytes]]:
        try:
            with self._file.open("rb") as kept:
                data: Any = pickle.load(kept)
        except FileNotFoundError:
            return {}
        except Exception as exc:  # noqa: BLE001 - a damaged cache is only a slower parse
            log.debug("ignoring the kept specs in %s (%s)", self._file, exc)
            return {}
        if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("code") != self._code:
            return {}
        return dict(data["specs"])


def _forget_old(root: Path) -> None:
    """Drop the files of folders no parse has written for a week (folders
    gone, or unchanged for that long: those load afresh once)."""
    cutoff = time.time() - _FORGET_AFTER_S
    for kept in root.glob("*.pickle"):
        try:
            if kept.stat().st_mtime < cutoff:
                kept.unlink()
        except OSError:
            pass


def _signature(path: Path) -> tuple[int, ...]:
    found = path.stat()
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


def _code_version() -> str:
    """A digest of the code that loads and validates a spec, as installed
    now: `spark_jobs.core` (the spec's models and the modules their checks
    use), the errors, and the plugin's `airflow:` block (1.6 ms a parse)."""
    digest = hashlib.sha256()
    for path in [*sorted(Path(spec_module.__file__ or "").parent.glob("*.py")), Path(errors_module.__file__ or ""), Path(airflow_spec_module.__file__ or "")]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]
