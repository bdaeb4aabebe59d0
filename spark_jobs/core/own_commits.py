"""The job's own entries in a state table's Delta log.

delta-rs 1.6.6 commits the files it writes and data files written by
others (`staged.commit_files`), but neither a deletion vector nor a change
data file (``cdc``) written by others. Where a batch needs one (a state
merged on read, `merge_on_read`; a state with a change feed whose big batch
the executors merge, `commit_rewrite`), the job writes the log entry itself,
as delta-rs would have: the commit info carries the batch's metadata
(`commits.METADATA_KEY`, which `find_commit`, reconcile and the ledger read
alike), a ``txn`` moves the state fence, and files are removed as they were
added.

An entry is committed at the snapshot's version + 1 and only there
(`commit`): written aside and linked into place on a local disk, put with
``If-None-Match: *`` on S3 (`storage.files.create`). Any commit since the
snapshot (a racing run, a zombie, `maintain`) makes that version exist, and
the commit fails with delta-rs's `CommitFailedError`, which step 4 judges as
every other state conflict.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any
from urllib.parse import unquote

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from spark_jobs.core.commits import METADATA_KEY, CommitMetadata
from spark_jobs.core.deletion_vectors import active_files, commit as commit_entry, table_root
from spark_jobs.core.faults import fault_point
from spark_jobs.core.fencing import STATE_FENCE
from spark_jobs.core.staged import StagedFile
from spark_jobs.storage.s3 import delta_storage_options

__all__ = ["commit", "commit_info", "commit_rewrite", "fence", "logged", "removal", "set_properties"]

log = logging.getLogger("microbatch")

#: The table property delta-rs checkpoints by (`delta_io.TABLE_DEFAULTS` sets it on the job's tables).
CHECKPOINT_INTERVAL = "delta.checkpointInterval"


def commit(table: DeltaTable, actions: list[dict[str, Any]], during: str) -> int:
    """`actions` as the log entry after `table`'s snapshot; returns its
    version. Raises `CommitFailedError` (saying it happened `during` what)
    if that version exists: another writer committed since the snapshot.

    A checkpoint follows at the table's interval, as delta-rs writes one
    after its own commits: without it a state whose every batch is the
    job's own entry would be opened from ever more log entries."""
    root, version = table_root(table), table.version() + 1
    try:
        commit_entry(root, version, actions)
    except FileExistsError as exc:
        raise CommitFailedError(f"version {version} of {root} was committed by another writer {during}") from exc
    interval = int(table.metadata().configuration.get(CHECKPOINT_INTERVAL) or 100)
    if version % interval == 0:
        try:
            DeltaTable(root, version=version, storage_options=delta_storage_options(root)).create_checkpoint()
        except Exception as exc:  # noqa: BLE001 - the commit stands; the next interval, or `maintain`, checkpoints
            log.warning("no checkpoint at version %d of %s (%s)", version, root, exc)
    return version


#: The writer features a legacy protocol's writer version implies (Delta's
#: PROTOCOL.md, "Table Features"): a table moved to writer version 7 lists
#: them, or a reader finds a property of a feature its protocol no longer
#: names (delta-spark refused a change feed read across the upgrade,
#: DELTA_FEATURES_PROTOCOL_METADATA_MISMATCH: `changeDataFeed`).
_IMPLIED_WRITER_FEATURES = (
    (2, ("appendOnly", "invariants")), (3, ("checkConstraints",)), (4, ("changeDataFeed", "generatedColumns")),
    (5, ("columnMapping",)), (6, ("identityColumns",)),
)


def set_properties(
    table: DeltaTable, properties: dict[str, str], *, reader_features: tuple[str, ...] = (), writer_features: tuple[str, ...] = ()
) -> int:
    """Set table `properties`, the protocol raised to table features
    (reader 3, writer 7) listing the features given besides those it held
    or its legacy versions implied, in one entry after `table`'s snapshot;
    moves `table` to it and returns it (`commit`'s `CommitFailedError` if
    another landed).

    Not delta-rs's `alter`: its `add_feature` drops the features a legacy
    writer version implied, and its `set_table_properties` on a table of
    reader version 3 adds the reader feature `variantType`, which no reader
    before Delta 4.0 reads (delta-rs 1.6.6, found by a try-to-break review)."""
    protocol, meta = table.protocol(), table.metadata()
    readers = {*(protocol.reader_features or ()), *reader_features}
    if protocol.min_reader_version == 2:
        readers.add("columnMapping")
    writers = {*(protocol.writer_features or ()), *reader_features, *writer_features}
    if protocol.min_writer_version < 7:
        writers.update(name for version, names in _IMPLIED_WRITER_FEATURES if protocol.min_writer_version >= version for name in names)
    now = int(time.time() * 1000)
    described = {key: value for key, value in (("name", meta.name), ("description", meta.description)) if value is not None}
    actions: list[dict[str, Any]] = [
        {"commitInfo": {"timestamp": now, "operation": "SET TBLPROPERTIES", "operationParameters": {"properties": json.dumps(properties)}}},
        {"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": sorted(readers), "writerFeatures": sorted(writers)}},
        {"metaData": {
            "id": meta.id, **described, "format": {"provider": "parquet", "options": {}}, "schemaString": table.schema().to_json(),
            "partitionColumns": list(meta.partition_columns), "createdTime": meta.created_time,
            "configuration": {**meta.configuration, **properties},
        }},
    ]
    version = commit(table, actions, f"while {', '.join(properties)} was set")
    table.load_as_version(version)  # as delta-rs's `alter` moves the handle to the version it committed
    return version


def commit_info(metadata: CommitMetadata, now: int, parameters: dict[str, Any], metrics: dict[str, int]) -> dict[str, Any]:
    """A MERGE's commit info, as delta-rs writes it, with the batch's metadata."""
    return {
        "commitInfo": {
            "timestamp": now, "operation": "MERGE", "operationParameters": parameters,
            METADATA_KEY: metadata.to_json(), "operationMetrics": metrics,
        }
    }


def fence(metadata: CommitMetadata, now: int) -> dict[str, Any]:
    """The state fence moved to the batch's position."""
    return {"txn": {"appId": STATE_FENCE, "version": metadata.position.encode(), "lastUpdated": now}}


def removal(add: dict[str, Any], now: int, *, data_change: bool = True) -> dict[str, Any]:
    """The removal of the file `add` added, as it was added (its vector
    too: a file's identity in the log is its path and its vector)."""
    remove = {
        "path": add["path"], "deletionTimestamp": now, "dataChange": data_change, "extendedFileMetadata": True,
        "partitionValues": add.get("partitionValues") or {}, "size": add["size"],
    }
    if add.get("deletionVector"):
        remove["deletionVector"] = add["deletionVector"]
    return {"remove": remove}


def logged(added: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    """The log's add action of `path` (delta-rs gives paths decoded; the log may encode them)."""
    return added[path] if path in added else next(a for p, a in added.items() if unquote(p) == path)


def commit_rewrite(
    table: DeltaTable, added: tuple[StagedFile, ...], removed: list[str], changes: tuple[StagedFile, ...], metadata: CommitMetadata,
    active: dict[str, dict[str, Any]] | None = None,
) -> int:
    """The executors' join of a batch into the state (`spark_state.merge_files`),
    committed on `table`'s snapshot: the files `removed` (paths as delta-rs
    gives them) replaced by `added`, with the change data files `changes`;
    returns the version. `active`: the snapshot's `active_files`, if the
    caller read them already. Raises `CommitFailedError` if any commit
    landed since the snapshot."""
    root, version, now = table_root(table), table.version(), int(time.time() * 1000)
    active = active if active is not None else active_files(root, version)
    actions = [
        commit_info(metadata, now, {"mode": "executors' join"}, {"num_removed_files": len(removed), "num_added_files": len(added), "num_cdc_files": len(changes)}),
        fence(metadata, now),
        *(removal(logged(active, path), now) for path in removed),
        *({"add": {"path": f.path, "partitionValues": {}, "size": f.size, "modificationTime": now, "dataChange": True, "stats": f.stats}} for f in added),
        *({"cdc": {"path": f.path, "partitionValues": {}, "size": f.size, "dataChange": False}} for f in changes),
    ]
    fault_point("mid_state_merge")  # every file written, the commit not made
    return commit(table, actions, "since this batch read the state")
