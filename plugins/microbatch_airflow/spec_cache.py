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
of the key too (its modules' sizes and times, pydantic's and PyYAML's
versions), so an upgrade or an edit of that code loads them afresh. With
storage roots set (`MICROBATCH_STORAGE_ROOTS`), what a spec's file does not
decide is checked again at every parse: its locations against the roots as
they are now, through the symlinks on disk now. (Without roots, the one
check that reads the disk is whether two of a spec's locations overlap
through a symlink; a run loads its spec afresh and refuses such a spec
before any write, as it always did.) The cache is a pickle, which runs code as it loads:
it is read and written only in a folder no other user may write. A broken spec is not kept: its error is found again at each parse,
and the file's last valid spec stays kept beside it (`last_valid`), so that a
pipeline whose live spec breaks keeps its DAG and schedule, and its runs
fail with the spec's error where Airflow alerts on them. Its text is kept
too, apart from the code's key, so an upgrade while a spec is broken parses
it again rather than forget it; deleting the cache while a spec is broken
does forget it (that pipeline's DAG goes until the spec is fixed). The file is local to the machine and rewritten whole (a new file
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import spark_jobs
from spark_jobs.core.spec import PipelineSpec, check_locations, load_spec, parse_spec
from spark_jobs.errors import SpecError
from spark_jobs.storage.roots import roots_from_env
from spark_jobs.local_cache import cache_home

from microbatch_airflow import airflow_spec as airflow_spec_module

__all__ = ["SpecCache"]

log = logging.getLogger(__name__)

#: The layout of the cache file; a file of another layout is ignored.
_FORMAT = 3
#: A folder's file not rewritten for this long is deleted by another's write.
_FORGET_AFTER_S = 7 * 24 * 3600


class SpecCache:
    """The specs of one folder as the last parses left them."""

    def __init__(self, folder: Path) -> None:
        root = cache_home() / "specs"
        digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
        self._file = root / f"{folder.name[:40]}-{digest}.pickle"
        self._code = _code_version()
        self._kept: dict[str, tuple[tuple[int, ...], bytes]]
        #: Each file's text when a parse last loaded it valid: kept across
        #: upgrades of the code (which drop `_kept`), for `last_valid`.
        self._texts: dict[str, str]
        self._kept, self._texts = self._read()
        self._changed = False

    def load(self, path: Path, check: Callable[[PipelineSpec], object] | None = None) -> PipelineSpec:
        """`load_spec(path)`, or the spec kept for the file as it is now.
        `check`: what else a spec must pass (the `airflow:` block) to be
        kept, so that `last_valid` is a spec a DAG can be built from."""
        try:
            signature = _signature(path)
        except OSError:
            return load_spec(path)  # which says what is wrong with the file
        key = str(path)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == signature:
            spec = _unpickled(kept[1])
            if spec is not None:
                if roots_from_env():
                    # What the file alone does not decide is checked again:
                    # the storage roots (the environment) and where the
                    # spec's locations resolve to now (symlinks on disk).
                    check_locations(spec, path.read_text(encoding="utf-8"))
                return spec
        spec = load_spec(path)
        if check is not None:
            check(spec)
        self._kept[key] = (signature, pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        try:
            self._texts[key] = path.read_text(encoding="utf-8")
        except OSError:
            pass  # (changed again since: the next parse keeps that one)
        self._changed = True
        return spec

    def last_valid_text(self, path: Path) -> str | None:
        """The file's text when a parse last loaded it valid (None if none kept)."""
        return self._texts.get(str(path))

    def last_valid(self, path: Path, check: Callable[[PipelineSpec], object] | None = None) -> PipelineSpec | None:
        """The spec the file held when a parse last loaded it valid, whatever
        it holds now: kept as loaded, or (after an upgrade of the code, which
        drops those) its text parsed again by the code now, if that code
        takes it (`check` too). None if none was kept: a spec never valid
        here, or a cache deleted."""
        kept = self._kept.get(str(path))
        spec = _unpickled(kept[1]) if kept is not None else None
        text = self._texts.get(str(path))
        if spec is None and text is not None:
            try:
                spec = parse_spec(text, base_dir=path.parent, spec_path=str(path))
                if check is not None:
                    check(spec)
            except SpecError:
                return None
        return spec

    def save(self, present: list[Path] | None = None) -> None:
        """Write what was loaded; `present`: every spec file of the folder
        (a full scan), whose absence drops a file's entry."""
        if present is not None:
            names = {str(p) for p in present}
            for gone in [k for k in {*self._kept, *self._texts} if k not in names]:
                self._kept.pop(gone, None)
                self._texts.pop(gone, None)
                self._changed = True
        if not self._changed:
            return
        try:
            self._file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _trusted(self._file.parent):
                return
            with tempfile.NamedTemporaryFile(dir=self._file.parent, prefix=".tmp-", delete=False) as out:
                kept = {"format": _FORMAT, "code": self._code, "specs": self._kept, "texts": self._texts}
                pickle.dump(kept, out, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(out.name, self._file)
            _forget_old(self._file.parent)
        except OSError as exc:
            log.debug("could not keep the specs in %s (%s): the next parse loads them again", self._file, exc)
            try:
                os.unlink(out.name)
            except (OSError, UnboundLocalError):
                pass
        self._changed = False

    def _read(self) -> tuple[dict[str, tuple[tuple[int, ...], bytes]], dict[str, str]]:
        """The kept specs (none if other code wrote them) and the last valid texts."""
        try:
            if not _trusted(self._file):
                log.warning("not reading the kept specs in %s: it or its folder is not this user's alone", self._file)
                return {}, {}
            with self._file.open("rb") as kept:
                data: Any = pickle.load(kept)  # noqa: S301 - a file only this user can write (`_trusted`)
        except FileNotFoundError:
            return {}, {}
        except Exception as exc:  # noqa: BLE001 - a damaged cache is only a slower parse
            log.debug("ignoring the kept specs in %s (%s)", self._file, exc)
            return {}, {}
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            return {}, {}
        texts = {k: v for k, v in (data.get("texts") or {}).items() if isinstance(v, str)}
        return (dict(data["specs"]) if data.get("code") == self._code else {}), texts


def _unpickled(data: bytes) -> PipelineSpec | None:
    """A kept spec, or None for an entry that does not load (then the file is loaded)."""
    try:
        spec = pickle.loads(data)  # noqa: S301 - from a file only this user can write (`_trusted`)
    except Exception as exc:  # noqa: BLE001 - a damaged entry is only a slower parse
        log.debug("a kept spec does not load (%s): loading its file", exc)
        return None
    return spec if isinstance(spec, PipelineSpec) else None


def _trusted(path: Path) -> bool:
    """Whether `path` and its folder belong to this user and no one else may
    write them: a pickle runs code as it loads, so the cache is read (and
    written) only where another user could not have put it, as ssh treats
    its keys. Raises FileNotFoundError for a missing file."""
    uid = os.getuid()
    for found in (path.stat(), path.parent.stat()):
        if found.st_uid != uid or found.st_mode & 0o022:
            return False
    return True


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
    """What identifies the code that loads and validates a spec, as installed
    now: each module of `spark_jobs` and the plugin's `airflow:` block by
    name, size and modification time (0.8 ms; their contents would take 20),
    and the versions of pydantic and PyYAML."""
    import pydantic
    import yaml

    digest = hashlib.sha256(f"{pydantic.VERSION}|{yaml.__version__}".encode())
    package = Path(spark_jobs.__file__ or "").parent
    for path in [*sorted(package.rglob("*.py")), Path(airflow_spec_module.__file__ or "")]:
        found = path.stat()
        digest.update(f"{path}|{found.st_size}|{found.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]
