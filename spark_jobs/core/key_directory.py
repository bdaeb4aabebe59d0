"""A merged state's keys on the job's machine, so that a batch merged on
read finds its returning keys without reading the state (`merge_on_read`).

Why: merged on read, a batch of returning keys drawn from all over the
state touches every file, and finding them by reading the files costs with
the state: per million rows on one core 0.035 s to read a row group and
0.018 s to look its keys up, about 2.7 s a batch at 100M keys on two cores
(docs/state-at-scale.md), where the rest of the batch follows the batch.

What: a cache under ``$MICROBATCH_CACHE_DIR/keys/<table>``, derived from the
state's data files alone and never their truth (delete it at any time; it
is built again):

* a **level** covers some of the table's data files, each named by its path
  and size (Delta writes a file once, under a new name, and never changes
  it). It holds every row of those files, deleted ones too, in file order,
  in the state's schema of the day it was built (Arrow IPC, uncompressed,
  so that a row is read where it lies, memory-mapped), and each row's key
  hash (`key_hashes`), sorted, with the row's position;
* the **manifest** (``manifest.json``) names the levels, the key columns
  and their types as hashed, and the hash function's check value.

A batch (`KeyDirectory.find`), under the table's lock file:

1. levels none of whose files the snapshot holds (same path and size) are
   dropped; the files the batch may touch that no level covers get one,
   read from their Parquet (what a scan reads, once, at
   most `LEVEL_ROWS` rows a level);
2. the batch's key hashes are looked up in each level (binary search); a
   hit is a row of a file the snapshot holds, that its vector does not
   delete, answered by the first level covering the file;
3. those rows are read from the level, in the state's schema of today (a
   column added since: nulls, as a file without it is read), and returned
   by file. The caller compares their keys with the batch's exactly
   (`arrow_rows.matches`): a hash only chooses which rows to compare.

After the batch's commit lands (`KeyDirectory.record`): its new file gets a
level from the rows in memory, and the smallest levels are merged past
`MAX_LEVELS` (only files the table still holds, all their rows).

Why it finds every live row holding a batch key: a level holds all rows of
each file it names, and a file is only ever looked up in a level that names
it with the size the snapshot gives; a file that left the table and came
back (a rewind, a RESTORE) is found whole again, or read again. Equal keys
hash alike: the hash is of the key as the match compares it, in the
state's types (-0.0 as 0.0, every NaN alike, a null as itself), and a
directory hashed in other key types, or by another hash function, is
started again. Anything else that goes wrong with it (a missing, partial or
foreign file, a full disk) makes the batch read the state as before
(`merge_on_read._probe`), and the directory is started again.

Costs, on the job's machine: about the state's rows uncompressed on local
disk (a state of 100M keys of a count, a sum and `_batch_id`: about 4 GB),
and its first build the reading of the state once, a level at a time.
``MICROBATCH_KEY_DIRECTORY=off`` turns it off (every batch reads the state);
a folder there puts it elsewhere. A state's directory unused for a week is
removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from spark_jobs.core.arrow_rows import in_schema, match_key
from spark_jobs.local_cache import cache_home

__all__ = ["ENV", "LEVEL_ROWS", "MAX_LEVELS", "Found", "KeyDirectory", "key_hashes", "open_directory"]

log = logging.getLogger("microbatch")

#: ``off`` (or ``0``, ``false``) turns the directory off; a folder puts
#: the directories there instead of ``$MICROBATCH_CACHE_DIR/keys``.
ENV = "MICROBATCH_KEY_DIRECTORY"
#: A state's directory not used for this many days is removed (`_sweep`).
_IDLE_DAYS = 7
_SWEPT: set[Path] = set()
_TABLE_NAME = re.compile(r"[0-9a-f]{24}")
_OWN_FILE = re.compile(r"lock|manifest\.json(\.[0-9a-f]{32}\.tmp)?|[0-9a-f]{32}\.(rows\.arrow|hash\.npy|pos\.npy|start\.npy|hashes)(\.tmp)?|[0-9a-f]{32}\.(hash|pos|start)\.npy\.tmp")
#: A manifest of another format is started again.
_FORMAT = 3
#: A level's files: its rows, its sorted hashes, their rows' positions, where each bucket of hashes starts.
_PARTS = ("rows.arrow", "hash.npy", "pos.npy", "start.npy")
#: Levels built at most this many rows each (the files one holds; one file
#: bigger than it is a level of its own), so that a level's sort holds at
#: most 16.7M hashes and positions in memory (about 230 MB: `_save_index`).
LEVEL_ROWS = 1 << 24
#: Small levels built at once, a thread each (`find`).
BUILDERS = max(1, min(2, os.cpu_count() or 1))
#: Past this many levels of under a quarter of `LEVEL_ROWS`, the smallest are merged.
MAX_LEVELS = 8
#: Rows of a level's record batches.
_BATCH_ROWS = 1 << 20
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x5BD1E9955BD1E995)
#: A level keeps a hash's top 40 bits (`_save_index`); the low 24 are compared by the keys' match.
_LOW = np.uint64((1 << 24) - 1)
_HIGH = ~_LOW
_BYTE = np.uint64(0x100000001B3)


@dataclass(frozen=True)
class Found:
    """A file's live rows whose key hash is one of the batch's."""

    path: str
    #: Their row indexes in the file, sorted.
    rows: np.ndarray
    #: The rows, in the state's schema.
    old: pa.Table


def open_directory(root: str, keys: list[str], schema: pa.Schema) -> KeyDirectory | None:
    """The key directory of the state at `root`, None when turned off
    (`ENV`) or when a key column's type is not hashed here (nested types:
    the batch reads the state)."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if not all(_hashable(schema.field(k).type) for k in keys):
        return None
    folder = Path(setting) if setting else cache_home() / "keys"
    _sweep(folder)
    return KeyDirectory(folder / hashlib.sha256(root.encode()).hexdigest()[:24], keys, schema)


def _sweep(folder: Path) -> None:
    """Directories of states no batch merged on read for `_IDLE_DAYS`
    (a pipeline dropped, a state's path changed) removed, once a process."""
    if folder in _SWEPT:
        return
    _SWEPT.add(folder)
    try:
        tables = list(folder.iterdir())
    except OSError:
        return
    for table in tables:
        try:
            # Only what this module writes: a folder named as `open_directory`
            # names them, holding nothing but its files (the setting may name
            # a folder other programs use).
            if not _TABLE_NAME.fullmatch(table.name) or not all(_OWN_FILE.fullmatch(f.name) for f in table.iterdir()):
                continue
            if time.time() - (table / "lock").stat().st_mtime > _IDLE_DAYS * 86400:
                shutil.rmtree(table, ignore_errors=True)
        except OSError:
            continue


class KeyDirectory:
    """One state's directory (module docstring); use inside `locked`."""

    def __init__(self, folder: Path, keys: list[str], schema: pa.Schema) -> None:
        self.folder, self.keys, self.schema = folder, list(keys), schema
        self._identity = {
            "format": _FORMAT, "check": _CHECK, "keys": self.keys,
            "key_types": [str(schema.field(k).type) for k in self.keys],
        }
        self._levels: list[dict[str, Any]] = []

    @contextmanager
    def locked(self) -> Iterator[KeyDirectory]:
        """Hold the table's lock file: one process at a time reads and
        changes the directory (racing runs of a pipeline wait, then find
        what the first built)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            os.utime(self.folder / "lock")  # in use: `_sweep` keeps it
            try:
                self._levels = self._read_manifest()
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def find(
        self, active: dict[str, int], records: dict[str, int], meeting: list[str], deleted: dict[str, np.ndarray],
        read: Callable[[str], Iterable[pa.Table]], data: pa.Table,
    ) -> list[Found]:
        """Steps 1 to 3 of the module docstring: `active` is the snapshot's
        files (decoded path: size), `records` their rows as their statistics
        say (how levels are grouped), `meeting` those the batch may touch
        (the only ones answered), `deleted` their vectors' rows (decoded
        path: sorted rows), `read` a file's rows in the state's schema (in runs),
        `data` the batch (its key columns in the state's types)."""
        covered = {f["path"] for level in self._levels for f in level["files"] if active.get(f["path"]) == f["size"]}
        touched = {p for p in meeting if p in active}
        missing = [p for p in dict.fromkeys(meeting) if p in touched and p not in covered]
        groups = list(_groups(missing, active, records, read))
        if groups:
            # A level a thread, `BUILDERS` at once while levels are small: a
            # build holds about 14 bytes a row (230 MB at `LEVEL_ROWS`), and
            # one at a time keeps a big state's first batch within the memory
            # a job's process is held to (issue 64: 800 MB).
            at_once = BUILDERS if max(rows for _, rows in groups) <= LEVEL_ROWS // 4 else 1
            with ThreadPoolExecutor(min(at_once, len(groups))) as pool:
                self._levels.extend(pool.map(self._write_level, (group for group, _ in groups)))
            self._write_manifest()
        wanted = np.unique(key_hashes(data, self.keys) & _HIGH)
        found: list[Found] = []
        answered: set[str] = set()  # a file is answered by one level (the first naming it), its rows in order
        for level in self._levels:
            files = [f for f in level["files"] if f["path"] in touched and active[f["path"]] == f["size"] and f["path"] not in answered]
            answered.update(f["path"] for f in files)
            if files and level["entries"]:
                found += (Found(path, rows, old) for path, rows, old in self._look_up(level, files, deleted, wanted))
        return found

    def record(self, path: str, size: int, rows: pa.Table, active: dict[str, int]) -> None:
        """After a commit of the job's own landed: `rows` (in the state's
        schema, in the file's order) are the new file at `path`, of `size`
        bytes; `active` the table's files after it. Merges the smallest
        levels past `MAX_LEVELS`."""
        self._drop_dead(active)
        self._levels.append(self._write_level([(path, size, lambda: [rows])]))
        small = sorted((lv for lv in self._levels if lv["entries"] < LEVEL_ROWS // 4), key=lambda lv: lv["entries"])
        if len(small) > MAX_LEVELS:
            # The smallest, each no bigger than those before it together (as
            # size-tiered compaction merges): a merge copies at most twice
            # what it gathers, and a row is copied about log2(levels) times.
            merging, total = [], 0
            for level in small:
                if len(merging) >= 2 and level["entries"] > total:
                    break
                merging.append(level)
                total += level["entries"]
            self._levels = [lv for lv in self._levels if lv not in merging] + [self._merge(merging, active)]
            self._remove_files(merging)
        self._write_manifest()

    def clear(self) -> None:
        """Start again: every level and the manifest removed (the lock file stays)."""
        for entry in self.folder.iterdir():
            if entry.name != "lock":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        self._levels = []

    # -- levels ------------------------------------------------------------------

    def _look_up(
        self, level: dict[str, Any], files: list[dict[str, Any]], deleted: dict[str, np.ndarray], wanted: np.ndarray
    ) -> Iterator[tuple[str, np.ndarray, pa.Table]]:
        """Step 2 and 3 in one level, for its `files` (those it answers)."""
        hashes = np.load(self.folder / f"{level['id']}.hash.npy", mmap_mode="r")
        positions = np.load(self.folder / f"{level['id']}.pos.npy", mmap_mode="r")
        buckets = np.load(self.folder / f"{level['id']}.start.npy", mmap_mode="r")
        self._check(level, hashes, positions, buckets)
        # A key's hash is in its bucket (its top bits), a row or two: two
        # reads of `buckets`, one of `hashes` each, where a binary search
        # took some twenty.
        bucket = _bucket(wanted, len(buckets) - 1)
        low, high = np.asarray(buckets[bucket], dtype=np.int64), np.asarray(buckets[bucket + 1], dtype=np.int64)
        counts = high - low
        if (counts < 0).any():
            raise ValueError(f"level {level['id']}: its buckets do not ascend")
        # Every index in [low, high) of each key, those holding its hash, then their rows' positions, sorted.
        at = np.repeat(low - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
        stored = np.asarray(hashes[at])
        # What was read is what was written: hashes with their low bits
        # cleared (`_save_index`), each in its bucket, and each range
        # bounded by hashes of the buckets either side (a bucket's start
        # moved, by damage of the right size, would hide its keys).
        count, entries = len(buckets) - 1, level["entries"]
        before, after = low[low > 0] - 1, high[high < entries]
        if (
            (stored & _LOW).any() or (_bucket(stored, count) != np.repeat(bucket, counts)).any()
            or (_bucket(np.asarray(hashes[before]), count) >= bucket[low > 0]).any()
            or (_bucket(np.asarray(hashes[after]), count) <= bucket[high < entries]).any()
        ):
            raise ValueError(f"level {level['id']}: its hashes and buckets disagree")
        hit = stored == np.repeat(wanted, counts)
        at, stored = at[hit], stored[hit]
        chosen = np.asarray(positions[at], dtype=np.int64)
        order = np.argsort(chosen, kind="stable")
        chosen, stored = chosen[order], stored[order]
        del hashes, positions, buckets  # unmapped: their pages no longer count in this process's memory
        if len(chosen) and (chosen[-1] >= level["entries"] or (chosen[1:] == chosen[:-1]).any()):
            raise ValueError(f"level {level['id']}: positions past its entries, or one twice")
        # Each file's rows are one run of `chosen` (sorted); kept: those of the
        # files this level answers for that their vectors leave live.
        bounds = np.searchsorted(chosen, [f["start"] for f in level["files"]] + [level["entries"]])
        answering = {id(f) for f in files}
        keep = np.zeros(len(chosen), dtype=bool)
        for i, f in enumerate(level["files"]):
            if id(f) in answering and bounds[i + 1] > bounds[i]:
                gone = deleted.get(f["path"])
                mine = (chosen[bounds[i] : bounds[i + 1]] - f["start"]).astype(np.uint64)
                keep[bounds[i] : bounds[i + 1]] = ~np.isin(mine, gone) if gone is not None and len(gone) else True
        chosen, stored = chosen[keep], stored[keep]
        if not len(chosen):
            return
        rows_file, mapped = self._rows_file(level)
        taken = in_schema(_take(rows_file, chosen, mapped), self.schema)
        if not np.array_equal(key_hashes(taken, self.keys) & _HIGH, stored):
            raise ValueError(f"level {level['id']}: a row it points at does not hold the key hash that led to it")
        bounds = np.searchsorted(chosen, [f["start"] for f in level["files"]] + [level["entries"]])
        for i, f in enumerate(level["files"]):
            if bounds[i + 1] > bounds[i]:
                yield f["path"], (chosen[bounds[i] : bounds[i + 1]] - f["start"]).astype(np.uint64), taken.slice(bounds[i], bounds[i + 1] - bounds[i])

    def _write_level(self, sources: list[tuple[str, int, Callable[[], Iterable[pa.Table]]]]) -> dict[str, Any]:
        """A level of the files `sources` (path, size, how to read their rows
        in runs), written under temporary names and renamed into place (the
        manifest names it after)."""
        name = uuid.uuid4().hex
        files, start = [], 0
        rows_path, hashes_path = self.folder / f"{name}.rows.arrow", self.folder / f"{name}.hashes.tmp"
        # The hashes go to a file as the runs are read, then come back as one
        # array: never held twice (a list of runs and their concatenation).
        with open(hashes_path, "wb") as raw, pa.OSFile(str(rows_path) + ".tmp", "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:
            for path, size, runs in sources:
                first = start
                for run in runs():
                    table = in_schema(run, self.schema)
                    raw.write(key_hashes(table, self.keys).tobytes())
                    writer.write_table(table, max_chunksize=_BATCH_ROWS)
                    start += table.num_rows
                files.append({"path": path, "size": size, "rows": start - first, "start": first})
        every = np.fromfile(hashes_path, dtype=np.uint64)
        hashes_path.unlink()
        self._save_index(name, every, None)
        os.replace(str(rows_path) + ".tmp", rows_path)
        return {"id": name, "files": files, "entries": start}

    def _merge(self, levels: list[dict[str, Any]], active: dict[str, int]) -> dict[str, Any]:
        """One level of `levels`' files the table still holds, all their rows."""
        name = uuid.uuid4().hex
        files, hashes, positions, start = [], [], [], 0
        rows_path = self.folder / f"{name}.rows.arrow"
        with pa.OSFile(str(rows_path) + ".tmp", "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:
            for level in levels:
                rows_file, _ = self._rows_file(level)
                whole = pa.Table.from_batches([rows_file.get_batch(i) for i in range(rows_file.num_record_batches)], schema=rows_file.schema)
                level_hashes = np.load(self.folder / f"{level['id']}.hash.npy")
                level_positions = np.load(self.folder / f"{level['id']}.pos.npy").astype(np.int64)
                for f in level["files"]:
                    if active.get(f["path"]) != f["size"]:
                        continue
                    mine = (level_positions >= f["start"]) & (level_positions < f["start"] + f["rows"])
                    hashes.append(level_hashes[mine])
                    positions.append(level_positions[mine] - f["start"] + start)
                    writer.write_table(in_schema(whole.slice(f["start"], f["rows"]), self.schema), max_chunksize=_BATCH_ROWS)
                    files.append({**f, "start": start})
                    start += f["rows"]
        every = np.concatenate(hashes) if hashes else np.empty(0, np.uint64)
        self._save_index(name, every, np.concatenate(positions) if positions else np.empty(0, np.int64))
        os.replace(str(rows_path) + ".tmp", rows_path)
        return {"id": name, "files": files, "entries": start}

    def _save_index(self, name: str, hashes: np.ndarray, positions: np.ndarray | None) -> None:
        """The level's hashes sorted (their top 40 bits: `_HIGH`), their
        rows' positions (None: `hashes` are in row order, and are sorted in
        place), and where each bucket of hashes starts (`_bucket`: as many
        buckets as a power of two fits in the entries, so a bucket holds one
        or two).

        In row order, up to 2^24 entries (a level's `LEVEL_ROWS`), each
        hash's low 24 bits give way to its row's position and the one array
        sorts in place: 12 bytes a row at most, where an argsort holds 28
        (16.7M rows: 200 MB against 470, a level built on each core)."""
        kind = np.uint32 if len(hashes) < 1 << 32 else np.int64
        if positions is None and len(hashes) <= 1 << 24:
            hashes &= _HIGH
            for first in range(0, len(hashes), _BATCH_ROWS):
                hashes[first : first + _BATCH_ROWS] |= np.arange(first, min(len(hashes), first + _BATCH_ROWS), dtype=np.uint64)
            hashes.sort()
            positions = np.empty(len(hashes), dtype=kind)
            for first in range(0, len(hashes), _BATCH_ROWS):
                positions[first : first + _BATCH_ROWS] = hashes[first : first + _BATCH_ROWS] & _LOW
            hashes &= _HIGH
        else:
            order = np.argsort(hashes, kind="stable")
            hashes = hashes[order] & _HIGH
            positions = (order if positions is None else positions[order]).astype(kind)
            del order
        count = 1 << max(0, len(hashes).bit_length() - 1)
        starts = np.empty(count + 1, dtype=kind)
        starts[count] = len(hashes)
        shift = np.uint64(65 - count.bit_length()) if count > 1 else None
        for first in range(0, count, _BATCH_ROWS):  # each bucket's first hash, found in the sorted hashes
            bounds = np.arange(first, min(count, first + _BATCH_ROWS), dtype=np.uint64)
            starts[first : first + len(bounds)] = np.searchsorted(hashes, bounds << shift) if shift is not None else 0
        for suffix, values in (("hash", hashes), ("pos", positions), ("start", starts)):
            with open(self.folder / f"{name}.{suffix}.npy.tmp", "wb") as out:
                np.save(out, values)
            os.replace(self.folder / f"{name}.{suffix}.npy.tmp", self.folder / f"{name}.{suffix}.npy")

    def _rows_file(self, level: dict[str, Any]) -> tuple[pa.ipc.RecordBatchFileReader, mmap.mmap]:
        """A level's rows, read where they lie in the file mapped (and the mapping)."""
        with open(self.folder / f"{level['id']}.rows.arrow", "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return pa.ipc.open_file(pa.py_buffer(mapped)), mapped

    def _drop_dead(self, active: dict[str, int]) -> None:
        """Levels none of whose files the table holds, removed."""
        dead = [lv for lv in self._levels if not any(active.get(f["path"]) == f["size"] for f in lv["files"])]
        self._levels = [lv for lv in self._levels if lv not in dead]
        self._remove_files(dead)

    def _remove_files(self, levels: list[dict[str, Any]]) -> None:
        for level in levels:
            for suffix in _PARTS:
                (self.folder / f"{level['id']}.{suffix}").unlink(missing_ok=True)

    # -- manifest ----------------------------------------------------------------

    def _read_manifest(self) -> list[dict[str, Any]]:
        """The manifest's levels; none (and the folder emptied) when it is
        missing, unreadable, not as this module writes it (`_well_formed`),
        or of other keys, key types or hash."""
        try:
            manifest = json.loads((self.folder / "manifest.json").read_text())
        except (OSError, ValueError):
            manifest = None
        if (
            not isinstance(manifest, dict) or {k: manifest.get(k) for k in self._identity} != self._identity
            or not _well_formed(manifest.get("levels"))
        ):
            self.clear()
            return []
        levels = manifest["levels"]
        named = {f"{lv['id']}.{s}" for lv in levels for s in _PARTS}
        for entry in self.folder.iterdir():  # a crash's leftovers: files no manifest names
            if entry.name not in named and entry.name not in ("lock", "manifest.json"):
                entry.unlink(missing_ok=True)
        return levels

    def _check(self, level: dict[str, Any], hashes: np.ndarray, positions: np.ndarray, buckets: np.ndarray) -> None:
        """What a level's files must say of themselves before a lookup
        trusts them (a damaged or foreign file of the right size): as many
        hashes and positions as entries, buckets from 0 to the entries, as
        many as the entries give. Raises `ValueError`."""
        entries = level["entries"]
        count = 1 << max(0, entries.bit_length() - 1)
        if len(hashes) != entries or len(positions) != entries or len(buckets) != count + 1:
            raise ValueError(f"level {level['id']}: {len(hashes)} hashes, {len(positions)} positions, {len(buckets)} buckets for {entries} entries")
        if int(buckets[0]) != 0 or int(buckets[-1]) != entries:
            raise ValueError(f"level {level['id']}: its buckets span {int(buckets[0])} to {int(buckets[-1])}, not 0 to {entries}")

    def _write_manifest(self) -> None:
        text = json.dumps({**self._identity, "levels": self._levels})
        temporary = self.folder / f"manifest.json.{uuid.uuid4().hex}.tmp"
        temporary.write_text(text)
        os.replace(temporary, self.folder / "manifest.json")


def _well_formed(levels: Any) -> bool:
    """Whether a manifest's levels are as `_write_level` and `_merge` make
    them: distinct ids, and in each, files at distinct paths whose rows run
    one after another to its entries."""
    if not isinstance(levels, list):
        return False
    try:
        ids = [level["id"] for level in levels]
        if len(set(ids)) != len(ids) or not all(isinstance(i, str) and re.fullmatch(r"[0-9a-f]{32}", i) for i in ids):
            return False
        for level in levels:
            start, paths = 0, set()
            for f in level["files"]:
                if f["start"] != start or not isinstance(f["rows"], int) or f["rows"] < 0 or not isinstance(f["size"], int) or f["path"] in paths:
                    return False
                start, paths = start + f["rows"], paths | {f["path"]}
            if start != level["entries"]:
                return False
    except (KeyError, TypeError):
        return False
    return True


def _groups(
    paths: list[str], sizes: dict[str, int], records: dict[str, int], read: Callable[[str], Iterable[pa.Table]]
) -> Iterator[tuple[list[tuple[str, int, Callable[[], Iterable[pa.Table]]]], int]]:
    """The files at `paths` in groups of at most `LEVEL_ROWS` rows by their
    statistics (a file bigger than it alone), each file read when its level
    is written; with each group, its rows."""
    group: list[tuple[str, int, Callable[[], Iterable[pa.Table]]]] = []
    rows = 0
    for path in paths:
        if group and rows + records.get(path, LEVEL_ROWS) > LEVEL_ROWS:
            yield group, rows
            group, rows = [], 0
        group.append((path, sizes[path], lambda p=path: read(p)))
        rows += records.get(path, LEVEL_ROWS)
    if group:
        yield group, rows


def _take(source: pa.ipc.RecordBatchFileReader, positions: np.ndarray, mapped: mmap.mmap) -> pa.Table:
    """The rows at `positions` (sorted) of a level mapped at `mapped`, each
    record batch taken from on its own (a take over the whole chunked column
    may join its chunks first, which reads all of it), a column at a time,
    the mapping's pages let go after each: rows spread over the level touch
    every page of a column, and a process's resident memory counts the
    mapped pages it touched (a 100k-key batch into 30M keys: 1,040 MB held
    by the job's process with every column's pages, the issue's bound 800)."""
    batches = [source.get_batch(i) for i in range(source.num_record_batches)]
    ends = np.cumsum([b.num_rows for b in batches])
    bounds = np.searchsorted(positions, ends, "left")
    pieces, begin = [], 0
    for batch, end, stop in zip(batches, ends, bounds):
        if stop > begin:
            pieces.append((batch, pa.array(positions[begin:stop] - (end - batch.num_rows))))
        begin = stop
    columns = []
    for index, field in enumerate(source.schema):
        columns.append(pa.chunked_array([batch.column(index).take(rows) for batch, rows in pieces], type=field.type))
        mapped.madvise(mmap.MADV_DONTNEED)  # the pages stay in the page cache; a touch maps them again
    return pa.Table.from_arrays(columns, schema=source.schema)


def _bucket(hashes: np.ndarray, count: int) -> np.ndarray:
    """Each hash's bucket of `count` (a power of two): its top bits."""
    if count <= 1:
        return np.zeros(len(hashes), dtype=np.int64)
    return (hashes >> np.uint64(65 - count.bit_length())).astype(np.int64)


# -- the hash ----------------------------------------------------------------------


def _hashable(kind: pa.DataType) -> bool:
    return (
        pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) or pa.types.is_temporal(kind)
        or pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind) or pa.types.is_decimal(kind)
    )


def key_hashes(table: pa.Table, keys: list[str]) -> np.ndarray:
    """A 64-bit hash of each row's key (`keys`' columns), as the MERGE's
    match compares keys (`arrow_rows.match_key`): equal keys hash alike."""
    out = np.full(table.num_rows, _GOLDEN, dtype=np.uint64)
    for key in keys:
        out = _mix((out * _BYTE) ^ _column_hash(match_key(table, key)))
    return out


def _column_hash(column: pa.Array) -> np.ndarray:
    kind = column.type
    if pa.types.is_decimal(kind):  # by its text at the column's scale: one text per value
        return _column_hash(column.cast(pa.string()))
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        values = _bytes_hash(column.cast(pa.large_binary()))
    elif pa.types.is_floating(kind):
        wide = np.asarray(column.cast(pa.float64()).fill_null(0.0), dtype=np.float64)
        values = np.where(np.isnan(wide), np.float64("nan"), wide).view(np.uint64)
    elif pa.types.is_boolean(kind):
        values = np.asarray(column.fill_null(False), dtype=bool).astype(np.uint64)
    else:  # integers and times: their integer value
        bits = kind.bit_width
        if not pa.types.is_integer(kind):
            column = column.view(pa.int32() if bits == 32 else pa.int64())
        values = np.asarray(column.fill_null(0)).astype(np.int64).view(np.uint64)
    values = _mix(values)
    if column.null_count:
        values = np.where(np.asarray(column.is_valid()), values, _NULL)
    return values


def _bytes_hash(column: pa.Array) -> np.ndarray:
    """A hash of each value's bytes (a ``large_binary`` array), vectorised: the
    sum of each byte times a power by its place, then its length mixed in.
    Collisions are possible and harmless (the match compares the keys)."""
    out = np.zeros(len(column), dtype=np.uint64)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64, count=len(column) + 1, offset=column.offset * 8)
    data = column.buffers()[2]
    body = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
    for first in range(0, len(column), 1 << 16):
        last = min(len(column), first + (1 << 16))
        begin, end = offsets[first:last], offsets[first + 1 : last + 1]
        lengths = end - begin
        full = lengths > 0
        width = int(lengths[0]) if len(lengths) else 0
        if width and (lengths == width).all():  # values all as long (ids, codes): a row of a matrix each, the same sums
            span = body[begin[0] : end[-1]].reshape(-1, width).astype(np.uint64)
            out[first:last] = ((span + np.uint64(1)) * _POWERS[np.arange(width) % len(_POWERS)]).sum(axis=1, dtype=np.uint64)
        elif full.any():
            span = body[begin[0] : end[-1]].astype(np.uint64)
            place = np.arange(len(span), dtype=np.int64) - np.repeat(begin - begin[0], lengths)
            weights = _POWERS[place % len(_POWERS)]
            out[first:last][full] = np.add.reduceat((span + np.uint64(1)) * weights, (begin - begin[0])[full])
        out[first:last] ^= lengths.astype(np.uint64) * _GOLDEN
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 arithmetic wraps)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


_POWERS = np.cumprod(np.full(4096, _BYTE, dtype=np.uint64), dtype=np.uint64)
#: The hash of fixed keys: a directory hashed by other code is started again.
_CHECK = hashlib.sha256(
    key_hashes(
        pa.table({
            "i": pa.array([1, -2, None], pa.int64()), "f": pa.array([0.5, float("nan"), -0.0]),
            "s": pa.array(["a", "", None]), "t": pa.array([0, 1, 2], pa.timestamp("us")),
        }),
        ["i", "f", "s", "t"],
    ).tobytes()
).hexdigest()[:16]
