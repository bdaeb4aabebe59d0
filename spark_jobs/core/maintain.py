"""Maintenance: compact and vacuum a pipeline's tables, keeping rewinds possible.

Every batch adds small files to the state, the ledger, the quarantine and
the dedup table, and every merge leaves the files it rewrote behind for
time travel. `maintain` folds an appended state (`spark_jobs.core.folding`),
compacts the tables, VACUUMs them and writes Delta checkpoints, so reads
stay fast and disk use stays bounded. The one thing it must not take
away is the rewinds people need: the state's versions of the last
`maintenance.keep_batches` batches of the lineage (and the current version)
are kept restorable with delta-rs's `keep_versions`; older ones may lose
their files.

Rewind then restores, for batch K, the newest *restorable* version whose
data equals K's: K's own commit, or a maintenance-only commit after it and
before K+1's (an OPTIMIZE rewrites files without changing rows). So an
OPTIMIZE followed by a VACUUM that dropped K's own files still leaves K
rewindable through the OPTIMIZE's version.

The table of final rows (`spark_jobs.core.windows`) is compacted and
VACUUMed keeping what a downstream reading it has yet to read: a rewind
deletes rows from it and never restores it.

Ledger, quarantine, consumed index and dedup table are never rewound, so
their old versions are not needed (first, the dedup table loses the rows
no batch a rewind can reach reads: `spark_jobs.core.dedup`). Their VACUUM
runs before their compaction: the files a compaction replaces stay until
the next maintenance, for runs reading an older snapshot concurrently, so
dead files never exceed one compaction's worth.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from deltalake import DeltaTable

from spark_jobs.core.agreement import check_spec
from spark_jobs.core.compute import Compute, Engine, FileWriting
from spark_jobs.core.commits import METADATA_KEY
from spark_jobs.core import merge_on_read
from spark_jobs.core.deletion_vectors import carries_vectors, vector_files
from spark_jobs.core.delta_io import COMPACTION_WRITER, SMALL_FILE_BYTES, commit_info, is_commit_conflict, open_table
from spark_jobs.core.fencing import COMMIT_FENCE, PLAN_FENCE, STATE_FENCE, Position
from spark_jobs.core.folding import FOLD_KEY, fold, is_appended, row_counts
from spark_jobs.core.ledger import LedgerView, RowStatus, scoped
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.protocol import reconcile
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.staged import IN_PROCESS_ROWS
from spark_jobs.core.state import MAINTENANCE_OPERATIONS
from spark_jobs.core.untracked import remove_untracked, removal_floor
from spark_jobs.core.windows import FINAL_FENCE, keep_marker_in_reach
from spark_jobs.sources.delta import version_actions
from spark_jobs.errors import ConcurrentRunError, first_line
from spark_jobs.storage.consumers import JOB_FOLDER, consumers, delete_file, write_json
from spark_jobs.storage.s3 import delta_storage_options, exists, read_bytes

__all__ = ["MaintenanceReport", "maintain", "oldest_rewindable", "restorable", "restorable_version"]

log = logging.getLogger("microbatch")

@dataclass(frozen=True)
class MaintenanceReport:
    pipeline: str
    #: Batches whose state versions were kept restorable.
    kept_batches: list[int]
    #: Files each table's VACUUM deleted, by table (and the state's change data files pruned).
    removed_files: dict[str, int]
    #: Downstream pipelines reading the state, and the last version each consumed (kept after it).
    readers: dict[str, int] = field(default_factory=dict)
    #: With `dedup`: the ids deleted, read by no batch a rewind can reach.
    forgotten_ids: int = 0
    #: With `event_time.final`: the downstreams reading the final rows, as `readers`.
    final_readers: dict[str, int] = field(default_factory=dict)
    #: Files each table's compaction replaced, by table (0: nothing to compact).
    compacted_files: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline, "kept_batches": self.kept_batches, "removed_files": self.removed_files,
            "readers": self.readers, "forgotten_ids": self.forgotten_ids, "final_readers": self.final_readers,
            "compacted_files": self.compacted_files,
        }


def maintain(spec: PipelineSpec, keep_batches: int | None = None, compute_factory: Callable[[], Compute] | None = None) -> MaintenanceReport:
    """Compact, VACUUM and checkpoint the state, ledger, quarantine, dedup
    ids and final rows of `spec`, folding an appended state first. `compute_factory`: the engine a
    big state's fold runs on (`folding.fold`), started only for one."""
    pipeline = Pipeline(spec)
    view = reconcile(pipeline)  # the tables must agree first (and a lagging row is recorded)
    keep = keep_batches or spec.maintenance.keep_batches
    kept_rows = view.lineage()[-keep:]
    keep_versions = {r.state_version for r in kept_rows if r.state_version is not None}
    if view.head is not None and view.head.state_version is not None:
        keep_versions.add(view.head.state_version)
    removed: dict[str, int] = {}
    compacted: dict[str, int] = {}
    readers: dict[str, int] = {}
    state = pipeline.state.open()
    if state is not None:
        engine = Engine(compute_factory or _no_engine)
        try:
            with _racing(spec, pipeline.state.path):
                readers = _maintain_state(pipeline, view, state, keep_versions, (removed, compacted), engine if compute_factory else None)
        finally:
            engine.close()
    # The consumed index follows the ledger's head (and is built here for a
    # pipeline older than it), so lookups stop reading the ledger.
    lineage = pipeline.lineage(view)
    lineage.record()
    # Each table's fences, which the marker before an untracked file's removal carries (`untracked`).
    fences = {
        "ledger": [scoped(PLAN_FENCE, spec.name), scoped(COMMIT_FENCE, spec.name)],
        "quarantine": [pipeline.quarantine.fence],
        "consumed": [pipeline.consumed.fence(lineage.ledger)] if lineage.ledger is not None else [],
        "dedup": [pipeline.dedup.fence],
    }
    forgotten = _forget_ids(pipeline, view)
    tables = (("ledger", pipeline.ledger.path), ("quarantine", pipeline.quarantine.path), ("consumed", pipeline.consumed.path), ("dedup", pipeline.dedup.path))
    for name, path in tables:
        table = open_table(path)
        if table is None:
            continue
        with _racing(spec, path):
            # VACUUM first, then compact: what this compaction replaces stays for
            # readers of older snapshots until the next maintenance removes it.
            removed[name] = len(table.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False))
            removed[f"{name} untracked"] = remove_untracked(table, table.version(), spec.maintenance.untracked_files_hours, fences[name])
            if name == "consumed":
                lineage.sort()
            else:
                compacted[name] = _compact(table, target_size=SMALL_FILE_BYTES, writer_properties=COMPACTION_WRITER)
            table.update_incremental()
            table.create_checkpoint()
            # Log entries older than the table's log retention (Delta's default:
            # 30 days) and behind the checkpoint go, so the log stays bounded too.
            table.cleanup_metadata()
    final_readers = _maintain_final(spec, removed, compacted) if spec.final_path is not None else {}
    log.info("maintained %s: kept batches %s rewindable; removed %s files, compacted %s", spec.name, [r.batch_id for r in kept_rows], removed, compacted)
    return MaintenanceReport(spec.name, [r.batch_id for r in kept_rows], removed, readers, forgotten, final_readers, compacted)


def _compact(table: DeltaTable, **options: Any) -> int:
    """Compact `table`'s small files; how many it replaced (0: it had none to, and committed nothing)."""
    return int(table.optimize.compact(**options).get("numFilesRemoved", 0))


def _maintain_final(spec: PipelineSpec, removed: dict[str, int], compacted: dict[str, int]) -> dict[str, int]:
    """The table of final rows (`spark_jobs.core.windows`): each batch that
    closes windows appends a small file, so it is compacted; VACUUM keeps
    the versions a downstream reading it has yet to read (and, with none
    recorded, only the newest), and its change data is pruned once every
    downstream has read it, as the state's. No rewind restores an older
    version of it (a rewind deletes the rows after its batch), so none is
    kept for one.

    VACUUM runs before the compaction, as for the ledger: what the
    compaction replaces stays for readers of older snapshots until the next
    maintenance. Once this made any commit, the marker of how far the table
    was brought is committed again (`windows.keep_marker_in_reach`). Its
    log is not cleaned up: that marker is a commit's metadata, which a
    checkpoint does not keep. Returns the downstream readers."""
    path = spec.final_path
    table = open_table(path) if path is not None else None
    if path is None or table is None:
        return {}
    with _racing(spec, path):
        before = table.version()
        readers = _readers(path, table)
        keep, prune_before = _kept({table.version()}, readers, table)
        kept = sorted(keep)
        # (A VACUUM with nothing to delete still commits twice.)
        doomed = table.vacuum(retention_hours=0, dry_run=True, enforce_retention_duration=False, keep_versions=kept)
        removed["final"] = len(table.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False, keep_versions=kept)) if doomed else 0
        # Files the versions kept for a downstream name are not untracked.
        removed["final untracked"] = remove_untracked(table, min(keep), spec.maintenance.untracked_files_hours, [scoped(FINAL_FENCE, spec.name)])
        compacted["final"] = _compact(table, target_size=SMALL_FILE_BYTES, writer_properties=COMPACTION_WRITER)
        table.update_incremental()
        if table.version() != before:
            keep_marker_in_reach(spec, table)
        table.create_checkpoint()
        removed["final change data"] = _prune_change_data(path, table, prune_before)
    return readers


def _forget_ids(pipeline: Pipeline, view: LedgerView) -> int:
    """With `dedup`: delete the ids no batch a rewind can reach reads
    (`SeenIds.forget`), by the oldest batch a rewind still accepts, found
    after the state's VACUUM; how many went."""
    spec = pipeline.spec
    if spec.dedup is None:
        return 0
    with _racing(spec, pipeline.dedup.path):
        oldest = oldest_rewindable(pipeline, view, pipeline.state.open())
        row = next((r for r in view.lineage() if r.batch_id == oldest), None)
        return pipeline.dedup.forget(view, row, spec.dedup.within_seconds)


def _maintain_state(
    pipeline: Pipeline, view: LedgerView, state: DeltaTable, keep_versions: set[int],
    counts: tuple[dict[str, int], dict[str, int]], engine: Engine | None,
) -> dict[str, int]:
    """Fold (an appended state), compact, VACUUM and checkpoint the state,
    keeping `keep_versions` and every version a downstream has yet to read
    restorable; counts the files removed and compacted in `counts`. Returns
    the downstream readers."""
    spec = pipeline.spec
    removed, compacted = counts
    folded = 0
    if is_appended(spec) and row_counts(state).appended:
        # An appended state is folded first: one row per key again, and the
        # VACUUM below removes the partial rows' files once no kept version needs them.
        # Folded under the merge rules the lineage was made with, never
        # under an edited spec a run would refuse (the fold would bake the
        # new rules into every key's value).
        check_spec(pipeline, view)
        files_before = len(state.file_uris())
        # The fold replaces every file of the snapshot it read: that is
        # this layout's compaction (the one below then finds nothing left).
        if fold(spec, state, _fold_engine(spec, state, engine)) is not None:
            folded = files_before
    # Compact first, so that the VACUUM removes what the compaction replaced;
    # from the latest snapshot (a fold that lost its race left the handle behind).
    state.update_incremental()
    compacted["state"] = folded + _compact(state)
    # Files the compaction left (big enough already) keep their deletion
    # vectors: rewritten without the rows they delete, so batches stop
    # reading those rows (`merge_on_read.purge`; nothing without vectors).
    state.update_incremental()
    purged = merge_on_read.purge(state)
    if purged is not None:
        state.update_incremental()
        compacted["state"] += purged[1]
    # The downstream readers are read just before the deletions, not before
    # the fold and compaction (a minute, at scale): a downstream rewound
    # meanwhile has moved its position back, and its replay needs the
    # versions after it (`rewind` checks again once its position is moved).
    readers = _readers(pipeline.state.path, state)
    keep_versions, prune_before = _kept(keep_versions, readers, state)
    if pipeline.state.position(pipeline.state.open()) == view.position:
        removed["state"] = len(
            state.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False, keep_versions=sorted(keep_versions))
        )
        # Files no commit references: a fold that lost its race, a run killed before its commit.
        removed["state untracked"] = remove_untracked(
            state, min(keep_versions, default=state.version()), spec.maintenance.untracked_files_hours, [STATE_FENCE]
        )
    else:
        # A batch or a rewind committed meanwhile: the versions to keep
        # were chosen for another head (a rewind may have just restored
        # files this VACUUM would delete). The next maintenance does it.
        log.warning("state of %s moved during maintenance; VACUUM of the state skipped this time", spec.name)
    state.create_checkpoint()
    removed["change data"] = _prune_change_data(pipeline.state.path, state, prune_before)
    return readers


def _kept(keep_versions: set[int], readers: dict[str, int], state: DeltaTable) -> tuple[set[int], int]:
    """The versions the VACUUM keeps, and the version before which change
    data may be pruned.

    The change data of versions every recorded downstream has read, before
    the versions kept for rewinds, is read by no one again. With no
    downstream recorded, none is pruned: one that has not run since
    positions were recorded may still need it. Versions a downstream has yet
    to read stay readable: their files and those of the version before each
    (a rewind's RESTORE reads as the rows it removed and the rows it brought back)."""
    unread = min(readers.values()) + 1 if readers else 0
    prune_before = min([*keep_versions, unread])
    kept = keep_versions | (set(range(max(unread - 1, 0), state.version() + 1)) if readers else set())
    return kept, prune_before


def _no_engine() -> Compute:
    raise ValueError("maintain was given no engine to fold on")


def _fold_engine(spec: PipelineSpec, state: DeltaTable, engine: Engine | None) -> FileWriting | None:
    """The engine whose executors fold a state too big to fold in this
    process (more than `IN_PROCESS_ROWS` rows; always, with
    `engine.state_write: executors`); None: fold here. Here too when the
    state's files carry deletion vectors (a state merged on read, turned
    appended): the executors would read the rows the vectors delete."""
    if engine is None or spec.engine.state_write == "driver" or carries_vectors(state):
        return None
    if spec.engine.state_write == "auto" and row_counts(state).rows <= IN_PROCESS_ROWS:
        return None
    return engine.files() if engine.writes_files else None


@contextmanager
def _racing(spec: PipelineSpec, path: str) -> Iterator[None]:
    """A commit of another writer (a batch, a rewind, a fold, a property
    set) landed first and conflicts with one of `maintain`'s (a compaction
    or a fold writes whole or not at all): nothing was lost, and `maintain`
    can simply run again (exit 1, retried)."""
    try:
        yield
    except Exception as exc:
        if not is_commit_conflict(exc):
            raise
        raise ConcurrentRunError(
            f"pipeline {spec.name}: another commit landed on {path} while `maintain` worked on it ({first_line(exc)}); "
            "nothing was lost, run maintain again",
            pipeline=spec.name,
            path=path,
        ) from exc


def _readers(path: str, state: DeltaTable) -> dict[str, int]:
    """The downstream pipelines reading this state (by name, and checkpoint
    where two share a name) and the last version each consumed. Only
    positions in this very table count: one recorded in a table since
    deleted and recreated at the path counts for nothing."""
    table_id = state.metadata().id
    recorded = [c for c in consumers(path) if c.table_id in (None, table_id)]
    names = [c.pipeline for c in recorded]
    found = {c.pipeline if names.count(c.pipeline) == 1 else f"{c.pipeline} ({c.checkpoint})": c.version for c in recorded}
    for name, version in sorted(found.items()):
        log.info("downstream %s has read %s up to version %d: later versions are kept", name, path, version)
    return found


def _prune_change_data(path: str, state: DeltaTable, before: int) -> int:
    """Delete the change data files (`_change_data/`, which VACUUM leaves
    alone) of the versions before `before`: every downstream has read them
    and no kept version needs them. Returns how many files went.

    Each version's files are named in its log entry; the versions already
    pruned are remembered beside the consumers, so each is read once."""
    marker = f"{path.rstrip('/')}/{JOB_FOLDER}/change_data_pruned.json"
    try:
        start = int(json.loads(read_bytes(marker))["before"])
    except FileNotFoundError:
        start = 0
    root = state.table_uri.rstrip("/")
    deleted = 0
    for version in range(start, before):
        for action in version_actions(state.table_uri, version) or []:
            if "cdc" in action:
                delete_file(f"{root}/{action['cdc']['path']}")
                deleted += 1
    if before > start:
        write_json(marker, {"before": before})
    return deleted


def restorable(path: str, version: int) -> bool:
    """Whether every data file of the table's `version` still exists, and
    every deletion-vector file its files read (a state merged on read:
    VACUUM leaves a version's data files that no batch removed, and the
    removal of untracked files takes the vector files of the versions not
    kept)."""
    try:
        table = DeltaTable(path, version=version, storage_options=delta_storage_options(path))
        files = [*table.file_uris(), *vector_files(table)]
    except Exception:  # noqa: BLE001 - a version whose log entry is gone is not restorable either
        return False
    return all(exists(f) for f in files)


def restorable_version(table: DeltaTable, path: str, version: int, next_version: int | None) -> int | None:
    """The newest restorable version whose data equals `version`'s: itself, or
    one of the maintenance-only commits that directly follow it (before
    `next_version`, the next batch's; None: up to the latest). The run stops
    at the first commit that may change data (ours or anyone's)."""
    end = table.version() if next_version is None else next_version - 1
    candidates = [version]
    # Each log entry read by its number, oldest first (never `history()`'s
    # labels: `delta_io.commit_info`).
    for v in range(version + 1, end + 1):
        info = commit_info(table.table_uri, v)
        # A fold keeps every value too (an appended state's rows folded into one per key).
        maintenance = info is not None and (info.get(FOLD_KEY) or (
            not info.get(METADATA_KEY) and str(info.get("operation", "")).upper() in MAINTENANCE_OPERATIONS
        ))
        if not maintenance:
            break
        candidates.append(v)
    for candidate in reversed(candidates):
        if restorable(path, candidate):
            return candidate
    return None


def oldest_rewindable(pipeline: Pipeline, view: LedgerView, table: DeltaTable | None) -> int | None:
    """The oldest lineage batch a rewind can still restore (0, the empty state,
    always can); None when there is no state. Restorability only ever shrinks
    from the oldest versions up, so a binary search finds the boundary."""
    if table is None:
        return None
    head = view.head
    batch_ids: Sequence[int]
    if head is not None and head.epoch == 0 and head.status is RowStatus.COMMITTED:
        # Never rewound: the lineage is epoch 0's batches 1..head, each found
        # by position, so the search costs ~2 log2(N) small reads, not a
        # read of the whole ledger (docs/benchmarks.md, "Figures behind the
        # code's choices").
        batch_ids = range(1, head.batch_id + 1)

        def version(i: int) -> int | None:
            found = pipeline.ledger.at(view.table, Position(0, batch_ids[i]), (RowStatus.COMMITTED,))
            return found[0].state_version if found else None
    else:
        lineage = view.lineage()
        batch_ids = [r.batch_id for r in lineage]

        def version(i: int) -> int | None:
            return lineage[i].state_version

    floor = removal_floor(table)  # (a batch before it may still be restorable: not rewindable all the same)

    def ok(i: int) -> bool:
        v = version(i)
        following = version(i + 1) if i + 1 < len(batch_ids) else None
        restorable_at = restorable_version(table, pipeline.state.path, v, following) if v is not None else None
        return restorable_at is not None and (floor is None or restorable_at >= floor)

    low, high = 0, len(batch_ids)  # the answer is the first i with ok(i), or len(batch_ids) if none
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return batch_ids[low] if low < len(batch_ids) else 0
