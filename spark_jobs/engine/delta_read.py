"""Read a planned range of an upstream Delta table's versions, as Arrow.

Spark cannot read Delta here (delta-spark's JARs cannot be fetched), so the
driver reads the range with delta-rs and hands Spark an Arrow table: the
change data feed for ``read: changes`` (delta-rs's `load_cdf`), the files the
versions added for ``read: appends``. A batch spans at most
`batch.max_versions` versions, which keeps what the driver holds bounded.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from spark_jobs.core.spec import CHANGE_COLUMNS
from spark_jobs.sources.delta import DeltaManifest, version_actions
from spark_jobs.storage.s3 import delta_storage_options, read_bytes

__all__ = ["batch_schema", "net_changes", "read_versions"]


def _table(uri: str, version: int | None = None) -> DeltaTable:
    return DeltaTable(uri, version=version, storage_options=delta_storage_options(uri))


def batch_schema(uri: str, read: str) -> pa.Schema:
    """The `batch` view's columns for a Delta source: the table's, plus the feed's for changes."""
    schema = pa.schema(_table(uri).schema().to_arrow())
    if read == "changes":
        schema = pa.schema(
            [*schema, pa.field(CHANGE_COLUMNS[0], pa.string()), pa.field(CHANGE_COLUMNS[1], pa.int64()),
             pa.field(CHANGE_COLUMNS[2], pa.timestamp("us", tz="UTC"))]
        )
    return schema


def read_versions(manifest: DeltaManifest) -> pa.Table:
    """Exactly the rows of versions `first..last` (what the batch planned;
    none when the batch only records versions lost upstream)."""
    if manifest.first > manifest.last:
        return batch_schema(manifest.uri, manifest.read).empty_table()
    if manifest.read == "changes":
        reader = _table(manifest.uri).load_cdf(starting_version=manifest.first, ending_version=manifest.last)
        rows = pa.table(reader.read_all())
        # As `batch_schema` says: plain strings and UTC microseconds, whatever delta-rs hands over.
        return net_changes(rows.cast(pa.schema([_plain(f) for f in rows.schema])))
    return _appended(manifest)


_ADDED = ("insert", "update_postimage")
_REMOVED = ("delete", "update_preimage")


def net_changes(rows: pa.Table) -> pa.Table:
    """The feed without the rows a version removed and added again unchanged.

    A version with no change data files of its own (a rewind's RESTORE, a
    rewrite widening a column) reads as a delete of every row in the files
    it removed and an insert of every row in the files it added, most of
    them the same rows. Only a transform that subtracts deletes exactly
    nets those out; one with `min`, `max`, `last` or a count of changes
    would not. So within each version, a removal and an addition of an
    identical row (nulls equal nulls) cancel, leaving the version's true
    changes: a RESTORE becomes the exact reversal of what it undid, and a
    rewrite that kept every value, nothing. (A MERGE's update that changed
    nothing cancels too.) Rows keep their order and change types. A table
    with nested or binary columns is passed as it is.
    """
    if rows.num_rows == 0:
        return rows
    values = [c for c in rows.column_names if c not in (CHANGE_COLUMNS[0], CHANGE_COLUMNS[2])]
    if not all(_comparable(rows.schema.field(c).type) for c in values):
        return rows
    kinds = rows.column(CHANGE_COLUMNS[0]).cast(pa.string())
    added, removed = pc.is_in(kinds, pa.array(_ADDED)), pc.is_in(kinds, pa.array(_REMOVED))
    # One text key per row: each value as its length, ':' and its text (so no
    # text can run into the next), a null as 'N'.
    parts = []
    for c in values:
        text = pc.cast(rows.column(c), pa.string())
        parts.append(pc.fill_null(pc.binary_join_element_wise(pc.cast(pc.utf8_length(text), pa.string()), text, ":"), "N"))
    key = pc.binary_join_element_wise(*parts, "|")
    marked = pa.table({"key": key, "added": added, "removed": removed})
    groups = marked.group_by("key", use_threads=False).aggregate([("added", "any"), ("removed", "any")])
    both = groups.filter(pc.and_(groups.column("added_any"), groups.column("removed_any"))).column("key")
    if len(both) == 0:
        return rows
    candidates = pc.indices_nonzero(pc.is_in(key, both)).to_pylist()
    keys, adds = key.take(candidates).to_pylist(), added.take(candidates).to_pylist()
    pending: dict[str, list[tuple[int, bool]]] = {}
    dropped: set[int] = set()
    for i, k, is_add in zip(candidates, keys, adds):
        queue = pending.setdefault(k, [])
        if queue and queue[0][1] != is_add:
            dropped.update((queue.pop(0)[0], i))
        else:
            queue.append((i, is_add))
    keep = pa.array([i not in dropped for i in range(rows.num_rows)])
    return rows.filter(keep)


def _comparable(kind: pa.DataType) -> bool:
    """Types whose text tells equal values from unequal ones."""
    return not (pa.types.is_nested(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind))



def _plain(field: pa.Field) -> pa.Field:
    if pa.types.is_string_view(field.type) or pa.types.is_large_string(field.type):
        return field.with_type(pa.string())
    if field.name == CHANGE_COLUMNS[2]:
        return field.with_type(pa.timestamp("us", tz="UTC"))
    if field.name == CHANGE_COLUMNS[1]:
        return field.with_type(pa.int64())
    return field


def _appended(manifest: DeltaManifest) -> pa.Table:
    """The rows of the data files versions first..last added (the source
    checked they only add): read from each version's own log entry, so no
    file of an earlier version and no file an OPTIMIZE rewrote is read."""
    table = _table(manifest.uri, manifest.last)
    schema = pa.schema(table.schema().to_arrow())
    root = table.table_uri.rstrip("/")
    parts = []
    for version in range(manifest.first, manifest.last + 1):
        for action in version_actions(table.table_uri, version) or []:
            add = action.get("add")
            if add is None or not add.get("dataChange", True):
                continue
            data = pq.read_table(io.BytesIO(read_bytes(f"{root}/{add['path']}")))
            for column, value in (add.get("partitionValues") or {}).items():
                data = data.append_column(column, pa.array([value] * data.num_rows, pa.string()).cast(schema.field(column).type))
            # Columns added to the table after the file was written read as null.
            for field in schema:
                if field.name not in data.column_names:
                    data = data.append_column(field.name, pa.nulls(data.num_rows, field.type))
            parts.append(data.select(schema.names).cast(schema))
    return pa.concat_tables(parts) if parts else schema.empty_table()
