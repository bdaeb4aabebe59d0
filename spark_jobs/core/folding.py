"""The appended state layout (`state.layout: appended`): append, fold, read by one query.

With `layout: merged` each batch MERGEs into one row per key. When keys come
back uniformly, every batch touches every file of the state, and a
copy-on-write MERGE rewrites all of it: the batch's cost grows with the
state (docs/state-at-scale.md). With `layout: appended`:

1. **A batch appends** its rows (the transform's output, one row per key,
   tagged with `_batch_id`) in one commit carrying the state fence and the
   commit metadata, exactly where the MERGE did: the commit point and the
   protocol do not change, and the write is O(batch).
2. **Reading the state** as of its last batch is one query (`state_sql`):
   each merge rule as an aggregate over a key's rows, which is what the
   MERGEs would have computed one batch at a time (every rule is
   associative): ``sum`` the sum, ``min``/``max`` themselves, ``first`` the
   earliest batch's non-null value, ``last`` the latest batch's value (null
   included). Sums are cast back to the column's type. `microbatch query
   SPEC` prints it for delta-rs and Spark, and runs it.
3. **A fold** rewrites the state as that query's result, one row per key, in
   one commit that changes no value (`fold`). It runs after a batch's commit
   once the rows appended since the last fold pass `state.fold_at` of the
   rows that fold left (or of `FOLD_FLOOR_ROWS`, if more), and in `maintain`.
   Its commit carries the state fence at the position it read and no
   retries: a batch or a rewind landing first makes the fold fail (and it
   is simply tried again later), a fold landing first makes the racing batch
   fail retryably. It is marked `FOLD_KEY`, so the state's history knows it
   for the job's own.

So a batch costs the same at 100,000 keys and at 100,000,000; a fold costs
what one MERGE of the whole state costs today, once per `1 / fold_at`
states' worth of appended rows; readers pay for grouping the partial rows.
Rewind is unchanged (a RESTORE to the batch's state version: appends and
folds are versions like any other), and so are VACUUM and the retention
rules. What an appended state does not offer is a change data feed a
downstream pipeline reads: its versions hold partial rows, not each key's
new value (the spec refuses `change_feed: true`, and a Delta source refuses
such a state as its upstream).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake

from spark_jobs.core.delta_io import commit_infos, is_commit_conflict, open_table, version_actions
from spark_jobs.core.fencing import STATE_FENCE, transaction_position
from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec, StateSpec
from spark_jobs.core.sql_text import datafusion_identifier, spark_identifier
from spark_jobs.core.staged import commit_files
from spark_jobs.core.widen import sql_type

if TYPE_CHECKING:
    from spark_jobs.core.compute import FileWriting

__all__ = [
    "FOLD_FLOOR_ROWS",
    "FOLDED_ROWS_KEY",
    "FOLD_KEY",
    "Folded",
    "RowCounts",
    "carried",
    "fold",
    "fold_files",
    "fold_if_due",
    "is_appended",
    "read_state",
    "row_counts",
    "spark_sql",
    "state_sql",
]

log = logging.getLogger("microbatch")

#: Key of the commit info entry that marks a fold: the job's own rewrite,
#: which keeps every value and the fence.
FOLD_KEY = "microbatch.fold"
#: `fold_at` is a fraction of at least this many rows: a small state is not
#: folded every few batches, where a fold would cost more than the reads it saves.
FOLD_FLOOR_ROWS = 100_000
#: Key of the commit info entry of an appended batch: the last fold's version
#: and the rows it left (JSON), carried forward from commit to commit, so that
#: `row_counts` finds them in the newest commit instead of reading the history
#: back to the fold.
FOLDED_ROWS_KEY = "microbatch.last_fold"
#: How far back the state's history is searched for the last fold.
HISTORY_SEARCH = 1000

Quote = Callable[[str], str]


def state_sql(state: StateSpec, schema: pa.Schema, table: str = "state", *, quote: Quote = datafusion_identifier) -> str:
    """SQL for the state as of its last batch, one row per key, in `schema`'s
    column order and types, over `table` (a name or a table expression).

    A merged state is its table as it is. An appended state's rows of a key
    (the last fold's one, then one per batch) are merged as the MERGEs would
    have merged them one batch at a time. Where the order of the rows cannot
    change the value (`sum` of integers and decimals, `min`, `max`) that is
    a plain GROUP BY. Where it can (`first`, `last`, a `sum` of DOUBLE:
    floating-point addition is not associative), the rows are taken in batch
    order (`_ordered_sql`), so the value is the one the merged layout gives,
    whenever folds ran. `quote` is the engine's identifier quoting
    (`datafusion_identifier` for delta-rs, `spark_identifier` for Spark).
    """
    names = [f.name for f in schema]
    if state.layout == "merged":
        return f"SELECT {', '.join(quote(n) for n in names)} FROM {table}"
    for field in schema:
        if field.name not in state.keys and field.name != BATCH_COLUMN and field.name not in state.merge:
            raise ValueError(f"column {field.name!r} of the state has no merge rule in the spec")
    if any(_in_batch_order(state.merge.get(f.name), f.type) for f in schema):
        return _ordered_sql(state, schema, table, quote)
    partition = ", ".join(quote(k) for k in state.keys)
    columns = []
    for field in schema:
        name, rule = quote(field.name), state.merge.get(field.name)
        if field.name in state.keys:
            columns.append(name)
        elif field.name == BATCH_COLUMN:
            columns.append(f"MAX({name}) AS {name}")
        elif rule == "sum":
            # Engines sum into a wider type (an INT sum is a BIGINT); the fold
            # keeps the column's type, which the overflow check guarantees holds it.
            columns.append(f"CAST(SUM({name}) AS {sql_type(field.type)}) AS {name}")
        else:
            columns.append(f"{str(rule).upper()}({name}) AS {name}")
    return f"SELECT {', '.join(columns)} FROM {table} GROUP BY {partition}"


def _in_batch_order(rule: str | None, column_type: pa.DataType) -> bool:
    """Whether a merge column's value depends on the order its rows are merged in."""
    return rule in ("first", "last") or (rule == "sum" and pa.types.is_floating(column_type))


def _ordered_sql(state: StateSpec, schema: pa.Schema, table: str, quote: Quote) -> str:
    """`state_sql` with each key's rows taken in batch order.

    A key with one row (most keys of a state folded not long ago) is that
    row. The rows of a key with more are merged by window functions over the
    key's rows sorted by `_batch_id`, read at its last row:

    * ``sum``: the running sum (a frame from the key's first row to the
      current one, which both engines add one row at a time, in order), so
      the rows are added exactly as the MERGEs added them; a fold stores the
      running sum at its batch, and the rows after it continue from there
      (a whole-partition frame would add in the engine's order instead);
    * ``min`` / ``max``: the running min and max;
    * ``first``: the first non-null value of the frame (``IGNORE NULLS``);
    * ``last``: the last row's own value, null included: no aggregate, so
      any type a Delta table holds (a MAP, an ARRAY, a STRUCT) is merged.

    A key's last row is the one with no next row (``LEAD``), in the same sort.
    Window functions cost DataFusion about ten times a GROUP BY per row, so
    only the rows of keys with several go through them: at a tenth of the
    keys come back since the last fold, the query takes about six times the
    GROUP BY's time instead of about thirty (docs/benchmarks.md).
    """
    batch = quote(BATCH_COLUMN)
    keys = [quote(k) for k in state.keys]
    partition = ", ".join(keys)
    window = f"(PARTITION BY {partition} ORDER BY {batch} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)"
    following = quote("__microbatch_next")
    inner, outer = [], []
    for field in schema:
        name, rule = quote(field.name), state.merge.get(field.name)
        if rule in ("sum", "min", "max"):
            inner.append(f"{rule.upper()}({name}) OVER {window} AS {name}")
        elif rule == "first":
            inner.append(f"FIRST_VALUE({name}) IGNORE NULLS OVER {window} AS {name}")
        else:  # a key, `_batch_id` (its last row's is the largest), or `last`
            inner.append(name)
        # Engines sum into a wider type: cast back to the column's own.
        outer.append(f"CAST({name} AS {sql_type(field.type)}) AS {name}" if rule == "sum" else name)
    inner.append(f"LEAD({batch}) OVER (PARTITION BY {partition} ORDER BY {batch}) AS {following}")
    several = f"(SELECT {partition} FROM {table} GROUP BY {partition} HAVING COUNT(*) > 1) AS several"
    rows, on = quote("__microbatch_rows"), " AND ".join(f"{quote('__microbatch_rows')}.{k} = several.{k}" for k in keys)
    alone = f"SELECT {', '.join(outer)} FROM {table} AS {rows} LEFT ANTI JOIN {several} ON {on}"
    merged = f"SELECT {', '.join(inner)} FROM {table} AS {rows} LEFT SEMI JOIN {several} ON {on}"
    return f"{alone} UNION ALL SELECT {', '.join(outer)} FROM ({merged}) AS merged WHERE {following} IS NULL"


def spark_sql(spec: PipelineSpec, schema: pa.Schema, version: int | None = None) -> str:
    """`state_sql` for Spark with delta-spark, over the state's path (as of `version`)."""
    path = spec.state_path.replace("`", "``")
    as_of = f" VERSION AS OF {int(version)}" if version is not None else ""
    return state_sql(spec.state, schema, f"delta.`{path}`{as_of}", quote=spark_identifier)


def is_appended(spec: PipelineSpec) -> bool:
    return spec.state.layout == "appended"


def read_state(spec: PipelineSpec, table: DeltaTable | None = None) -> pa.RecordBatchReader:
    """The state as of its last batch, one row per key, streamed through delta-rs."""
    table = table if table is not None else open_table(spec.state_path)
    if table is None:
        raise FileNotFoundError(f"pipeline {spec.name}: no state table at {spec.state_path} yet (no batch committed)")
    schema = pa.schema(table.schema().to_arrow())
    rows = pa.RecordBatchReader.from_stream(QueryBuilder().register("state", table).execute(state_sql(spec.state, schema)))
    # DataFusion may hand strings back as views: the state's own types.
    return pa.RecordBatchReader.from_batches(schema, (batch.cast(schema) for batch in rows))


@dataclass(frozen=True)
class RowCounts:
    """An appended state's rows: all of them, and how many the last fold left."""

    rows: int
    #: Rows written by the last fold (0: never folded within `HISTORY_SEARCH` commits).
    folded: int
    #: The last fold's version (None: not found).
    fold_version: int | None = None

    @property
    def appended(self) -> int:
        """Rows appended since the last fold (an estimate after a RESTORE past a fold)."""
        return max(self.rows - self.folded, 0)

    def fold_due(self, fold_at: float) -> bool:
        return self.appended >= fold_at * max(FOLD_FLOOR_ROWS, self.folded)


def row_counts(table: DeltaTable) -> RowCounts:
    """The state's rows from its log (no data read), and the last fold's rows:
    from the newest commit that knows them (a batch's `FOLDED_ROWS_KEY`, or
    the fold's own commit), found newest first; usually the newest commit."""
    actions = pa.table(table.get_add_actions(flatten=True))
    rows = int(pa.compute.sum(actions.column("num_records")).as_py() or 0) if actions.num_rows else 0
    latest = table.version()
    for info in commit_infos(table.table_uri, latest, latest - HISTORY_SEARCH + 1):
        if info.get(FOLD_KEY):
            # A fold by the executors says how many rows it wrote; one in this process, delta-rs's metrics do.
            written = json.loads(info[FOLD_KEY]).get("rows_after", (info.get("operationMetrics") or {}).get("num_added_rows", 0))
            return RowCounts(rows, int(written), info["version"])
        if (carried := info.get(FOLDED_ROWS_KEY)) is not None:
            last = json.loads(carried)
            return RowCounts(rows, int(last["rows"]), last["version"])
    return RowCounts(rows, 0)


def carried(counts: RowCounts) -> dict[str, str]:
    """The `FOLDED_ROWS_KEY` entry an appended batch's commit carries forward."""
    return {FOLDED_ROWS_KEY: json.dumps({"rows": counts.folded, "version": counts.fold_version})}


def fold_files(table: DeltaTable, counts: RowCounts) -> frozenset[str]:
    """The data files of `table`'s snapshot that its last fold wrote: one row
    per key among them all (the overflow check bounds them apart from the
    partial rows). Empty when the fold is unknown or none of its files is
    left (a RESTORE to before it, an OPTIMIZE since)."""
    if counts.fold_version is None:
        return frozenset()
    written = {a["add"]["path"] for a in version_actions(table.table_uri, counts.fold_version) or [] if "add" in a}
    live = set(pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()) if written else set()
    return frozenset(written & live)


@dataclass(frozen=True)
class Folded:
    """A fold's commit: the version it made and the rows before and after."""

    version: int
    rows_before: int
    rows_after: int


def fold(spec: PipelineSpec, table: DeltaTable, files: FileWriting | None = None) -> Folded | None:
    """Rewrite `table` (an appended state's snapshot) as one row per key, in
    one commit that keeps the fence where it is; None if another commit on
    the state landed first (the fold is then simply due again).

    In this process, the folded rows are written as they stream out of the
    query (delta-rs). With `files` (an engine whose executors write files),
    Spark's executors read the snapshot's files, fold them by the same
    query and write the result; this process commits the new files and the
    removal of the old ones, and no row passes through it. Either way the
    commit lands on the version it read or not at all (no retries: delta-rs
    lets an overwrite from an older snapshot land over a later append,
    which would drop that batch); the files of a fold that lost are left to
    `maintain` (`spark_jobs.core.untracked`).
    """
    before = row_counts(table).rows
    position = transaction_position(table, STATE_FENCE)

    def props(**extra: Any) -> CommitProperties:
        marker = {"pipeline": spec.name, "rows_before": before, "position": position.encode(), **extra}
        return CommitProperties(
            custom_metadata={FOLD_KEY: json.dumps(marker)},
            app_transactions=[Transaction(STATE_FENCE, position.encode())],
            max_commit_retries=0,
        )

    try:
        if files is None:
            write_deltalake(table, read_state(spec, table), mode="overwrite", commit_properties=props())
            return Folded(table.version(), before, row_counts(table).rows)
        paths = pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()
        written = files.fold_files(spec, spec.state_path, pa.schema(table.schema().to_arrow()), paths)
        rows, token = sum(f.records for f in written), uuid.uuid4().hex
        commit_files(table, written, table.schema(), props(rows_after=rows, token=token), removed=paths, data_change=False)
    except Exception as exc:
        if not is_commit_conflict(exc):
            raise
        log.info("the state fold lost a race with another commit on %s; it is due again", spec.state_path)
        return None
    return Folded(_fold_version(spec.state_path, token), before, rows)


def _fold_version(path: str, token: str) -> int:
    """The version of the fold commit carrying `token` (newest first: it was just made)."""
    latest = open_table(path)
    newest = latest.version() if latest is not None else -1
    for info in commit_infos(path, newest, newest - HISTORY_SEARCH + 1):
        if info.get(FOLD_KEY) and json.loads(info[FOLD_KEY]).get("token") == token:
            return info["version"]
    return -1


def fold_if_due(spec: PipelineSpec, table: DeltaTable | None) -> Folded | None:
    """Fold an appended state whose appended rows passed `state.fold_at`
    (after a batch's commit: the batch is durable whatever happens here)."""
    if table is None or not is_appended(spec) or not row_counts(table).fold_due(spec.state.fold_at):
        return None
    folded = fold(spec, table)
    if folded is not None:
        log.info("folded the state: %d rows into %d (version %d)", folded.rows_before, folded.rows_after, folded.version)
    return folded
