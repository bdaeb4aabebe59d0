"""Files in a table's folder that no commit references, and their removal.

A write puts its data files into the table's folder first and commits them
after; a commit that never lands leaves them behind, referenced by no
version: a fold that lost its race (a whole copy of the state), a run
killed between its data files and its commit, a commit the store refused.
No reader ever reads them (a snapshot reads the files its log names), but
delta-rs's VACUUM deletes only files a commit removed, so they stayed for
good. `remove_untracked` deletes them once they are older than a window
longer than any run (`maintenance.untracked_files_hours`), as Delta's own
VACUUM does with untracked files: a younger file may be a write still on
its way to its commit.

Only Parquet files are data files here (an archived source file or a note
someone left is not ours to remove), and a folder holding a Delta table of
its own is another table, left alone. Deletion-vector files
(``deletion_vector_<uuid>.bin``, `spark_jobs.core.merge_on_read`) are the
other files a commit names: each batch merged on read writes one, and a
file's vector replaced by the next batch's leaves the old one named by no
version that VACUUM ever removes (delta-rs's VACUUM removes data files
only), so they are removed here too, once the kept snapshot's vectors
could be read from its log.

What counts as referenced: every file of the snapshot at `keep_from` (the
oldest version `maintain` keeps restorable) and its vectors' files, and
every file (and vector file) any later log entry adds or removes, up to the newest entry in storage (not only the
handle's: a commit landing meanwhile names its files there). Files a commit
removed before `keep_from` and VACUUM left are not needed by any kept
version either. The log (`_delta_log`) and the job's own folder
(`_microbatch`) are never touched, nor hidden files. Change data
(`_change_data`, named only by `cdc` actions; `maintain` prunes the files of
versions every downstream has read apart) is removed here only when no log
entry still in storage names it: the change files of a commit that never
landed.

A file no commit names may still be one a run is about to commit: a batch
held or frozen between the executors' writing its files and its commit (a
hung task, a zombie resumed), for longer than the window. So before it
deletes anything, `remove_untracked` commits a marker carrying the table's
fences at the positions they hold (`MARKER_KEY`; it moves no fence), on the
version it read the log to, or not at all. A run whose snapshot came before
the marker cannot commit after it (delta-rs fails a commit when one carrying
the same fence landed since its snapshot); one whose snapshot came after it
checks, before it commits, that its files are younger than half the window
(`staged.require_written`), so they were not among the files chosen here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from urllib.parse import unquote

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from spark_jobs.core.deletion_vectors import active_files, has_deletion_vectors, is_vector_file, table_root, vector_file
from spark_jobs.core.delta_io import is_commit_conflict, version_actions
from spark_jobs.core.staged import CHANGE_DATA
from spark_jobs.storage.consumers import JOB_FOLDER, write_json
from spark_jobs.storage.listing import StoredFile, delete, list_files
from spark_jobs.storage.s3 import delta_storage_options, read_bytes

__all__ = ["MARKER_KEY", "remove_untracked", "removal_floor"]

#: Commit info key of the marker committed before untracked files are deleted.
MARKER_KEY = "microbatch.untracked"
#: In the table's job folder: the oldest version the last removal kept (`removal_floor`).
FLOOR_FILE = f"{JOB_FOLDER}/untracked.json"

log = logging.getLogger("microbatch")


def remove_untracked(table: DeltaTable, keep_from: int, older_than_hours: float, fences: list[str]) -> int:
    """Delete the data files in `table`'s folder that no version from
    `keep_from` on references and that are older than `older_than_hours`,
    once a marker carrying `fences` (the table's fence app ids) is
    committed (the module docstring says why). Returns how many went."""
    root = table.table_uri.rstrip("/")
    found = _referenced(root, keep_from)
    if found is None:
        return 0
    referenced, newest, vectors_known, changes = found
    if older_than_hours < 1:
        log.warning(
            "maintenance.untracked_files_hours is %g: a write of a run still going that long may lose its files; "
            "keep it longer than any run", older_than_hours
        )
    cutoff = time.time() - older_than_hours * 3600
    files = list_files(root)
    nested = _nested_tables(files)
    doomed = [
        stored for stored in files
        if stored.mtime <= cutoff and (stored.path.endswith(".parquet") or vectors_known and is_vector_file(stored.path))
        and not stored.path.startswith(nested) and stored.path not in referenced and not _skipped(stored.path)
    ]
    doomed += _unnamed_change_data(root, files, changes, keep_from, cutoff)
    if not doomed:
        return 0
    # Before the marker: a rewind whose snapshot follows the marker reads it
    # (`removal_floor`). It never goes down: a later removal keeping more
    # versions cannot give back the files an earlier one took.
    floor = max(keep_from, removal_floor(table) or 0)
    write_json(f"{table_root(table)}/{FLOOR_FILE}", {"keep_from": floor, "table_id": table.metadata().id})
    if not _mark(root, newest, fences, len(doomed)):
        return 0
    for stored in doomed:
        delete(stored)
    log.info("removed %d file(s) no commit of %s references (older than %g h)", len(doomed), root, older_than_hours)
    return len(doomed)


def removal_floor(table: DeltaTable) -> int | None:
    """The oldest version whose files every removal of untracked files in
    `table`'s folder kept (the highest `keep_from` any of them had); None if
    none ran there (or it was another table's, at the same path).

    A version before it may have lost its files, or be losing them now:
    the removal keeps what versions from its `keep_from` on name, so a
    version before it whose data files happen to remain (a batch merged on
    read removes none) may have lost its vector files, and a rewind to one
    landing while the files are deleted would leave the state naming files
    that are gone. So a rewind goes to no version before the floor
    (`rewind`, `maintain.oldest_rewindable`). The floor is written before
    the marker: a rewind whose snapshot follows the marker reads it, and
    one whose snapshot precedes it cannot commit (its fence)."""
    try:
        floor = json.loads(read_bytes(f"{table_root(table)}/{FLOOR_FILE}"))
    except FileNotFoundError:
        return None
    return int(floor["keep_from"]) if floor.get("table_id") == table.metadata().id else None


def _referenced(root: str, keep_from: int) -> tuple[set[str], int, bool, set[str]] | None:
    """The files a version from `keep_from` on references (vector files
    too), relative to the table's folder and decoded, the newest version
    read, whether the vector files of `keep_from`'s snapshot are among
    them (read from the log: delta-rs does not expose them), and the change
    data files the entries after `keep_from` name; None if `keep_from`'s snapshot cannot be read (its log
    entries cleaned up): nothing is removed then."""
    try:
        at = DeltaTable(root, version=keep_from, storage_options=delta_storage_options(root))
    except Exception as exc:  # noqa: BLE001 - no snapshot to compare with: remove nothing
        log.warning("untracked files of %s not removed: version %d cannot be read (%s)", root, keep_from, exc)
        return None
    referenced = {unquote(path) for path in at.get_add_actions(flatten=True).column("path").to_pylist()}
    folder, vectors_known = table_root(at), not has_deletion_vectors(at)
    if not vectors_known:
        with contextlib.suppress(FileNotFoundError):  # a log cleaned past any checkpoint: vector files stay
            adds = active_files(folder, keep_from).values()
            referenced |= {vector_file(folder, add.get("deletionVector")) for add in adds} - {None}
            vectors_known = True
    version, changes = keep_from + 1, set()
    while (actions := version_actions(root, version)) is not None:
        for action in actions:
            for kind in ("add", "remove"):
                if kind in action:
                    referenced.add(unquote(action[kind]["path"]))
                    referenced.add(vector_file(folder, action[kind].get("deletionVector")) or "")
            if "cdc" in action:
                changes.add(unquote(action["cdc"]["path"]))
        version += 1
    return referenced, version - 1, vectors_known, changes


def _unnamed_change_data(root: str, files: list[StoredFile], named: set[str], keep_from: int, cutoff: float) -> list[StoredFile]:
    """The change data files older than `cutoff` that no log entry still in
    storage names: written for a commit that never landed (the executors'
    join with its changes, `own_commits.commit_rewrite`, killed before its
    commit). `named`: those the entries after `keep_from` name; the
    entries before it are read only when there is such a file to judge
    (their change data is `maintain`'s to prune while downstreams read it).
    A version whose entry is gone has no change feed to read anyway."""
    candidates = [
        f for f in files
        if f.path.startswith(f"{CHANGE_DATA}/") and f.path.endswith(".parquet") and f.mtime <= cutoff and unquote(f.path) not in named
    ]
    if not candidates:
        return []
    entries = (f.path.removeprefix("_delta_log/").removesuffix(".json") for f in files if f.path.startswith("_delta_log/"))
    for version in sorted(int(e) for e in entries if e.isdigit() and int(e) <= keep_from):
        for action in version_actions(root, version) or []:
            if "cdc" in action:
                named.add(unquote(action["cdc"]["path"]))
    return [f for f in candidates if unquote(f.path) not in named]


def _mark(root: str, newest: int, fences: list[str], count: int) -> bool:
    """Commit the marker on version `newest` (the log read to), carrying
    each of `fences` at the position it holds there; False if any commit
    landed since (its files were not in what was read: nothing is removed
    this time)."""
    at = DeltaTable(root, version=newest, storage_options=delta_storage_options(root))
    properties = CommitProperties(
        custom_metadata={MARKER_KEY: json.dumps({"files": count})},
        app_transactions=[Transaction(app, at.transaction_version(app) or 0) for app in fences],
        max_commit_retries=0,
    )
    try:
        write_deltalake(at, pa.schema(at.schema().to_arrow()).empty_table(), mode="append", commit_properties=properties)
    except Exception as exc:
        if not is_commit_conflict(exc):
            raise
        log.info("untracked files of %s not removed this time: a commit landed while they were looked for", root)
        return False
    return True


def _nested_tables(files: list[StoredFile]) -> tuple[str, ...]:
    """Folders inside the table's that hold a Delta table of their own
    (someone else's): never the table's to clean."""
    return tuple(
        {f.path.split("/_delta_log/", 1)[0] + "/" for f in files if "/_delta_log/" in f.path}
    )


def _skipped(path: str) -> bool:
    """The log, change data, the job's own files and hidden files are never untracked data."""
    return any(part.startswith((".", "_")) for part in path.split("/"))
