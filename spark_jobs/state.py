"""The keyed state table: one delta-rs MERGE per batch.

The merge is built only from identifiers the spec validated
(`spark_jobs.spec.IDENTIFIER`), double-quoted for DataFusion, so nothing from
the spec reaches SQL as free text. Merge rules, per value column:

* ``sum``   existing + batch (a null on either side counts as absent)
* ``min`` / ``max``   the smaller / larger, ignoring nulls
* ``first`` keep the existing value (the batch's if the existing one is null)
* ``last``  take the batch's value

Every row also records `_batch_id`, the last batch that touched it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable

from spark_jobs.delta_io import ensure_table, open_table
from spark_jobs.fencing import STATE_FENCE, Position, commit_properties, transaction_position
from spark_jobs.spec import PipelineSpec
from spark_jobs.sql_text import datafusion_identifier

BATCH_COLUMN = "_batch_id"
#: Key of the commit metadata entry that makes a state commit self-describing.
METADATA_KEY = "microbatch"
#: How far back in the state's history to look for a commit we need to find.
HISTORY_SEARCH = 1000
#: Delta operations (as Delta and delta-rs name them in commit info) that
#: leave a table's rows as they were. Any other commit not made by this job
#: (RESTORE, DELETE, UPDATE, MERGE, WRITE, FSCK, REPLACE, ...) is taken as a
#: change of the state behind the ledger's back: failing closed on an
#: operation missing here costs a `microbatch rewind`, while missing a
#: data-changing one would cost exactness.
MAINTENANCE_OPERATIONS = frozenset(
    {
        "OPTIMIZE",
        "VACUUM START",
        "VACUUM END",
        "REORG",
        "CREATE TABLE",
        "SET TBLPROPERTIES",
        "UNSET TBLPROPERTIES",
        "ADD CONSTRAINT",
        "DROP CONSTRAINT",
        "ADD COLUMNS",
        "ADD COLUMN",
        "CHANGE COLUMN",
        "RENAME COLUMN",
        "UPDATE FIELD METADATA",
        "UPDATE TABLE METADATA",
        "UPGRADE PROTOCOL",
        "ADD FEATURE",
        "COMPUTE STATS",
    }
)


def _q(name: str) -> str:
    return datafusion_identifier(name)


def merge_expression(column: str, rule: str) -> str:
    t, s = f"t.{_q(column)}", f"s.{_q(column)}"
    if rule == "sum":
        return f"CASE WHEN {t} IS NULL THEN {s} WHEN {s} IS NULL THEN {t} ELSE {t} + {s} END"
    if rule in ("min", "max"):
        op = "<" if rule == "min" else ">"
        return f"CASE WHEN {t} IS NULL THEN {s} WHEN {s} IS NULL THEN {t} WHEN {s} {op} {t} THEN {s} ELSE {t} END"
    if rule == "first":
        return f"COALESCE({t}, {s})"
    if rule == "last":
        return s
    raise ValueError(f"unknown merge rule {rule!r}")


@dataclass
class StateCommit:
    """A state commit made by this job, read back from the table's history."""

    version: int
    metadata: dict[str, Any]
    operation_metrics: dict[str, int]
    timestamp: datetime


class StateTable:
    def __init__(self, spec: PipelineSpec, storage_options: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.path = spec.state_path
        self.storage_options = storage_options

    def open(self) -> DeltaTable | None:
        return open_table(self.path, self.storage_options)

    @staticmethod
    def position(table: DeltaTable | None) -> Position:
        return transaction_position(table, STATE_FENCE) if table is not None else Position(0, 0)

    def create(self, updates: pa.Table) -> DeltaTable:
        """Create the (empty) state table with the columns of a batch's updates."""
        schema = pa.schema([*updates.schema, pa.field(BATCH_COLUMN, pa.int64())])
        return ensure_table(
            self.path,
            schema,
            storage_options=self.storage_options,
            name=self.spec.name,
            description=self.spec.description or None,
        )

    def commit_batch(
        self, table: DeltaTable, updates: pa.Table, position: Position, metadata: dict[str, Any]
    ) -> tuple[int, int]:
        """Merge one batch's updates; returns (new table version, keys updated).

        Raises delta-rs's commit error if another commit carrying the state
        fence landed after `table`'s snapshot (the caller decides what it means).
        """
        data = updates.append_column(BATCH_COLUMN, pa.array([position.batch_id] * updates.num_rows, pa.int64()))
        props = commit_properties(STATE_FENCE, position, {METADATA_KEY: json.dumps(metadata, sort_keys=True)})
        data = self._align(table, data)
        if data.num_rows == 0:
            # A MERGE with an empty source makes no commit in delta-rs, which
            # would leave the fence behind and the batch replayed forever
            # (e.g. a batch whose records were all quarantined). Commit the
            # fence with an empty append instead.
            return self._fenced_empty_commit(table, props), 0
        keys = self.spec.state.keys
        predicate = " AND ".join(f"t.{_q(k)} = s.{_q(k)}" for k in keys)
        updates_expr = {_q(c): merge_expression(c, rule) for c, rule in self.spec.state.merge.items()}
        updates_expr[_q(BATCH_COLUMN)] = f"s.{_q(BATCH_COLUMN)}"
        inserts = {_q(c): f"s.{_q(c)}" for c in data.column_names}
        metrics = (
            table.merge(
                data,
                predicate=predicate,
                source_alias="s",
                target_alias="t",
                commit_properties=props,
            )
            .when_matched_update(updates=updates_expr)
            .when_not_matched_insert(updates=inserts)
            .execute()
        )
        keys_updated = int(metrics["num_target_rows_inserted"]) + int(metrics["num_target_rows_updated"])
        # delta-rs moves the handle to the version it committed. (Not
        # `update_incremental()`: that could skip ahead to a later writer's.)
        return table.version(), keys_updated

    def _align(self, table: DeltaTable, data: pa.Table) -> pa.Table:
        """Cast a batch to the state table's column types, or explain why not."""
        from spark_jobs.errors import TransformError

        existing = pa.schema(table.schema().to_arrow())
        fields = []
        for field in data.schema:
            if field.name not in existing.names:
                raise TransformError(
                    f"pipeline {self.spec.name}: column {field.name!r} is not in the state table "
                    f"{self.path}; changing the state's columns needs a new state path and a new "
                    "checkpoint (the pipeline then reprocesses its source from the start)"
                )
            fields.append(existing.field(field.name).with_nullable(True))
        try:
            return data.cast(pa.schema(fields))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise TransformError(
                f"pipeline {self.spec.name}: this batch's columns do not fit the state table's "
                f"types ({exc}); cast them in the transform to the types in {self.path}"
            ) from exc

    def restore(self, table: DeltaTable, version: int | None, position: Position, metadata: dict[str, Any]) -> int:
        """Put the state back as of `version` (None: empty), fenced at `position`.

        Commits from `table`'s snapshot, which the caller has checked.
        """
        props = commit_properties(STATE_FENCE, position, {METADATA_KEY: json.dumps(metadata, sort_keys=True)})
        before = table.version()
        if version is None:
            table.delete(commit_properties=props)
        else:
            table.restore(version, commit_properties=props)
        # The handle moves only if delta-rs committed. (Refreshing it here
        # would mistake a concurrent writer's commit for ours.)
        if table.version() == before:
            # Nothing to delete or restore: delta-rs made no commit, but the
            # fence must still move, from the snapshot the caller checked.
            return self._fenced_empty_commit(table, props)
        return table.version()

    @staticmethod
    def _fenced_empty_commit(table: DeltaTable, props) -> int:
        from deltalake import write_deltalake

        empty = pa.schema(table.schema().to_arrow()).empty_table()
        write_deltalake(table, empty, mode="append", commit_properties=props)
        return table.version()

    def check_fits(self, table: DeltaTable, updates: pa.Table) -> None:
        """Raise `TransformError` if a batch's updates cannot be merged into `table`."""
        self._align(table, updates)

    def outside_changes(
        self, table: DeltaTable, since_version: int, before_version: int | None = None
    ) -> list[tuple[int, str]]:
        """Commits after `since_version` (and before `before_version`) that
        changed the data and are not ours.

        Maintenance (`MAINTENANCE_OPERATIONS`: OPTIMIZE, VACUUM, table
        properties, ...) keeps the data and is fine; anything else by someone
        else is reported. Costs nothing in the usual case, where our last
        commit is the table's latest version.
        """
        newer = table.version() - since_version
        if newer <= 0 or (before_version is not None and before_version <= since_version + 1):
            return []  # no version in between: no history to read
        changes = []
        for info in table.history(min(newer, HISTORY_SEARCH)):
            version = int(info["version"])
            if version <= since_version or (before_version is not None and version >= before_version):
                continue
            if info.get(METADATA_KEY):
                continue
            operation = str(info.get("operation", "")).upper()
            if operation not in MAINTENANCE_OPERATIONS:
                changes.append((version, operation))
        return sorted(changes)

    def find_commit(self, table: DeltaTable, position: Position) -> StateCommit | None:
        """The commit of ours that carried the state fence at `position`.

        Searched newest first with a growing window: it is almost always the
        latest commit (step 5 looks right after making it), and reading the
        whole history each batch would grow with the table's age.
        """
        for limit in (1, 16, HISTORY_SEARCH):
            for info in table.history(limit):
                raw = info.get(METADATA_KEY)
                metadata = json.loads(raw) if raw else {}
                if metadata.get("txn") == position.encode():
                    return StateCommit(
                        version=int(info["version"]),
                        metadata=metadata,
                        operation_metrics={
                            k: int(v) for k, v in (info.get("operationMetrics") or {}).items() if str(v).isdigit()
                        },
                        timestamp=datetime.fromtimestamp(info["timestamp"] / 1000, tz=timezone.utc),
                    )
            if table.version() < limit:  # the whole history has been searched
                break
        return None

