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
import pyarrow.parquet as pq
from deltalake import DeltaTable

from spark_jobs.core.spec import CHANGE_COLUMNS
from spark_jobs.sources.delta import DeltaManifest, version_actions
from spark_jobs.storage.s3 import delta_storage_options, read_bytes

__all__ = ["batch_schema", "read_versions"]


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
        return rows.cast(pa.schema([_plain(f) for f in rows.schema]))
    return _appended(manifest)


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
