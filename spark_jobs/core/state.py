"""The keyed state table: one delta-rs MERGE per batch.

The merge is built only from identifiers the spec validated
(`spark_jobs.core.spec.IDENTIFIER`), double-quoted for DataFusion, so nothing from
the spec reaches SQL as free text. Merge rules, per value column:

* ``sum``   existing + batch (a null on either side counts as absent)
* ``min`` / ``max``   the smaller / larger, ignoring nulls
* ``first`` keep the existing value (the batch's if the existing one is null)
* ``last``  take the batch's value

Every row also records `_batch_id`, the last batch that touched it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake

from spark_jobs.core.commits import METADATA_KEY, CommitMetadata, StateCommit
from spark_jobs.core.delta_io import ensure_table, open_table
from spark_jobs.core.fencing import ORIGIN, STATE_FENCE, Position, commit_properties, transaction_position
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.sql_text import datafusion_identifier as _q
from spark_jobs.errors import TransformError

__all__ = ["BATCH_COLUMN", "MAINTENANCE_OPERATIONS", "StateTable", "merge_expression"]

BATCH_COLUMN = "_batch_id"
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


class StateTable:
    """The keyed state of one pipeline: commits batches, restores, and reads its own history."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        self.path = spec.state_path

    def open(self) -> DeltaTable | None:
        return open_table(self.path)

    @staticmethod
    def position(table: DeltaTable | None) -> Position:
        return transaction_position(table, STATE_FENCE) if table is not None else ORIGIN

    def create(self, updates: pa.Table) -> DeltaTable:
        """Create the (empty) state table with the columns of a batch's updates."""
        schema = pa.schema([*updates.schema, pa.field(BATCH_COLUMN, pa.int64())])
        return ensure_table(
            self.path,
            schema,
            name=self.spec.name,
            description=self.spec.description or None,
        )

    def commit_batch(self, table: DeltaTable, updates: pa.Table, metadata: CommitMetadata) -> tuple[int, int]:
        """Merge one batch's updates (as `align` returned them); returns (new
        table version, keys updated). The commit moves the state fence to the
        batch's position and carries `metadata`.

        Raises delta-rs's commit error if another commit carrying the state
        fence landed after `table`'s snapshot (the caller decides what it means).
        """
        position = metadata.position
        data = updates.append_column(BATCH_COLUMN, pa.array([position.batch_id] * updates.num_rows, pa.int64()))
        props = _fenced(metadata)
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

    def align(self, table: DeltaTable, data: pa.Table) -> pa.Table:
        """A batch's updates cast to the state table's column types, or a
        `TransformError` saying why they cannot be merged into it."""
        existing = pa.schema(table.schema().to_arrow())
        fields = []
        for field in data.schema:
            if field.name not in existing.names:
                raise TransformError(
                    f"pipeline {self.spec.name}: column {field.name!r} is not in the state table "
                    f"{self.path}; changing the state's columns needs a new state path and a new "
                    "checkpoint (the pipeline then reprocesses its source from the start)",
                    pipeline=self.spec.name,
                    path=self.path,
                )
            fields.append(existing.field(field.name).with_nullable(True))
        try:
            return data.cast(pa.schema(fields))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise TransformError(
                f"pipeline {self.spec.name}: this batch's columns do not fit the state table's "
                f"types ({exc}); cast them in the transform to the types in {self.path}",
                pipeline=self.spec.name,
                path=self.path,
            ) from exc

    def restore(self, table: DeltaTable, version: int | None, metadata: CommitMetadata) -> int:
        """Put the state back as of `version` (None: empty), fenced at the
        rewind's position. Commits from `table`'s snapshot, which the caller
        has checked.
        """
        props = _fenced(metadata)
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
    def _fenced_empty_commit(table: DeltaTable, props: CommitProperties) -> int:
        empty = pa.schema(table.schema().to_arrow()).empty_table()
        write_deltalake(table, empty, mode="append", commit_properties=props)
        return table.version()

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
                data = json.loads(raw) if raw else {}
                if data.get("txn") == position.encode():
                    version = int(info["version"])
                    return StateCommit(
                        version=version,
                        metadata=CommitMetadata.from_dict(data, where=f"{self.path} version {version}"),
                        operation_metrics={
                            k: int(v) for k, v in (info.get("operationMetrics") or {}).items() if str(v).isdigit()
                        },
                        timestamp=datetime.fromtimestamp(info["timestamp"] / 1000, tz=timezone.utc),
                    )
            if table.version() < limit:  # the whole history has been searched
                break
        return None


def _fenced(metadata: CommitMetadata) -> CommitProperties:
    """Commit properties that move the state fence to the commit's position and carry its metadata."""
    return commit_properties(STATE_FENCE, metadata.position, {METADATA_KEY: metadata.to_json()})
