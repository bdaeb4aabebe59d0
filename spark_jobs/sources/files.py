"""Files as a source, each file consumed exactly once: one planner over a lister.

Like Spark's file stream source, the offset is a position in a log of
consumed files, not a file name: ``{"files": n}`` means "the first n files of
this pipeline's history", and each batch's manifest lists the files it took.
The set of consumed files is the union of the manifests of the batches in the
current lineage; the planner asks the lineage about the files it lists
(`Lineage.consumed`), which answers from the consumed index without reading
every manifest. Consequences:

* a file that lands late, or whose name sorts before files already consumed,
  is picked up by the next batch (it is not in the consumed set) and never
  twice (once consumed, it is in the set);
* a file's identity is its path relative to the source folder: rewriting a
  consumed file in place is not seen again. Land new data as new files.
  (With `after_commit: delete` or `archive`, consumed names leave the folder
  and may be used again, so a file is then its name, size and mtime.)

Files still being written are ignored: names starting with ``.`` or ``_``
(Spark's and Hadoop's convention for hidden and temporary files, also applied
to folders) and the usual in-progress suffixes. Writers should write under
such a name and rename into place, which is atomic on local disks.

A file's arrival time is its modification time; `plan(until=...)` takes only
files that had arrived before `until` (the end of an Airflow data interval).

Where the files live is the lister's business: `LocalLister` walks a folder,
`spark_jobs.sources.s3.S3Lister` pages through an S3 prefix. Planning, caps,
readability checks and record counts are shared here.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Protocol, cast

from spark_jobs.errors import SourceChangedError, SourceError, first_line
from spark_jobs.sources.base import BatchRange, Caps, Lag, Lineage

__all__ = [
    "HADOOP_GLOB_CHARS",
    "FileOffsets",
    "FilesManifest",
    "FilesSource",
    "Lister",
    "LocalLister",
    "SourceFile",
    "count_records",
    "is_ready",
    "parquet_row_count",
]

log = logging.getLogger("microbatch")

#: Compared lower-cased. `._copying_` is what `hadoop fs -put` / `distcp`
#: write before renaming into place (Spark's file index skips it too).
IN_PROGRESS_SUFFIXES = (
    ".tmp", ".temp", ".partial", ".part", ".inprogress", ".crc", ".swp", ".copying", "._copying_", "~"
)

#: Characters Spark's file readers treat as a glob pattern (escaped when read).
HADOOP_GLOB_CHARS = "[]{}*?\\"


def is_ready(name: str) -> bool:
    """Whether a file or folder name can hold finished data."""
    return not (name.startswith((".", "_")) or name.lower().endswith(IN_PROGRESS_SUFFIXES))


@dataclass(frozen=True)
class SourceFile:
    """One listed file, as a manifest records it."""

    name: str  # path relative to the source folder, '/'-separated
    uri: str
    size: int
    mtime_ms: int
    #: Which file this is beyond its size and time, where the store says:
    #: a local file's inode (a file renamed over it is another inode, even
    #: with the same size and time: `cp -p`, `rsync -t`), an S3 object's
    #: ETag. None in manifests written before it.
    tag: str | None = None

    def to_dict(self) -> dict[str, Any]:
        entry = {"name": self.name, "uri": self.uri, "size": self.size, "mtime_ms": self.mtime_ms}
        return {**entry, "tag": self.tag} if self.tag is not None else entry

    def same_as(self, now: SourceFile) -> bool:
        """Whether `now` (the file as listed now) is this very file."""
        same = (now.size, now.mtime_ms) == (self.size, self.mtime_ms)
        return same and (self.tag is None or now.tag is None or now.tag == self.tag)

    @property
    def version(self) -> str:
        """Which content of the name this is, as far as a listing can tell:
        size, time and, where known, the tag."""
        return f"{self.size}:{self.mtime_ms}" + (f":{self.tag}" if self.tag is not None else "")

    @property
    def untagged(self) -> str:
        """`version` as recorded before files had tags."""
        return f"{self.size}:{self.mtime_ms}"

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> SourceFile:
        return cls(entry["name"], entry["uri"], entry.get("size", 0), entry.get("mtime_ms", 0), entry.get("tag"))


@dataclass(frozen=True)
class FileOffsets:
    """How many files the pipeline's history has consumed."""

    files: int

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files}


@dataclass(frozen=True)
class FilesManifest:
    """The files of one batch, in the order they were planned."""

    files: tuple[SourceFile, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"files": [f.to_dict() for f in self.files]}

    def inputs(self) -> list[str]:
        return [f.name for f in self.files]

    def input_bytes(self) -> int | None:
        return sum(f.size for f in self.files)

    def describe(self) -> str:
        return f"{len(self.files)} file(s)"

    def units(self) -> list[tuple[str, str]]:
        return [(f.name, f.version) for f in self.files]

    @property
    def uris(self) -> list[str]:
        return [f.uri for f in self.files]


class Lister(Protocol):
    """Where a files source's files live."""

    #: The folder or prefix, as the spec resolves it.
    root: str

    def list(self, until: datetime | None) -> list[SourceFile]:
        """Ready files that arrived before `until` (all of them if None)."""

    def open(self, f: SourceFile) -> IO[bytes]:
        """The file's bytes (for record counts and Parquet footers)."""

    def stat(self, f: SourceFile) -> SourceFile | None:
        """The file as it is now (size, mtime), or None if it is gone."""

    def check_readable(self, f: SourceFile, fmt: str) -> None:
        """Raise `SourceError` naming `f` if the batch could not read it."""

    def recover(self, consumed: Callable[[SourceFile], bool], archive: str | None) -> int:
        """Finish what an interrupted release left half done: a file it held
        aside that `consumed` says was consumed is released (deleted, or moved
        under `archive`), any other is put back. Returns how many it handled."""

    def remove(self, f: SourceFile) -> bool:
        """Delete the file if it is still the version `f` lists (its size and
        mtime); False if it is gone or another file took its name."""

    def move(self, f: SourceFile, archive: str) -> bool:
        """Move the file to the same relative name under `archive`, replacing
        what is there, if it is still the version `f` lists; else False."""


class LocalLister:
    """Lists a local folder, recursively."""

    def __init__(self, root: str) -> None:
        self.root = root

    def list(self, until: datetime | None) -> list[SourceFile]:
        root = Path(self.root)
        if not root.is_dir():
            raise SourceError(
                f"source folder {self.root} does not exist or is not a folder; create it "
                "or fix source.path in the spec",
                path=self.root,
            )
        limit_ms = int(until.timestamp() * 1000) if until else None
        found: list[SourceFile] = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if is_ready(d))
            for name in names:
                if not is_ready(name):
                    continue
                full = os.path.join(folder, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # removed while listing
                    continue
                mtime_ms = st.st_mtime_ns // 1_000_000
                if limit_ms is not None and mtime_ms >= limit_ms:
                    continue
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                found.append(SourceFile(rel, Path(full).as_uri(), st.st_size, mtime_ms, _inode(st)))
        return found

    def open(self, f: SourceFile) -> IO[bytes]:
        return open(os.path.join(self.root, f.name), "rb")

    def stat(self, f: SourceFile) -> SourceFile | None:
        try:
            st = os.stat(os.path.join(self.root, f.name))
        except FileNotFoundError:
            return None
        return SourceFile(f.name, f.uri, st.st_size, st.st_mtime_ns // 1_000_000, _inode(st))

    def remove(self, f: SourceFile) -> bool:
        return self._release(f, os.unlink)

    def move(self, f: SourceFile, archive: str) -> bool:
        return self._release(f, lambda held: _archive(held, archive, f.name))

    def _release(self, f: SourceFile, release: Callable[[str], object]) -> bool:
        """Release exactly the consumed file, never one a writer put under its name.

        A writer may rename a new file into place under a consumed name at any
        moment (after the listing, after the check below). So the file is
        first checked against the consumed version, then renamed aside to a
        hidden name (listings skip it), and released only if what was moved is
        the very file that was checked (same inode). Had a writer's rename
        come in between, the new file is put back under its name: `_restore`.
        """
        path = os.path.join(self.root, f.name)
        try:
            checked = os.stat(path)
        except FileNotFoundError:
            return False
        if not f.same_as(SourceFile(f.name, f.uri, checked.st_size, checked.st_mtime_ns // 1_000_000, _inode(checked))):
            return False
        held = os.path.join(os.path.dirname(path), f"{RELEASE_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            os.rename(path, held)
        except FileNotFoundError:
            return False
        moved = os.stat(held)
        # Another file (a writer's rename), or this one written over in place
        # since the check: not the consumed file.
        if (moved.st_dev, moved.st_ino, moved.st_size, moved.st_mtime_ns) != (checked.st_dev, checked.st_ino, checked.st_size, checked.st_mtime_ns):
            _restore(held, path)
            return False
        release(held)
        return True

    def recover(self, consumed: Callable[[SourceFile], bool], archive: str | None) -> int:
        """Files held aside by a release that did not finish (its process died
        between two steps): one that was consumed is released as the release
        would have, any other (a writer's) goes back under its name. A file
        held for less than `HELD_GRACE_S` may be another run's release in
        progress: it is left to that run."""
        handled = 0
        now = time.time()
        for folder, _, names in os.walk(self.root):
            for name in names:
                if not name.startswith(RELEASE_PREFIX):
                    continue
                held = os.path.join(folder, name)
                try:
                    st = os.stat(held)
                except FileNotFoundError:  # its release finished meanwhile
                    continue
                if now - st.st_ctime < HELD_GRACE_S:  # a rename sets the change time
                    continue
                original = os.path.relpath(os.path.join(folder, name[len(RELEASE_PREFIX) :].split("-", 1)[1]), self.root)
                f = SourceFile(original.replace(os.sep, "/"), Path(self.root, original).as_uri(), st.st_size, st.st_mtime_ns // 1_000_000, _inode(st))
                if not consumed(f):
                    _restore(held, os.path.join(self.root, original))
                elif archive is None:
                    os.unlink(held)
                else:
                    _archive(held, archive, f.name)
                handled += 1
        return handled

    def check_readable(self, f: SourceFile, fmt: str) -> None:
        path = os.path.join(self.root, f.name)
        if ":" in path and any(c in path for c in HADOOP_GLOB_CHARS):
            # Spark globs such a path, and Hadoop's globber cannot rebuild a path
            # holding ':' (it reads the text before it as a URI scheme).
            raise SourceError(
                f"source file {f.name} ({path}) cannot be read by Spark: its path holds both ':' and one "
                f"of {HADOOP_GLOB_CHARS}. Nothing was planned or consumed. Rename it (or its folder) without "
                "one of them, then run again.",
                path=path,
            )
        try:
            with self.open(f) as handle:
                if fmt == "parquet":
                    parquet_row_count(handle)
        except Exception as exc:
            what = "a readable Parquet file" if fmt == "parquet" else "readable"
            raise SourceError(
                f"source file {f.name} ({path}) is not {what}: {first_line(exc)}. "
                "Nothing was planned or consumed. Replace it with a readable file under the same name, "
                "or move it out of the source folder (or rename it to start with '_'), then run again.",
                path=path,
            ) from exc


#: A file a release holds aside is renamed to this prefix, a uuid, '-' and its
#: own name: hidden (listings skip it) and still telling where it came from.
RELEASE_PREFIX = ".microbatch-release-"
#: How long a held file may be another run's release in progress.
HELD_GRACE_S = 60.0


def _archive(held: str, archive: str, name: str) -> None:
    """Move a held file to `name` under `archive`, replacing what is there:
    a rename where it can be (atomic on one file system), else copy and
    delete; either keeps the mtime."""
    target = Path(archive, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(held, target)


def _restore(held: str, path: str) -> None:
    """Put a held file back under `path` without replacing a file that is
    there now (a hard link fails if the name is taken); if it is, under a
    new visible name beside it, so that the next batch reads it."""
    try:
        os.link(held, path)
    except FileExistsError:
        stem, dot, suffix = os.path.basename(path).rpartition(".")
        alternative = f"{stem}.restored-{uuid.uuid4().hex[:8]}.{suffix}" if dot else f"{suffix}.restored-{uuid.uuid4().hex[:8]}"
        os.rename(held, os.path.join(os.path.dirname(path), alternative))
        log.warning("a file a release held aside could not go back to %s (taken): it is at %s", path, alternative)
        return
    os.unlink(held)


def parquet_row_count(handle: IO[bytes]) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(handle).metadata.num_rows


def count_records(handle: IO[bytes], fmt: str, *, csv_header: bool) -> int:
    """Records in one file, for the `max_records` cap (non-blank lines for text)."""
    if fmt == "parquet":
        try:
            return parquet_row_count(handle)
        except Exception:  # unreadable: `check_readable` reports it by name before planning
            return 1
    lines = sum(1 for line in handle if line.strip())
    return max(lines - (1 if fmt == "csv" and csv_header else 0), 0)


class FilesSource:
    """Plans batches of whole files from what a `Lister` finds."""

    unit = "files"

    def __init__(
        self, lister: Lister, fmt: str, *, csv_header: bool = True, after_commit: str = "keep", archive: str | None = None
    ) -> None:
        self.lister = lister
        self.format = fmt
        self.csv_header = csv_header
        self.release = after_commit
        self.archive = archive

    @property
    def root(self) -> str:
        return self.lister.root

    @property
    def origin(self) -> FileOffsets:
        return FileOffsets(0)

    def decode(self, start: dict[str, Any], end: dict[str, Any], manifest: dict[str, Any]) -> BatchRange:
        files = tuple(SourceFile.from_dict(entry) for entry in manifest.get("files", []))
        return BatchRange(FileOffsets(start.get("files", 0)), FileOffsets(end.get("files", 0)), FilesManifest(files))

    def list_files(self, until: datetime | None = None) -> list[SourceFile]:
        """Ready files, oldest first (by arrival time, then name)."""
        found = self.lister.list(until)
        found.sort(key=lambda f: (f.mtime_ms, f.name))
        return found

    def consumed(self, lineage: Lineage, files: list[SourceFile]) -> list[bool]:
        """For each of `files`, whether a batch of `lineage` consumed it.

        By its name, as Spark's file source does (a file rewritten in place is
        not read again); but once consumed files are deleted or archived, a
        name is free to be used again, so then a file is its name and version
        (size and mtime).
        """
        seen = lineage.consumed({f.name for f in files})
        if self.release == "keep":
            return [f.name in seen for f in files]
        return [_consumed_version(f, seen.get(f.name, set())) for f in files]

    def pending(self, lineage: Lineage, until: datetime | None = None) -> list[SourceFile]:
        """Ready files not yet consumed by `lineage`."""
        listed = self.list_files(until)
        return [f for f, done in zip(listed, self.consumed(lineage, listed)) if not done]

    def lag(self, lineage: Lineage, *, until: datetime | None = None, dated: bool = False) -> Lag:
        # The listing holds every waiting file's mtime: dating costs nothing here.
        pending = self.pending(lineage, until)
        now_ms = int(time.time() * 1000)
        arrived = [f.mtime_ms for f in pending if f.mtime_ms <= now_ms]
        oldest = datetime.fromtimestamp(min(arrived) / 1000, timezone.utc) if arrived else None
        return Lag(len(pending), self.unit, future=len(pending) - len(arrived), oldest=oldest)

    def after_commit(self, lineage: Lineage) -> int:
        """Delete or archive the consumed files still in the source folder.

        Only files of committed batches are in `lineage`, so a planned batch's
        files stay until it commits. Files are found by listing, not taken
        from the last batch alone, so a crash between a commit and this step
        leaves nothing behind for good: the next committing run releases it.
        """
        if self.release == "keep":
            return 0
        self._recover(lineage)
        listed = self.lister.list(None)
        done = [f for f, consumed in zip(listed, self.consumed(lineage, listed)) if consumed]
        released = 0
        for f in done:
            if self.release == "delete":
                released += self.lister.remove(f)
            else:
                released += self.lister.move(f, cast(str, self.archive))
        if released:
            log.info("%s %d consumed file(s)", "deleted" if self.release == "delete" else f"archived to {self.archive}", released)
        if released < len(done):
            log.info(
                "left %d file(s) in place: another file took a consumed name after the listing (the next batch reads it)",
                len(done) - released,
            )
        return released

    def rewinding(self, end: dict[str, Any]) -> None:
        pass  # nothing upstream keeps data for this pipeline

    def _recover(self, lineage: Lineage) -> None:
        archive = cast(str, self.archive) if self.release == "archive" else None
        self.lister.recover(lambda f: self.consumed(lineage, [f])[0], archive)

    def verify(self, batch: BatchRange) -> None:
        """Each planned file must still be there with the size and mtime it was planned with."""
        for planned, found in self._changed(batch):
            raise SourceChangedError(
                f"source file {planned.name} ({planned.uri}) {found} since this batch was planned. A replay "
                "must read exactly what was planned, or a record could land in neither the state nor the "
                "quarantine; nothing was read or written. Put the planned file back under the same name "
                "and run again; or, to give up this batch, rewind to the last committed batch "
                "(`microbatch rewind SPEC --to-batch K`, K as `status` shows it): the next run plans "
                "afresh from the files that are there.",
                path=planned.uri,
            )

    def replay_gaps(self, start: dict[str, Any], batches: Sequence[BatchRange]) -> str | None:
        """The files the batches read that are no longer in the folder (as
        the version they read, with `delete` or `archive`): a replay would
        not read them again. One listing, whatever the number of files."""
        wanted = [f for b in batches for f in cast(FilesManifest, b.manifest).files]
        if not wanted:
            return None
        listed = self.lister.list(None)
        present = {f.name for f in listed} if self.release == "keep" else {(f.name, v) for f in listed for v in (f.version, f.untagged)}
        gone = [f.name for f in wanted if (f.name if self.release == "keep" else (f.name, f.version)) not in present]
        if not gone:
            return None
        where = {
            "delete": "`after_commit: delete` deleted them once committed",
            "archive": f"`after_commit: archive` moved them to {self.archive}: move them back under the same names to rewind",
            "keep": "they were deleted or moved: put them back under the same names to rewind",
        }[self.release]
        shown = ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
        return (
            f"{len(gone)} file(s) those batches read are no longer in {self.root} ({shown}); {where}. "
            "Or rewind to a later batch"
        )

    def check_read(self, batch: BatchRange) -> None:
        """After the batch's read, each planned file must still be the planned
        version: Spark reads a file by its name, so a file renamed over a
        planned one before or during the read was read in its place.

        With `after_commit: delete` or `archive` a file is its name, size and
        mtime: the batch would record the planned version as consumed while
        holding the new one's records, the release would keep the new file
        (not the version consumed), and the next batch would read it again.
        So the batch stops here, before any write. It cannot be retried: the
        planned version is gone from its name. (With `keep` a file is its
        name, whatever its content, as in Spark's file source: nothing to
        check.)"""
        if self.release == "keep":
            return
        for planned, found in self._changed(batch):
            raise SourceChangedError(
                f"source file {planned.name} ({planned.uri}) {found} while this batch read it: the read may "
                "hold the new file's records in place of the planned one's, so nothing of the batch was "
                "written. With `after_commit: delete` or `archive`, reuse a name only once its file is "
                "released (write under a new name, then rename). To go on, rewind to the last committed "
                "batch (`microbatch rewind SPEC --to-batch K`, K as `status` shows it): the next run plans "
                "afresh from the files that are there. The replaced file's records went with it.",
                path=planned.uri,
            )

    def _changed(self, batch: BatchRange) -> Iterator[tuple[SourceFile, str]]:
        """Each planned file that is gone or no longer the planned version, with what became of it."""
        manifest = cast(FilesManifest, batch.manifest)  # this source decodes only its own
        for planned in manifest.files:
            now = self.lister.stat(planned)
            if now is not None and planned.same_as(now):
                continue
            yield planned, "is gone" if now is None else (
                f"was rewritten (planned: {planned.size:,} bytes, modified {_when(planned.mtime_ms)}; "
                f"now: {now.size:,} bytes, modified {_when(now.mtime_ms)}"
                + (", another file of the same size and time" if (now.size, now.mtime_ms) == (planned.size, planned.mtime_ms) else "")
                + ")"
            )

    def plan(self, lineage: Lineage, *, until: datetime | None = None, caps: Caps = Caps()) -> BatchRange | None:
        """The next batch: pending files up to the caps, or None if none wait.

        `max_records` is a cap in whole files: files are taken while the total
        stays within it, and always at least one (a file is never split).
        """
        if self.release != "keep":
            self._recover(lineage)  # a writer's file an interrupted release held aside waits no longer
        pending = self.pending(lineage)
        waiting = len(pending)
        if until is not None:
            limit_ms = int(until.timestamp() * 1000)
            later = [f for f in pending if f.mtime_ms >= limit_ms]
            future = sum(1 for f in later if f.mtime_ms > time.time() * 1000)
            if future:
                log.warning(
                    "%d file(s) waiting are dated in the future (after %s): a run bounded by its data "
                    "interval takes them only once an interval ends after their date; check the "
                    "writer's clock, or run without an interval (a manual run) to take them now",
                    future,
                    until.isoformat(),
                )
            pending = [f for f in pending if f.mtime_ms < limit_ms]
        if caps.max_files is not None:
            pending = pending[: caps.max_files]
        if caps.max_records is not None and pending:
            taken, total = [], 0
            for f in pending:
                with self.lister.open(f) as handle:
                    n = count_records(handle, self.format, csv_header=self.csv_header)
                if taken and total + n > caps.max_records:
                    break
                taken.append(f)
                total += n
            pending = taken
        if not pending:
            return None
        # A file found bad here is in no plan yet: nothing is written or
        # consumed, and the user may replace it or move it away. (A file that
        # breaks after planning is reported by the read instead.)
        for f in pending:
            self.lister.check_readable(f, self.format)
        # The offset is a position in the log of consumed files: where the lineage ended.
        start = int(lineage.end.get("files", 0))
        return BatchRange(
            FileOffsets(start), FileOffsets(start + len(pending)), FilesManifest(tuple(pending)), waiting_after=waiting - len(pending)
        )


def _consumed_version(f: SourceFile, versions: set[str]) -> bool:
    """Whether `f` is one of the consumed `versions` of its name: the very
    file where both know its tag; by size and time where one does not (a
    version recorded before files had tags, or a file known without one)."""
    if f.tag is not None:
        return f.version in versions or f.untagged in versions
    return f.untagged in {":".join(v.split(":", 2)[:2]) for v in versions}


def _inode(st: os.stat_result) -> str:
    """A local file's identity: its device and inode."""
    return f"{st.st_dev}:{st.st_ino}"


def _when(mtime_ms: int) -> str:
    return datetime.fromtimestamp(mtime_ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")
