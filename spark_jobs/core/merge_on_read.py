"""A merged state's batch, merge-on-read (`state.deletion_vectors`).

Copy-on-write, a batch of returning keys rewrites every file that holds one
of them: with users coming back from all over a state of 20M keys, the
whole state, each batch (docs/benchmarks.md, "State at scale"). Here the
state's files are never rewritten by a batch: the rows it changes are
marked deleted where they are, by Delta deletion vectors, and written again,
merged, into one new file. What a batch writes follows the batch; what it
reads is each touched file's rows once (their keys, to find the returning
ones, and those rows' values, to merge them).

The table stays an ordinary Delta table of one row per key for every reader
(delta-rs's `QueryBuilder`, Spark, the change feed); delta-rs also writes
after such commits (MERGE, DELETE, RESTORE, OPTIMIZE, VACUUM, checkpoints),
honouring the vectors (verified on delta-rs 1.6.6 and delta-spark 4.4:
tests/spark_jobs/core/test_merge_on_read.py). It cannot write a vector
itself, so the batch's commit is the job's (`spark_jobs.core.deletion_vectors`).

`commit`, from the snapshot step 4 checked, when it pays (`_pays`: while
the rows the vectors delete, with the batch's, stay within `MAX_DEAD` of
the rows held; else the caller's copy-on-write MERGE, which drops them):

1. The row groups of the files whose key range meets the batch's are read,
   `READERS` at a time; each live row (one its vector does not delete) whose key the batch holds
   is found (`arrow_rows.matches`) and merged with the batch's row by the
   spec's rules (`arrow_rows.merged_rows`).
2. The merged rows and the batch's new keys are written as one data file,
   with Delta statistics; with a change feed, the old rows (pre-images),
   the merged ones (post-images) and the new keys (inserts) as one change
   file; each touched file's vector (its deleted rows and the batch's) into
   one deletion-vector file.
3. One log entry at the snapshot's version + 1, and only there: the commit
   info with the batch's metadata (as delta-rs writes it, so `find_commit`,
   reconcile and the ledger read it alike), the state fence's ``txn``, each
   touched file removed with its old vector and added with its new one, the
   new file, the change file. If that version exists (any commit since the
   snapshot: a racing run, a zombie's, a `maintain`), the commit fails with
   delta-rs's `CommitFailedError`, and step 4 judges it as it judges
   delta-rs's conflicts (the state's other rewrites commit on their
   snapshot or not at all too: `staged.commit_files`).

Files written for a commit that did not land are no version's: `maintain`
removes the data and vector files among them (`spark_jobs.core.untracked`);
change files are small, and left. The same on a local folder and on S3
(`spark_jobs.storage.files`: Parquet read in ranges, the log entry put
with ``If-None-Match``).

Two more commits of the job's own keep such a table right for a chained
downstream, whose change feed delta-rs derives wrongly from the removal
of a file with a vector (it reads the rows the vector deletes): `restore`
(a rewind, with a change file) and `purge` (the vectors rewritten away in
a commit that changes no data: `maintain`, and before a widening).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from spark_jobs.core.arrow_rows import FileStats, in_schema, matches, merged_rows
from spark_jobs.core.commits import METADATA_KEY, CommitMetadata
from spark_jobs.core.deletion_vectors import active_files, deleted_in, has_deletion_vectors, table_root, write_vectors
from spark_jobs.core.faults import fault_point
from spark_jobs.core.key_directory import KeyDirectory, open_directory
from spark_jobs.core import own_commits
from spark_jobs.core.own_commits import commit_info, fence, logged, removal
from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec, StateSpec
from spark_jobs.core.staged import CHANGE_DATA, files_bytes, files_meeting
from spark_jobs.storage.files import reader, write_bytes

__all__ = ["AUTO_FROM_BYTES", "ENABLED", "commit", "due", "enable", "enabled", "merges", "purge", "restore"]

log = logging.getLogger("microbatch")

#: The table property that lets writers add deletion vectors (Delta's name).
ENABLED = "delta.enableDeletionVectors"
_MILLISECOND = timedelta(milliseconds=1)
#: Merge on read while the rows deleted by vectors stay within this share of the rows held (`_pays`).
MAX_DEAD = 0.5
#: Runs of row groups read at once (this many cores; each holds one run's rows).
READERS = max(1, min(4, os.cpu_count() or 1))
#: How many rows a run of row groups holds at least (`_RowGroups.units`), or
#: as many as the batch: its keys are hashed once a run. At 30M keys, 100k
#: returning, runs of 256k rows committed in 1.9-3.0 s with the job's
#: process at 420-445 MB; of 1M rows, 1.6-2.1 s at 638-671 MB.
UNIT_ROWS = 1 << 18


#: `deletion_vectors: auto` turns merge-on-read on once the state's files
#: weigh this much (about 8M keys of a count and a sum). Below it a batch of
#: returning keys rewrites little (at 1M keys, 7 MB, copy-on-write costs
#: 0.38x Structured Streaming); above it copy-on-write grows with the state
#: (0.84x at 10M keys, 74 MB; 1.39x at 20M), merged on read it follows the
#: batch (docs/benchmarks.md, "State at scale"). Below it the table also
#: stays readable by readers older than Delta 2.3.
AUTO_FROM_BYTES = 64 * 1024 * 1024


def due(state: StateSpec, table: DeltaTable) -> bool:
    """Whether the state's table should declare deletion vectors before this
    batch: `deletion_vectors: true`, or `auto` once its files weigh
    `AUTO_FROM_BYTES` on a state that may merge on read. (Already on, or
    `false`: nothing to turn on.)"""
    if state.deletion_vectors is True:
        return not enabled(table)
    if state.deletion_vectors is False or not state.may_merge_on_read or enabled(table):
        return False
    # Declared, its property off: a rewind restored the metadata of a version
    # before `auto` turned them on (the protocol stays); on again, for good.
    return has_deletion_vectors(table) or files_bytes(table) >= AUTO_FROM_BYTES


def merges(state: StateSpec, table: DeltaTable) -> bool:
    """Whether a batch into `table` merges on read (when it pays: `_pays`):
    `deletion_vectors: true`, or `auto` once the table has them on (`due`
    turned them on; they stay on, however the state shrinks)."""
    if state.deletion_vectors == "auto":
        return state.may_merge_on_read and enabled(table)
    return state.deletion_vectors


def enabled(table: DeltaTable) -> bool:
    """Whether the table declares deletion vectors and lets writers add them."""
    return has_deletion_vectors(table) and table.metadata().configuration.get(ENABLED) == "true"


def enable(table: DeltaTable) -> None:
    """Turn deletion vectors on in the state's table, in one commit of the
    job's own (`own_commits.set_properties`): the table feature (reader
    version 3, writer version 7; readers that predate Delta 2.3 cannot read
    it) and the property. Keeps every row.

    A commit that landed since `table`'s snapshot fails it. If the table
    then has them on (a run racing this one to the same bound, or this
    entry itself, put on S3 and answered with an error), that is the change
    this run wanted: `table` moves to the latest version and the batch goes
    on (step 4 checks the fence from its own snapshot). Else
    `CommitFailedError`."""
    try:
        own_commits.set_properties(table, {ENABLED: "true"}, reader_features=("deletionVectors",))
    except CommitFailedError:
        table.update_incremental()
        if not enabled(table):
            raise


def commit(table: DeltaTable, spec: PipelineSpec, data: pa.Table, metadata: CommitMetadata) -> tuple[int, int] | None:
    """Merge `data` (the batch's rows in the state's types, `_batch_id`
    last, one row a key) into the state at `table`'s snapshot as the module
    docstring says; returns (the version committed, keys updated), or None
    when a rewrite pays better (`_pays`: the caller merges copy-on-write).
    Raises `CommitFailedError` if any commit landed since the snapshot."""
    root = table_root(table)
    version = table.version()
    added = active_files(root, version)
    if not _pays(added, data.num_rows):
        return None
    schema = pa.schema(table.schema().to_arrow())
    with _directory_of(root, list(spec.state.keys), schema) as directory:
        probed = _probe(table, root, added, spec, schema, data, directory)
        taken = np.concatenate([p.taken for p in probed]) if probed else np.empty(0, np.int64)
        new = np.ones(data.num_rows, dtype=bool)
        new[taken] = False
        inserted = in_schema(data.filter(pa.array(new)), schema)
        before = pa.concat_tables([p.before for p in probed]) if probed else schema.empty_table()
        after = pa.concat_tables([p.after for p in probed]) if probed else schema.empty_table()
        now = int(time.time() * 1000)
        metrics = {"num_target_rows_updated": after.num_rows, "num_target_rows_inserted": inserted.num_rows, "num_deletion_vectors_added": len(probed)}
        actions = [commit_info(metadata, now, {"mode": "merge-on-read"}, metrics), fence(metadata, now)]
        if probed:
            vectors = [_union(p.deleted, p.rows) for p in probed]
            for p, descriptor in zip(probed, write_vectors(root, vectors)):
                actions += _revectored(logged(added, p.path), descriptor, now)
        written = pa.concat_tables([after, inserted]).cast(schema)
        actions.append(file := _data_file(root, written, schema, now))
        if spec.state.change_feed:
            actions.append(_change_file(root, before, after, inserted))
        fault_point("mid_state_merge")  # every file written, the commit not made
        committed = own_commits.commit(table, actions, "since this batch read the state")
        if directory is not None:
            _remember(directory, file["add"], written, added)
    return committed, data.num_rows


def purge(table: DeltaTable) -> tuple[int, int] | None:
    """Rewrite each of the snapshot's files that carries a deletion vector
    without the rows it deletes, in one commit that changes no data (what
    Delta's ``REORG TABLE ... APPLY (PURGE)`` does), on `table`'s snapshot;
    returns its version and how many files it rewrote (None: no file carries one). Raises
    `CommitFailedError` if any commit landed since the snapshot.

    A file at a time: its rows are read whole (each file is one batch's, or
    a compaction's, size)."""
    if not has_deletion_vectors(table):
        return None
    root = table_root(table)
    version = table.version()
    carrying = [add for add in active_files(root, version).values() if add.get("deletionVector")]
    if not carrying:
        return None
    deleted, schema, now = deleted_in(root, carrying), pa.schema(table.schema().to_arrow()), int(time.time() * 1000)
    actions: list[dict[str, Any]] = [{
        "commitInfo": {
            "timestamp": now, "operation": "REORG", "operationParameters": {"mode": "purge deletion vectors"},
            "operationMetrics": {"num_removed_files": len(carrying)},
        }
    }]
    for add in carrying:
        actions.append(removal(add, now, data_change=False))
        live = _live_file(root, add, deleted, schema)
        if live.num_rows:
            actions.append(_data_file(root, live, schema, now, data_change=False))
    return own_commits.commit(table, actions, "while its vectors were purged"), len(carrying)


def restore(table: DeltaTable, version: int | None, metadata: CommitMetadata) -> int | None:
    """A rewind's restore of a state with a change feed whose files carry
    deletion vectors (now, or as of `version`; None: empty), with the change
    file Delta's RESTORE lacks; returns the version committed, None when no
    file carries one (delta-rs's RESTORE is right then). Raises
    `CommitFailedError` if any commit landed since `table`'s snapshot.

    Without change files a reader derives a version's changes from the
    files it removes and adds, and delta-rs reads a removed file with a
    vector as the rows the vector deletes, not its live ones (a chained
    downstream counted twice after a rewind). So the job commits the restore
    itself: the files the snapshot holds and `version`'s does not removed
    (as they were added), `version`'s files added (with their vectors then),
    and one change file: each removed file's live rows as deletes, each
    added file's as inserts (a downstream nets the rows that stay)."""
    root = table_root(table)
    now_version = table.version()
    current = active_files(root, now_version)
    target = active_files(root, version) if version is not None else {}
    if not any(a.get("deletionVector") for a in (*current.values(), *target.values())):
        return None
    def same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:  # a file's identity: its path and its vector
        return a is not None and b is not None and (a.get("deletionVector") or None) == (b.get("deletionVector") or None)

    removed = [a for p, a in current.items() if not same(a, target.get(p))]
    added = [a for p, a in target.items() if not same(a, current.get(p))]
    schema, now = pa.schema(table.schema().to_arrow()), int(time.time() * 1000)
    gone, back = _live_rows(root, removed, schema), _live_rows(root, added, schema)
    kinds = ["delete"] * gone.num_rows + ["insert"] * back.num_rows
    change = pa.concat_tables([gone, back]).append_column("_change_type", pa.array(kinds, pa.string()))
    actions: list[dict[str, Any]] = [
        {"commitInfo": {
            "timestamp": now, "operation": "RESTORE", "operationParameters": {"version": version},
            METADATA_KEY: metadata.to_json(),
        }},
        fence(metadata, now),
        *(removal(a, now) for a in removed),
        *({"add": {**a, "modificationTime": now, "dataChange": True}} for a in added),
    ]
    if change.num_rows:
        actions.append(_cdc(root, change))
    return own_commits.commit(table, actions, "during the restore")


def _live_rows(root: str, adds: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """The rows of the files `adds` (add actions) that their vectors leave live, in `schema`."""
    if not adds:
        return schema.empty_table()
    deleted = deleted_in(root, adds)
    return pa.concat_tables([_live_file(root, add, deleted, schema) for add in adds])


def _live_file(root: str, add: dict[str, Any], deleted: dict[str, np.ndarray], schema: pa.Schema) -> pa.Table:
    """The rows of one file that `deleted` (its deleted rows, by path) leaves live, in `schema`."""
    path = unquote(add["path"])
    with reader(f"{root}/{path}") as handle:
        source = pq.ParquetFile(handle)
        rows = _read(source, list(range(source.metadata.num_row_groups)), schema)
    live = np.ones(rows.num_rows, dtype=bool)
    live[deleted.get(path, np.empty(0, np.uint64)).astype(np.int64)] = False
    return rows.filter(pa.array(live))


def _pays(added: dict[str, dict[str, Any]], rows: int) -> bool:
    """Whether merging on read pays: while the rows the state's vectors
    delete, with the batch's (at most one each), stay within `MAX_DEAD` of
    the rows its files hold. Past it (a batch as big as a small state, or
    vectors piled up since the last compaction) the batch rewrites the files
    it touches instead, which drops their deleted rows: every batch reads
    the dead rows of the files it touches, so they bound its reading at
    twice the live ones."""
    held = dead = 0
    for add in added.values():
        stats = json.loads(add.get("stats") or "{}")
        if "numRecords" not in stats:
            return False  # no count to weigh: rewrite, as before
        held += int(stats["numRecords"])
        dead += int((add.get("deletionVector") or {}).get("cardinality", 0))
    return dead + rows <= MAX_DEAD * held


def _union(deleted: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A file's deleted rows with the batch's, sorted (both sorted, disjoint: a deleted row matches nothing)."""
    both = np.concatenate([deleted.astype(np.uint64), rows])
    both.sort(kind="stable")
    return both


@dataclass(frozen=True)
class _Touched:
    """A state file holding some of the batch's keys, and what the batch does to it."""

    path: str
    #: The rows its vector deletes already, and the live rows holding the batch's keys.
    deleted: np.ndarray
    rows: np.ndarray
    #: Those rows as they are, and merged with the batch's (in the same order).
    before: pa.Table
    after: pa.Table
    #: The batch's rows that merged into them.
    taken: np.ndarray


def _probe(
    table: DeltaTable, root: str, added: dict[str, dict[str, Any]], spec: PipelineSpec, schema: pa.Schema, data: pa.Table,
    directory: KeyDirectory | None,
) -> list[_Touched]:
    """Step 1: the files holding some of the batch's keys, among those
    whose key range meets the batch's: found by the key directory
    (`spark_jobs.core.key_directory`), or when there is none, or it fails,
    by reading each of their row groups once, in runs of a file's
    consecutive groups (`_RowGroups.units`), `READERS` runs at a time (a
    file's groups spread over the cores, as a few big files would not)."""
    keys = list(spec.state.keys)
    rules = {c: r for c, r in spec.state.merge.items() if c in data.column_names}
    meeting = files_meeting(table, keys, data.schema.field(keys[0]).type, _key_range(data, keys))
    deleted = deleted_in(root, (logged(added, path) for path in meeting))
    found: list[tuple[str, np.ndarray, pa.Table, pa.Table, np.ndarray]] | None = None
    if directory is not None:
        try:
            files = {unquote(p): a for p, a in added.items()}
            sizes = {p: int(a["size"]) for p, a in files.items()}
            records = {p: int(json.loads(a.get("stats") or "{}").get("numRecords", 0)) or 1 for p, a in files.items()}
            hits = directory.find(sizes, records, meeting, deleted, lambda path: _file_rows(root, path, schema), data)
        except Exception as exc:  # noqa: BLE001 - a cache: the batch reads the state instead, and it starts again
            log.warning("key directory of %s not used (%s: %s); reading the state's files", root, type(exc).__name__, exc)
            _forget(directory)
        else:
            found = _merged([(h.path, h.rows, h.old) for h in hits], data, keys, rules)
    if found is None:
        found = _scan(root, meeting, deleted, schema, data, keys, rules)
    touched = []
    for path in dict.fromkeys(f[0] for f in found):
        parts = [f for f in found if f[0] == path]
        touched.append(_Touched(
            path, deleted.get(unquote(path), np.empty(0, np.uint64)), np.concatenate([f[1] for f in parts]),
            pa.concat_tables([f[2] for f in parts]), pa.concat_tables([f[3] for f in parts]), np.concatenate([f[4] for f in parts]),
        ))
    return touched


def _scan(
    root: str, meeting: list[str], deleted: dict[str, np.ndarray], schema: pa.Schema, data: pa.Table,
    keys: list[str], rules: dict[str, str],
) -> list[tuple[str, np.ndarray, pa.Table, pa.Table, np.ndarray]]:
    """`_probe` by reading the files `meeting` whole, `READERS` runs of row groups at a time."""
    groups = _RowGroups(root, meeting)

    def probe(unit: tuple[str, list[int], int]) -> list[tuple[str, np.ndarray, pa.Table, pa.Table, np.ndarray]]:
        path, run, offset = unit
        old = _read(groups.reader(path), run, schema)
        rows = np.arange(old.num_rows, dtype=np.uint64) + np.uint64(offset)
        gone = deleted.get(unquote(path), np.empty(0, np.uint64))  # (sorted: `deleted_in`)
        gone = gone[np.searchsorted(gone, offset) : np.searchsorted(gone, offset + old.num_rows)] - np.uint64(offset)
        if len(gone):
            live = np.ones(old.num_rows, dtype=bool)
            live[gone.astype(np.int64)] = False
            old, rows = old.filter(pa.array(live)), rows[live]
        return _merged([(path, rows, old)], data, keys, rules)

    try:
        with ThreadPoolExecutor(READERS) as pool:
            return [f for found in pool.map(probe, groups.units(max(UNIT_ROWS, data.num_rows))) for f in found]
    finally:
        groups.close()


def _merged(
    parts: list[tuple[str, np.ndarray, pa.Table]], data: pa.Table, keys: list[str], rules: dict[str, str]
) -> list[tuple[str, np.ndarray, pa.Table, pa.Table, np.ndarray]]:
    """Of files' live rows (`parts`: the file, their row indexes, the rows),
    those holding a batch key, by file: (the file, their indexes, them,
    merged with the batch's rows, the indexes of those batch rows). All
    files' rows are matched at once: a match hashes the batch's keys each time."""
    if not parts:
        return []
    old = pa.concat_tables([p[2] for p in parts])
    rows = np.concatenate([p[1] for p in parts])
    hit = np.flatnonzero(pc.is_valid(matches(old, data, keys)).to_numpy(zero_copy_only=False))
    if not len(hit):
        return []
    before = old.take(hit)
    after, taken = merged_rows(before, data, keys, rules, BATCH_COLUMN)
    taken = taken.to_numpy(zero_copy_only=False)
    out, begin = [], 0
    for (path, _, _), end in zip(parts, np.searchsorted(hit, np.cumsum([p[2].num_rows for p in parts]))):
        if end > begin:
            out.append((path, rows[hit[begin:end]], before.slice(begin, end - begin), after.slice(begin, end - begin), taken[begin:end]))
        begin = end
    return out


def _file_rows(root: str, path: str, schema: pa.Schema) -> Iterator[pa.Table]:
    """Every row of the file at `path` (deleted ones too), in the state's
    schema, in runs of row groups of `UNIT_ROWS` rows (what a scan holds at once)."""
    groups = _RowGroups(root, [path])
    try:
        for _, run, _ in groups.units(UNIT_ROWS):
            yield _read(groups.reader(path), run, schema)
    finally:
        groups.close()


@contextmanager
def _directory_of(root: str, keys: list[str], schema: pa.Schema) -> Iterator[KeyDirectory | None]:
    """The state's key directory, held (`KeyDirectory.locked`) for the
    batch; None when turned off, or when it cannot be opened or read (a
    cache folder that cannot be made or written, a manifest that fails):
    the batch then reads the state's files, as before the directory."""
    with ExitStack() as stack:
        try:
            directory = open_directory(root, keys, schema)
            if directory is not None:
                stack.enter_context(directory.locked())
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("key directory of %s not used (%s: %s); reading the state's files", root, type(exc).__name__, exc)
            directory = None
        yield directory


def _remember(directory: KeyDirectory, add: dict[str, Any], rows: pa.Table, added: dict[str, dict[str, Any]]) -> None:
    """After the batch's commit landed: its file in the key directory. A
    failure here costs the next batch a read of that file, never the commit."""
    try:
        active = {unquote(p): int(a["size"]) for p, a in added.items()}
        active[unquote(add["path"])] = int(add["size"])
        directory.record(unquote(add["path"]), int(add["size"]), rows, active)
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("key directory of %s not kept (%s: %s)", directory.folder, type(exc).__name__, exc)
        _forget(directory)


def _forget(directory: KeyDirectory) -> None:
    try:
        directory.clear()
    except OSError as exc:
        log.warning("key directory %s not cleared (%s)", directory.folder, exc)


class _RowGroups:
    """The row groups of the files at `paths` (under `root`), read from any
    thread: a Parquet reader (and its file handle) per thread and file, as
    pyarrow's reader is not thread-safe (one shared by the threads failed
    with "ReadRangeCache did not find matching cache entry", or crashed the
    process: a try-to-break review). Each footer is read once."""

    def __init__(self, root: str, paths: list[str]) -> None:
        self._root, self._footers, self._local, self._handles = root, {}, threading.local(), []
        for path in paths:
            with reader(f"{root}/{unquote(path)}") as handle:
                self._footers[path] = pq.ParquetFile(handle).metadata

    def units(self, least: int) -> list[tuple[str, list[int], int]]:
        """(file, row groups, their first row in the file): every group,
        in runs of a file's consecutive groups of at least `least` rows
        (a file's last run may hold fewer). Each run's keys are looked up in
        the batch's, whose hash set is built once a run: a run a group, a
        state Spark's executors wrote in row groups of 10,000 rows (as
        they did before `spark_files.ROW_GROUP_ROWS`; groups of other
        writers may be as small) had
        the batch's keys hashed 3,000 times a batch at 30M keys, which took
        17-43 s, where runs take 2-3 s."""
        units = []
        for path, footer in self._footers.items():
            offset, run, rows = 0, [], 0
            for group in range(footer.num_row_groups):
                run.append(group)
                rows += footer.row_group(group).num_rows
                if rows >= least:
                    units.append((path, run, offset))
                    offset, run, rows = offset + rows, [], 0
            if run:
                units.append((path, run, offset))
        return units

    def reader(self, path: str) -> pq.ParquetFile:
        """This thread's reader of `path`."""
        files = self._local.__dict__.setdefault("files", {})
        if path not in files:
            self._handles.append(handle := reader(f"{self._root}/{unquote(path)}"))
            files[path] = pq.ParquetFile(handle, metadata=self._footers[path])
        return files[path]

    def close(self) -> None:
        for handle in self._handles:
            handle.close()


def _data_file(root: str, rows: pa.Table, schema: pa.Schema, now: int, *, data_change: bool = True) -> dict[str, Any]:
    """Step 2: the batch's merged and new rows as one data file, with its
    statistics (`FileStats`, as the executors' files have them)."""
    name = f"part-{uuid.uuid4()}-c000.snappy.parquet"
    rows = rows.cast(schema)
    size = _write_parquet(f"{root}/{name}", rows)
    stats = FileStats(schema)
    for batch in rows.to_batches():
        stats.add(batch)
    return {"add": {"path": name, "partitionValues": {}, "size": size, "modificationTime": now, "dataChange": data_change, "stats": stats.json()}}


def _write_parquet(location: str, rows: pa.Table) -> int:
    """`rows` as the Parquet file at `location` (local or S3); its size."""
    sink = pa.BufferOutputStream()
    pq.write_table(rows, sink, compression="snappy", coerce_timestamps="us", allow_truncated_timestamps=False)
    data = sink.getvalue().to_pybytes()
    write_bytes(location, data)
    return len(data)


def _read(source: pq.ParquetFile, groups: list[int], schema: pa.Schema) -> pa.Table:
    """Row groups' rows, all of them (deleted ones too: row indexes are
    the file's), in the state's schema: a column added since as nulls.
    (One thread: pyarrow's pool left alive beside delta-rs's can abort the
    process at exit, `delta_io.read_pruned`.)"""
    present = set(source.schema_arrow.names)
    return in_schema(source.read_row_groups(groups, columns=[f.name for f in schema if f.name in present], use_threads=False), schema)


def _key_range(data: pa.Table, keys: list[str]) -> tuple[Any, Any] | None:
    """The batch's smallest and largest key (one key column), None when
    unknown (several key columns, a float key holding a NaN)."""
    if len(keys) != 1 or not data.num_rows:
        return None
    column = data.column(keys[0])
    if pa.types.is_floating(column.type) and pc.any(pc.is_nan(column)).as_py():
        return None
    found = pc.min_max(column)
    try:
        low, high = found["min"].as_py(), found["max"].as_py()
        if low is not None and pa.types.is_timestamp(column.type):
            # The log's bounds are cut to the millisecond (a file's largest
            # time may lie below its last row's): compared as the staged
            # path's bounds are, rounded out (`staged.key_range`).
            low, high = low - _MILLISECOND, high + _MILLISECOND
    except (OverflowError, ValueError):  # a date or time past Python's years 1 to 9999
        return None
    return None if low is None else (low, high)


def _revectored(add: dict[str, Any], descriptor: dict[str, Any], now: int) -> list[dict[str, Any]]:
    """A file's add action replaced by one with `descriptor` as its vector:
    the old one removed (`own_commits.removal`), the new one added. Its statistics
    still bound its rows, no longer tightly."""
    readded = {k: v for k, v in add.items() if v is not None}
    readded.update(modificationTime=now, dataChange=True, deletionVector=descriptor)
    if readded.get("stats"):
        stats = json.loads(readded["stats"])
        stats["tightBounds"] = False
        readded["stats"] = json.dumps(stats)
    return [removal(add, now), {"add": readded}]


def _change_file(root: str, before: pa.Table, after: pa.Table, inserted: pa.Table) -> dict[str, Any]:
    """The batch's row changes as one change data file, and its ``cdc`` action."""
    kinds = ["update_preimage"] * before.num_rows + ["update_postimage"] * after.num_rows + ["insert"] * inserted.num_rows
    return _cdc(root, pa.concat_tables([before, after, inserted]).append_column("_change_type", pa.array(kinds, pa.string())))


def _cdc(root: str, rows: pa.Table) -> dict[str, Any]:
    """`rows` (with `_change_type`) as one change data file (Delta's `_change_data` folder), and its ``cdc`` action."""
    path = f"{CHANGE_DATA}/cdc-{uuid.uuid4()}.snappy.parquet"
    return {"cdc": {"path": path, "partitionValues": {}, "size": _write_parquet(f"{root}/{path}", rows), "dataChange": False}}
