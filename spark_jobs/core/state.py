"""The keyed state table: one delta-rs MERGE per batch, or one append
(`state.layout: appended`, `spark_jobs.core.folding`).

The merge is built only from identifiers the spec validated
(`spark_jobs.core.spec.IDENTIFIER`), double-quoted for DataFusion, so nothing from
the spec reaches SQL as free text. Merge rules, per value column:

* ``sum``   existing + batch (a null on either side counts as absent)
* ``min`` / ``max``   the smaller / larger, ignoring nulls
* ``first`` keep the existing value (the batch's if the existing one is null)
* ``last``  take the batch's value

Every row also records `_batch_id`, the last batch that touched it.

Before a batch is merged, `StateTable.align` fits it to the state: a merge
column new to the spec is added to the state (old rows hold null), a column
the transform now returns in a wider type is widened in the state (the way
forward for a sum that outgrows its column, `spark_jobs.core.widen`), and a
merge that would overflow a column is refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TypeVar

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Field, QueryBuilder, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError

from spark_jobs.core import merge_on_read
from spark_jobs.core.commits import METADATA_KEY, CommitMetadata, StateCommit
from spark_jobs.core.deletion_vectors import active_files, carries_vectors, has_deletion_vectors, table_root
from spark_jobs.core.compute import FileWriting, check_result_types, check_unique_keys
from spark_jobs.core.delta_io import commit_infos, ensure_table, is_commit_conflict, open_table
from spark_jobs.core.own_commits import commit_rewrite, logged, set_properties
from spark_jobs.core.fencing import ORIGIN, STATE_FENCE, Position, commit_properties, transaction_position
from spark_jobs.core.folding import FOLD_KEY, carried, fold_files, is_appended, row_counts, state_sql
from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec
from spark_jobs.core.staged import (
    CAST_FAILED, CHANGE_DATA, IN_PROCESS_ROWS, REWRITE_FROM_BYTES, Staged, StagedValues, commit_files, delete_files, files_bytes,
    read_staged, require_written, touched_files,
)
from spark_jobs.core.sql_text import datafusion_identifier as _q
from spark_jobs.core.untracked import MARKER_KEY as UNTRACKED_MARKER
from spark_jobs.core.widen import check_merge, sql_type, widens
from spark_jobs.core.windows import EXPIRE_KEY
from spark_jobs.core.write_path import merged_by_join
from spark_jobs.errors import ConcurrentRunError, MicrobatchError, TransformError

__all__ = ["BATCH_COLUMN", "CHANGE_FEED", "MAINTENANCE_OPERATIONS", "WIDEN_KEY", "StateTable", "merge_expression"]

_E = TypeVar("_E", bound=MicrobatchError)

log = logging.getLogger("microbatch")

#: Key of the commit info entry that marks a state rewrite widening columns
#: (`StateTable.align`): the job's own commit, which keeps every value.
WIDEN_KEY = "microbatch.widen"
#: How far back in the state's history to look for a commit we need to find.
HISTORY_SEARCH = 1000
#: Delta operations (as Delta and delta-rs name them in commit info) that
#: leave a table's rows as they were. Any other commit not made by this job
#: (RESTORE, DELETE, UPDATE, MERGE, WRITE, FSCK, REPLACE, ...) is taken as a
#: change of the state behind the ledger's back: failing closed on an
#: operation missing here costs a `microbatch rewind`, while missing a
#: data-changing one would cost exactness. RENAME COLUMN and DROP COLUMNS
#: are not here: every column of a state is a key, a merge column or the
#: job's own, and the next batch would re-add a renamed one as null.
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
        "UPDATE FIELD METADATA",
        "UPDATE TABLE METADATA",
        "UPGRADE PROTOCOL",
        "ADD FEATURE",
        "COMPUTE STATS",
    }
)


def merge_expression(column: str, rule: str, *, quote: Callable[[str], str] = _q) -> str:
    """SQL for the value a MERGE stores: the state's (`t`) and the batch's (`s`)
    by `rule`; `quote` is the engine's identifier quoting."""
    t, s = f"t.{quote(column)}", f"s.{quote(column)}"
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


#: What an appended state's table description says, for a user reading the
#: table directly (Spark, Databricks SQL, DuckDB): its rows are partial.
APPENDED_NOTE = (
    "[microbatch: appended layout: several rows per key until a fold; read the state through "
    "`microbatch query SPEC`, or the SQL `microbatch query SPEC --sql spark` prints]"
)

#: The Delta table property that makes every commit write its row changes.
CHANGE_FEED = "delta.enableChangeDataFeed"


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

    def create(self, columns: pa.Table | pa.Schema) -> DeltaTable:
        """Create the (empty) state table with the columns of a batch's updates."""
        schema = pa.schema([*(columns if isinstance(columns, pa.Schema) else columns.schema), pa.field(BATCH_COLUMN, pa.int64())])
        return ensure_table(
            self.path,
            schema,
            name=self.spec.name,
            description=self._description(),
            configuration={CHANGE_FEED: "true"} if self.spec.state.change_feed else None,
        )

    def _description(self) -> str | None:
        """The table's description: the spec's, and for an appended state how
        to read it (its rows are partial: `APPENDED_NOTE`)."""
        parts = [self.spec.description or "", APPENDED_NOTE if is_appended(self.spec) else ""]
        return " ".join(p for p in parts if p) or None

    def commit_batch(
        self, table: DeltaTable, updates: pa.Table | Staged, metadata: CommitMetadata, files: FileWriting | None = None
    ) -> tuple[int, int]:
        """Merge one batch's updates (as `align` returned them, or as files the
        executors wrote: `files` is their engine); returns (new table
        version, keys updated). The commit moves the state fence to the
        batch's position and carries `metadata`; with `deletion_vectors`, it
        is merged on read (`merge_on_read`). Raises delta-rs's commit error if
        another commit carrying the state fence landed after `table`'s
        snapshot (the caller decides what it means)."""
        if isinstance(updates, Staged):
            return self._commit_staged(table, updates, metadata, files)
        position = metadata.position
        data = updates.append_column(BATCH_COLUMN, pa.array([position.batch_id] * updates.num_rows, pa.int64()))
        if data.num_rows and merge_on_read.merges(self.spec.state, table):
            done = merge_on_read.commit(table, self.spec, data, metadata)
            if done is not None:
                return done
        if files is not None and data.num_rows and self._rewritten_by_executors(table):
            # A small batch, a big state: the executors rewrite the files it touches.
            staged = Staged(files.stage(self.path, data, data.schema), data.schema, self.path)
            return self._commit_staged(table, staged, metadata, files)
        if is_appended(self.spec):
            # The batch's rows as they are, one per key: O(batch), whatever the state's size.
            props = _fenced(metadata, carried(row_counts(table)))
            write_deltalake(table, data, mode="append", commit_properties=props)
            return table.version(), data.num_rows
        props = _fenced(metadata)
        if data.num_rows == 0:
            # A MERGE with an empty source makes no commit in delta-rs, which
            # would leave the fence behind and the batch replayed forever
            # (e.g. a batch whose records were all quarantined). Commit the
            # fence with an empty append instead.
            return self._fenced_empty_commit(table, props), 0
        return self._merged_by_delta_rs(table, data, props)

    def _merged_by_delta_rs(self, table: DeltaTable, data: pa.Table, props: CommitProperties) -> tuple[int, int]:
        """`commit_batch` by delta-rs's MERGE, copy-on-write: the files holding the batch's keys are rewritten."""
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
                # Not streamed: the batch's updates are a small in-memory
                # table, and only an unstreamed source gives delta-rs the
                # key range it prunes the state's files with; streamed, every
                # MERGE scanned the whole state (docs/benchmarks.md, "Figures
                # behind the code's choices"). Unless a key's statistics
                # cannot bound it (`_bounded_by_statistics`).
                streamed_exec=not _bounded_by_statistics(data.schema, keys),
            )
            .when_matched_update(updates=updates_expr)
            .when_not_matched_insert(updates=inserts)
            .execute()
        )
        keys_updated = int(metrics["num_target_rows_inserted"]) + int(metrics["num_target_rows_updated"])
        # delta-rs moves the handle to the version it committed. (Not
        # `update_incremental()`: that could skip ahead to a later writer's.)
        return table.version(), keys_updated

    def _commit_staged(self, table: DeltaTable, staged: Staged, metadata: CommitMetadata, files: FileWriting | None) -> tuple[int, int]:
        """`commit_batch` of the files the executors wrote (into the state's folder).

        An appended state commits them as they are; so does a merged one
        whose files hold none of the batch's keys (its first batch, say).
        Otherwise the state's files its keys may be in are merged with it,
        here or by the executors as its size says (`_merge_staged`). The
        batch's own files are then dropped: merged in, they are no data of
        the state."""
        position = metadata.position
        if not staged.files:
            extra = carried(row_counts(table)) if is_appended(self.spec) else None
            return self._fenced_empty_commit(table, _fenced(metadata, extra)), 0
        extra = carried(row_counts(table)) if is_appended(self.spec) else None
        # Committed, or read by the merge: they must still be there (`require_written`).
        what = f"pipeline {self.spec.name}: the state commit of {position}"
        require_written(self.path, staged.files, self.spec.maintenance.untracked_files_hours, what)
        rewritten = [] if is_appended(self.spec) else touched_files(table, self.spec.state.keys, staged)
        if not rewritten:
            # Every row of the batch is new to the state: its files are the merge's result.
            commit_files(table, staged.files, table.schema(), _fenced(metadata, extra))
            return self._version_of(position), staged.rows
        try:
            done = self._merge_staged(table, staged, metadata, files, rewritten)
        except Exception as exc:
            if not is_commit_conflict(exc):
                delete_files(staged.root, staged.files)
            # (After a conflict step 4 may merge them again, from a fresh
            # snapshot; if it does not, `maintain` removes them.)
            raise
        delete_files(staged.root, staged.files)
        return done

    def _merge_staged(
        self, table: DeltaTable, staged: Staged, metadata: CommitMetadata, files: FileWriting | None, rewritten: list[str]
    ) -> tuple[int, int]:
        """A merged state's batch of files merged in, the way its size says:
        a small one (`IN_PROCESS_ROWS`) here by delta-rs's MERGE while the
        files it rewrites weigh at most `REWRITE_FROM_BYTES` (with
        `state_write: auto`), else by the executors, file by file
        (`FileWriting.rewrite_files`); a bigger one by the executors' join
        (`FileWriting.merge_files`). The executors' files are committed as
        the rewritten files' removal and the new files' addition, from
        `table`'s snapshot. A state with a change feed, or whose files carry
        deletion vectors, is merged by the executors' join committed by the
        job (`_merge_by_join`); a small batch into a state merged on read
        here, whatever `state_write` says (`merge_on_read`: its cost follows
        the batch)."""
        small = staged.rows <= IN_PROCESS_ROWS
        here = small and self.spec.engine.state_write != "executors" and files_bytes(table, rewritten) <= REWRITE_FROM_BYTES
        vectors, on_read = carries_vectors(table), merge_on_read.merges(self.spec.state, table)
        here = here or (small and (vectors or on_read))
        if files is not None and not here and (vectors or on_read or merged_by_join(self.spec)):
            return self._merge_by_join(table, staged, metadata, files, rewritten, vectors)
        if files is None or here or self.spec.state.change_feed:  # (a change feed's files only by delta-rs or the join)
            return self.commit_batch(table, read_staged(staged).drop_columns([BATCH_COLUMN]), metadata)
        schema = pa.schema(table.schema().to_arrow())
        merge = files.rewrite_files if small else files.merge_files
        merged = merge(self.spec, self.path, schema, rewritten, staged)
        # Not deleted if the commit fails: a store may report a failure for
        # a commit that landed (`protocol._after_conflict`); `maintain`
        # removes them once no commit names them.
        # (The rewritten files need no `require_written`: written after the
        # snapshot this commits from was read, none of them was among the
        # files a `maintain` marked before it chose what to delete.)
        commit_files(table, merged, table.schema(), _fenced(metadata), removed=rewritten)
        return self._version_of(metadata.position), staged.rows

    def _merge_by_join(
        self, table: DeltaTable, staged: Staged, metadata: CommitMetadata, files: FileWriting, rewritten: list[str], vectors: bool
    ) -> tuple[int, int]:
        """A batch merged by the executors' join (`FileWriting.merge_files`),
        whose tasks write the change data with the merged rows when the
        state has a change feed, and read the rewritten files without the
        rows their deletion vectors delete (`vectors`: some carry one);
        committed by the job on `table`'s snapshot
        (`own_commits.commit_rewrite`: delta-rs can commit neither change
        files written by others nor the removal of a file with a vector).
        After a lost race the files are deleted at once (else `maintain`
        removes them after its window), unless the version that exists is
        this commit's own (a put the store applied but answered with an error)."""
        schema = pa.schema(table.schema().to_arrow())
        # The snapshot's files as its log names them, read once: their vectors for the join, their removal for the commit.
        active = active_files(table_root(table), table.version()) if vectors else None
        deleted = {path: vector for path in rewritten if (vector := logged(active, path).get("deletionVector"))} if active else None
        written = files.merge_files(self.spec, self.path, schema, rewritten, staged, changes=self.spec.state.change_feed, vectors=deleted)
        changes = tuple(f for f in written if f.path.startswith(f"{CHANGE_DATA}/"))
        data = tuple(f for f in written if f not in changes)
        try:
            return commit_rewrite(table, data, rewritten, changes, metadata, active), staged.rows
        except CommitFailedError:
            landed = self.find_commit(self.open(), metadata.position)
            if landed is None or landed.metadata.commit_token != metadata.commit_token:
                delete_files(self.path, written)
            raise

    def _rewritten_by_executors(self, table: DeltaTable) -> bool:
        """Whether a small batch held here goes to the executors to merge:
        a merged state under `state_write: auto` whose files weigh more than
        `REWRITE_FROM_BYTES` (the files it touches are found once its rows
        are files: `_merge_staged`), rewritten file by file, or with a
        change feed by the join that writes the change data too."""
        if is_appended(self.spec) or self.spec.engine.state_write != "auto":
            return False
        if carries_vectors(table):
            return False  # the executors read the files as they are, deleted rows and all
        return files_bytes(table) > REWRITE_FROM_BYTES

    def _version_of(self, position: Position) -> int:
        """The version of the commit just made at `position` (delta-rs does not
        move the handle a file commit is made from)."""
        found = self.find_commit(self.open(), position)
        return found.version if found is not None else -1

    def fitted(self, table: DeltaTable, columns: pa.Schema) -> pa.Schema:
        """The schema `make_room` would return, changing nothing."""
        schema, _, _ = self._fitted(pa.schema(table.schema().to_arrow()), columns)
        return pa.schema([*schema, pa.field(BATCH_COLUMN, pa.int64())])

    def make_room(self, table: DeltaTable, columns: pa.Schema) -> pa.Schema:
        """`align` for a batch the executors will write: the state makes room
        for its `columns` (type checks, merge columns added or widened) before
        a row is written, and the schema its files are written in comes
        back: the state's types, `_batch_id` last. The overflow check comes
        once the files are written (`check_staged`)."""
        check_result_types(self.spec, columns)
        existing = pa.schema(table.schema().to_arrow())
        schema, added, widened = self._fitted(existing, columns)
        self._make_changes(table, existing, added, widened)
        return pa.schema([*schema, pa.field(BATCH_COLUMN, pa.int64())])

    def check_staged(self, table: DeltaTable, staged: Staged) -> None:
        """The overflow check of a batch the executors wrote: from what the
        writing tasks saw, reading rows only for keys near a column's limit."""
        self._check_overflow(table, pa.schema(table.schema().to_arrow()), StagedValues(staged))

    def _check_overflow(self, table: DeltaTable, existing: pa.Schema, values: pa.Table | StagedValues) -> None:
        if is_appended(self.spec):
            check_merge(self.spec, table, values, folded_sql=state_sql(self.spec.state, existing),
                        fold_files=fold_files(table, row_counts(table)))
        else:
            check_merge(self.spec, table, values)

    def align(self, table: DeltaTable, data: pa.Table) -> pa.Table:
        """A batch's updates cast to the state table's column types, once the
        state has made room for them; or an error saying why they cannot be
        merged into it.

        * Each column's type must be one the state holds and its rule merges
          (`check_result_types`), else a `TransformError`.
        * A merge column of the spec that the state lacks is added to it
          (nullable: old rows hold null). Any other unknown column is a
          `TransformError`.
        * A merge column the batch holds in a wider type (`widens`) is
          widened in the state, every value kept: the documented way forward
          for a sum that outgrows its column. A batch that does not cast to
          the state's types otherwise (narrowing) is a `TransformError`.
        * A merge that would overflow a column is a `MergeOverflowError`.

        Every refusal comes before the state is changed. `table` moves to
        the version of the last change made; the merge may as well use a
        freshly opened table.
        """
        check_result_types(self.spec, data.schema)
        existing = pa.schema(table.schema().to_arrow())
        schema, added, widened = self._fitted(existing, data.schema)
        try:
            aligned = data.cast(schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise self._error(
                TransformError,
                f"this batch's columns do not fit the state table's types ({self._unfit(data, schema, exc)}); "
                f"cast them in the transform to the types in {self.path}",
            ) from exc
        if any(data.schema.field(k).type != aligned.schema.field(k).type for k in self.spec.state.keys):
            # Two keys the transform returned may be one in the state's
            # type (0.1 and 0.10000000001 as DOUBLE, one FLOAT): the keys
            # are checked again as they will be stored.
            check_unique_keys(self.spec, aligned.select(list(self.spec.state.keys)))
        # Against the state as it is: adding or widening a column keeps its values.
        self._check_overflow(table, existing, aligned)
        self._make_changes(table, existing, added, widened)
        return aligned

    @staticmethod
    def _unfit(data: pa.Table, schema: pa.Schema, exc: Exception) -> str:
        """Which column failed the cast, worded as the executors' writing
        tasks word it (Arrow's own message does not name the column)."""
        for field in schema:
            try:
                data.column(field.name).cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as failed:
                return f"{CAST_FAILED} {field.name!r} as {field.type}: {failed}"
        return str(exc)

    def _make_changes(self, table: DeltaTable, existing: pa.Schema, added: list[Field], widened: dict[str, pa.DataType]) -> None:
        """The state's changes a batch needs: merge columns added or widened,
        the change data feed turned on; each keeps every value."""
        if added:
            with self._changing_columns(f"adding column(s) {', '.join(f.name for f in added)}"):
                table.alter.add_columns(added)
        if widened:
            with self._changing_columns(f"widening column(s) {', '.join(widened)}"):
                self._widen(table, existing, widened)
        if is_appended(self.spec) and APPENDED_NOTE not in (table.metadata().description or ""):
            # A merged state turned appended: whoever reads the table learns how to read it.
            with self._changing_columns("marking its layout in its description"):
                table.alter.set_table_description(self._description() or "")
        if merge_on_read.due(self.spec.state, table):
            # Turned on in the spec, or the state grew past `auto`'s bound: the
            # table declares the feature (readers must know it) before a batch adds one.
            with self._changing_columns("turning deletion vectors on"):
                merge_on_read.enable(table)
        if self.spec.state.change_feed and table.metadata().configuration.get(CHANGE_FEED) != "true":
            # Turned on in the spec of an existing state: the feed starts with this batch.
            with self._changing_columns("turning its change data feed on"):
                if table.protocol().min_writer_version < 7:
                    table.alter.set_table_properties({CHANGE_FEED: "true"})
                else:  # (delta-rs's alter would add `variantType` to a protocol of table features: `own_commits.set_properties`)
                    set_properties(table, {CHANGE_FEED: "true"}, writer_features=("changeDataFeed",))

    def _fitted(self, existing: pa.Schema, batch: pa.Schema) -> tuple[pa.Schema, list[Field], dict[str, pa.DataType]]:
        """The schema a batch is cast to, the merge columns to add to the
        state first, and those to widen in it (name to new type)."""
        fields, added, widened = [], [], {}
        for field in batch:
            merged = field.name in self.spec.state.merge
            if field.name not in existing.names:
                if not merged:
                    raise self._error(
                        TransformError,
                        f"column {field.name!r} is not in the state table {self.path}; changing the "
                        "state's columns needs a new state path and a new checkpoint (the pipeline "
                        "then reprocesses its source from the start)",
                    )
                # Cast to the type the state will hold (a large string becomes a string).
                added.append(Field.from_arrow(field.with_nullable(True)))
                fields.append(pa.field(added[-1].to_arrow()))
            elif merged and widens(existing.field(field.name).type, field.type):
                widened[field.name] = field.type
                fields.append(field.with_nullable(True))
            else:
                fields.append(existing.field(field.name).with_nullable(True))
        return pa.schema(fields), added, widened

    def _widen(self, table: DeltaTable, existing: pa.Schema, widened: dict[str, pa.DataType]) -> None:
        """Rewrite the state with `widened` columns in their new types, in one commit.

        delta-rs 1.6 cannot change a column's type in place (`alter` has no
        type change, and a MERGE with schema evolution casts back to the old
        type and fails), so the table is overwritten with its own rows, cast.
        The commit:

        * lands on the version it read or not at all (no commit retries):
          delta-rs lets an overwrite from an older snapshot land over an
          OPTIMIZE, which would keep both copies of every compacted row;
        * carries the state fence at the position it read: it moves no
          fence, yet any state commit racing it (a batch, a rewind, another
          widening) makes one of the two fail;
        * is marked with `WIDEN_KEY`, so `outside_changes` knows it for ours.
        """
        # delta-rs's change feed reads the removal of a file with a deletion
        # vector as the rows the vector deletes, not the live ones: a downstream
        # would net the overwrite wrongly. Rewritten without them first.
        purged = merge_on_read.purge(table)
        if purged is not None:
            table.load_as_version(purged[0])
        schema = pa.schema([f.with_type(widened.get(f.name, f.type)) for f in existing])
        # Streamed: the overwrite only retires the files the scan reads.
        rows = pa.RecordBatchReader.from_stream(QueryBuilder().register("state", table).execute("SELECT * FROM state"))
        cast = pa.RecordBatchReader.from_batches(schema, (batch.cast(schema) for batch in rows))
        change = {name: [sql_type(existing.field(name).type), sql_type(t)] for name, t in widened.items()}
        props = CommitProperties(
            custom_metadata={WIDEN_KEY: json.dumps({"pipeline": self.spec.name, "columns": change})},
            app_transactions=[Transaction(STATE_FENCE, self.position(table).encode())],
            max_commit_retries=0,
        )
        write_deltalake(table, cast, mode="overwrite", schema_mode="overwrite", commit_properties=props)

    @contextmanager
    def _changing_columns(self, what: str) -> Iterator[None]:
        """Another commit won the race against our change of the state's
        columns: nothing of the batch was committed, and the next run sees
        the state as the winner left it."""
        try:
            yield
        except Exception as exc:
            if not is_commit_conflict(exc):
                raise
            raise self._error(
                ConcurrentRunError,
                f"the state table {self.path} changed while this run was {what} to fit its batch; "
                "nothing was committed, run again",
            ) from exc

    def _error(self, kind: type[_E], message: str) -> _E:
        """An error about this state table: the message, the pipeline and the table."""
        return kind(f"pipeline {self.spec.name}: {message}", pipeline=self.spec.name, path=self.path)

    def restore(self, table: DeltaTable, version: int | None, metadata: CommitMetadata) -> int:
        """Put the state back as of `version` (None: empty), fenced at the
        rewind's position. Commits from `table`'s snapshot, which the caller
        has checked.
        """
        props = _fenced(metadata)
        before = table.version()
        if self.spec.state.change_feed and version != before and has_deletion_vectors(table):
            # Over deletion vectors, with the change file a downstream reads it by.
            restored = merge_on_read.restore(table, version, metadata)
            if restored is not None:
                return restored
        if version is None:
            table.delete(commit_properties=props)
        elif version != before:
            # (delta-rs refuses to restore the version a table is at: a rewind
            # out of a stuck batch to the batch the state holds restores nothing.)
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
        properties, ...) keeps the data and is fine, and so do our own
        rewrites widening a column (`WIDEN_KEY`) or folding an appended
        state (`FOLD_KEY`), and `maintain`'s marker before it removes
        untracked files (`untracked.MARKER_KEY`); anything else by someone
        else is reported. Costs nothing in the usual case, where our last
        commit is the table's latest version.
        """
        latest = table.version()
        last = latest if before_version is None else min(latest, before_version - 1)
        if last <= since_version:
            return []  # no version in between: no history to read
        changes = []
        for info in commit_infos(table.table_uri, last, max(since_version + 1, latest - HISTORY_SEARCH + 1)):
            if info.get(METADATA_KEY) or info.get(WIDEN_KEY) or info.get(FOLD_KEY) or info.get(UNTRACKED_MARKER) or info.get(EXPIRE_KEY):
                continue
            operation = str(info.get("operation", "")).upper()
            if operation not in MAINTENANCE_OPERATIONS:
                changes.append((info["version"], operation))
        return sorted(changes)

    def find_commit(self, table: DeltaTable, position: Position) -> StateCommit | None:
        """The commit of ours that carried the state fence at `position`.

        Searched newest first from the handle's version, reading each log
        entry by its number (`commit_info`): it is almost always the latest
        commit (step 5 looks right after making it), and reading the whole
        history each batch would grow with the table's age.
        """
        latest = table.version()
        for info in commit_infos(table.table_uri, latest, latest - HISTORY_SEARCH + 1):
            raw = info.get(METADATA_KEY)
            data = json.loads(raw) if raw else {}
            if data.get("txn") == position.encode():
                version = info["version"]
                return StateCommit(
                    version=version,
                    metadata=CommitMetadata.from_dict(data, where=f"{self.path} version {version}"),
                    operation_metrics={
                        k: int(v) for k, v in (info.get("operationMetrics") or {}).items() if str(v).isdigit()
                    },
                    timestamp=datetime.fromtimestamp(info["timestamp"] / 1000, tz=timezone.utc),
                )
        return None


#: The most digits a float carries exactly (a DOUBLE round-trips 15 significant digits).
FLOAT_DIGITS = 15


def _bounded_by_statistics(schema: pa.Schema, keys: tuple[str, ...] | list[str]) -> bool:
    """Whether the state's files' statistics bound every key column exactly
    enough for delta-rs to prune files by a batch's key range. A DECIMAL's
    statistics are written through a float: past 15 digits they are
    rounded, either way, and delta-rs's MERGE then skipped the file holding
    a key the batch brings back (found by issue 62's type matrix: a
    DECIMAL(38,0) key stored twice). Such a MERGE reads every file."""
    return not any(
        pa.types.is_decimal(schema.field(key).type) and schema.field(key).type.precision > FLOAT_DIGITS for key in keys
    )


def _fenced(metadata: CommitMetadata, extra: dict[str, str] | None = None) -> CommitProperties:
    """Commit properties that move the state fence to the commit's position and carry its metadata."""
    return commit_properties(STATE_FENCE, metadata.position, {METADATA_KEY: metadata.to_json(), **(extra or {})})
