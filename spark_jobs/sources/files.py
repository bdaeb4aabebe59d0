"""A folder of files as a source, each file consumed exactly once.

Like Spark's file stream source, the offset is a position in a log of
consumed files, not a file name: ``{"files": n}`` means "the first n files of
this pipeline's history", and each batch's `manifest` lists the files it
took. The set of consumed files is the union of the manifests of the batches
in the current lineage (see `LedgerView.lineage`). Consequences:

* a file that lands late, or whose name sorts before files already consumed,
  is picked up by the next batch (it is not in the consumed set) and never
  twice (once consumed, it is in the set);
* a file's identity is its path relative to the source folder: rewriting a
  consumed file in place is not seen again. Land new data as new files.

Files still being written are ignored: names starting with ``.`` or ``_``
(Spark's and Hadoop's convention for hidden and temporary files, also applied
to folders) and the usual in-progress suffixes. Writers should write under
such a name and rename into place, which is atomic on local disks.

A file's arrival time is its modification time; `plan(until=...)` takes only
files that had arrived before `until` (the end of an Airflow data interval).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from spark_jobs.errors import SourceError
from spark_jobs.sources.base import BatchRange

#: Compared lower-cased. `._copying_` is what `hadoop fs -put` / `distcp`
#: write before renaming into place (Spark's file index skips it too).
IN_PROGRESS_SUFFIXES = (
    ".tmp", ".temp", ".partial", ".part", ".inprogress", ".crc", ".swp", ".copying", "._copying_", "~"
)


#: Characters Spark's file readers treat as a glob pattern (escaped when read).
HADOOP_GLOB_CHARS = "[]{}*?\\"


@dataclass(frozen=True)
class SourceFile:
    name: str  # path relative to the source folder, '/'-separated
    uri: str
    size: int
    mtime_ms: int

    def as_manifest(self) -> dict[str, object]:
        return {"name": self.name, "uri": self.uri, "size": self.size, "mtime_ms": self.mtime_ms}


def is_ready(name: str) -> bool:
    """Whether a file or folder name can hold finished data."""
    return not (name.startswith((".", "_")) or name.lower().endswith(IN_PROGRESS_SUFFIXES))


def count_records(path: str, fmt: str, *, csv_header: bool) -> int:
    """Records in one file, for the `max_records` cap (non-blank lines for text)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:  # unreadable: `check_readable` reports it by name before planning
            return 1
    lines = 0
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                lines += 1
    return max(lines - (1 if fmt == "csv" and csv_header else 0), 0)


def check_readable(root: str, file: SourceFile, fmt: str) -> None:
    """Raise `SourceError` naming `file` if it cannot be opened (or, for
    Parquet, its footer cannot be read).

    Run on the files of a batch before its `planned` row is written: a file
    found bad here is in no plan yet, so nothing is written or consumed and
    the user may either replace it or move it away. (A file that breaks
    after planning is reported by the read instead; see `spark_compute`.)
    """
    path = os.path.join(root, file.name)
    if ":" in path and any(c in path for c in HADOOP_GLOB_CHARS):
        # Spark globs such a path, and Hadoop's globber cannot rebuild a path
        # holding ':' (it reads the text before it as a URI scheme).
        raise SourceError(
            f"source file {file.name} ({path}) cannot be read by Spark: its path holds both ':' and one "
            f"of {HADOOP_GLOB_CHARS}. Nothing was planned or consumed. Rename it (or its folder) without "
            "one of them, then run again."
        )
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.read_metadata(path)
        else:
            with open(path, "rb"):
                pass
    except Exception as exc:
        what = "a readable Parquet file" if fmt == "parquet" else "readable"
        raise SourceError(
            f"source file {file.name} ({path}) is not {what}: {str(exc).strip().splitlines()[0][:300]}. "
            "Nothing was planned or consumed. Replace it with a readable file under the same name, "
            "or move it out of the source folder (or rename it to start with '_'), then run again."
        ) from exc


class FilesSource:
    """Lists a local folder (recursively) and plans batches of whole files."""

    def __init__(self, root: str, fmt: str, *, csv_header: bool = True) -> None:
        self.root = root
        self.format = fmt
        self.csv_header = csv_header

    @property
    def origin(self) -> dict[str, int]:
        """Offsets before the first batch."""
        return {"files": 0}

    def list_files(self, until: datetime | None = None) -> list[SourceFile]:
        """Ready files, oldest first (by arrival time, then name)."""
        root = Path(self.root)
        if not root.is_dir():
            raise SourceError(
                f"source folder {self.root} does not exist or is not a folder; create it "
                "or fix source.path in the spec"
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
                found.append(SourceFile(rel, Path(full).as_uri(), st.st_size, mtime_ms))
        found.sort(key=lambda f: (f.mtime_ms, f.name))
        return found

    def check_readable(self, f: SourceFile) -> None:
        """Refuse, by name, a file the batch could not read (see `check_readable`)."""
        check_readable(self.root, f, self.format)

    def count_records(self, f: SourceFile) -> int:
        """Records in one listed file (for the `max_records` cap)."""
        return count_records(os.path.join(self.root, f.name), self.format, csv_header=self.csv_header)

    def pending(self, consumed: set[str], until: datetime | None = None) -> list[SourceFile]:
        """Ready files not yet consumed."""
        return [f for f in self.list_files(until) if f.name not in consumed]

    def plan(
        self,
        consumed: set[str],
        *,
        until: datetime | None = None,
        max_files: int | None = None,
        max_records: int | None = None,
    ) -> BatchRange | None:
        """The next batch: pending files up to the caps, or None if none wait.

        `max_records` is a cap in whole files: files are taken while the total
        stays within it, and always at least one (a file is never split).
        """
        pending = self.pending(consumed, until)
        if max_files is not None:
            pending = pending[:max_files]
        if max_records is not None and pending:
            taken, total = [], 0
            for f in pending:
                n = self.count_records(f)
                if taken and total + n > max_records:
                    break
                taken.append(f)
                total += n
            pending = taken
        if not pending:
            return None
        for f in pending:
            self.check_readable(f)
        start = len(consumed)
        return BatchRange(
            start_offsets={"files": start},
            end_offsets={"files": start + len(pending)},
            manifest={"files": [f.as_manifest() for f in pending]},
        )


def consumed_names(manifests: list[dict[str, object]]) -> set[str]:
    """The consumed-file set from the manifests of a lineage's batches."""
    names: set[str] = set()
    for manifest in manifests:
        for entry in manifest.get("files", []):  # type: ignore[union-attr]
            names.add(entry["name"])  # type: ignore[index]
    return names
