"""Windows over event time: final rows appended once, and state that expires.

A spec's `event_time.window` names the state key that holds each window's
start and the window's size; the window ends `size` after its start. Once
the watermark (`spark_jobs.core.event_time`) reaches a window's end, no
record that is not late can fall in it any more: it is *final*.

**Final rows** (`event_time.final`). After batch N's commit the windows that
became final (end after the watermark the table of final rows was last
brought to, and at or before N's watermark) have their state rows, as of
N's state version, appended to that table once:

1. The append is a separate Delta commit, *fenced with* N's: it carries the
   final table's fence (`FINAL_FENCE`, per pipeline) at N's position and,
   in its metadata (`FINAL_KEY`), the watermark it brought the table to.
   A table whose fence is at N or beyond already holds N's final rows.
2. It is made by `settle`, which runs after step 5 of every batch (the
   ledger row) and in step 1 of every run, before anything is planned. A
   run that died between N's state commit and the append leaves it to the
   next run, whatever that run then finds to do, so the table is never
   more than one batch behind the ledger and never holds a row twice: two
   runs settling at once both carry the fence, and delta-rs fails the
   commit of the second (it then finds the first's and stops).
3. A rewind to batch K (the ledger's head is then its ``rewound`` row)
   takes back the rows of batches after K in one fenced delete, and the
   table is brought back to K's watermark: the batches after K append the
   windows they close again, from the state as those batches leave it.

A row carries the state's columns, with ``_batch_id`` the batch that made it
final. The table has a change feed, so a downstream pipeline
(`type: delta`, `read: changes`) sees a rewind's deletes too.

**Expiry** (`event_time.expire`). After batch N the state's rows whose
window ended more than `after` before N's watermark (or whose
`expire.column`, a time that only grows, is that far behind it) are
deleted from the state in one commit that keeps the state fence at N and is
marked `EXPIRE_KEY` (a change of the job's own, not one made outside it).
It is made by `settle` too, so a crash before it leaves it to the next run.
N's own commit, the version the ledger records for N, still holds those
rows: a rewind to N restores them, and the next batch expires them again.

Both are idempotent (a settle repeated finds nothing to do) and both read
the watermark from the ledger's head, never from the clock.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake

from spark_jobs.core.delta_io import arrow, commit_infos, ensure_table, is_commit_conflict, open_table, storage_errors
from spark_jobs.core.event_time import iso, less, stamp, utc
from spark_jobs.core.faults import fault_point
from spark_jobs.core.fencing import STATE_FENCE, Position, commit_properties, transaction_position
from spark_jobs.core.folding import is_appended, state_sql
from spark_jobs.core.ledger import RowStatus, scoped
from spark_jobs.core.spec import BATCH_COLUMN
from spark_jobs.core.staged import Staged, key_range
from spark_jobs.errors import ConcurrentRunError, SpecChangedError, TransformError
from spark_jobs.storage.s3 import delta_storage_options

if TYPE_CHECKING:
    from spark_jobs.core.ledger import LedgerRow, LedgerView
    from spark_jobs.core.pipeline import Pipeline
    from spark_jobs.core.spec import PipelineSpec

__all__ = ["EXPIRE_KEY", "FINAL_FENCE", "FINAL_KEY", "FinalSummary", "check_windows", "final_summary", "keep_marker_in_reach", "settle"]

log = logging.getLogger("microbatch")

#: The final table's fence (scoped per pipeline): the position whose final rows it holds.
FINAL_FENCE = "microbatch.final"
#: A final table commit's metadata: the watermark it brought the table to.
FINAL_KEY = "microbatch.final"
#: A state commit that removed expired rows (keeps the fence and every other row).
EXPIRE_KEY = "microbatch.expire"

#: How often a final append is tried again after another run's landed first.
FINAL_TRIES = 3
#: How far back the final table's log is searched for the last `FINAL_KEY`.
FINAL_SEARCH = 100


def settle(pipeline: Pipeline, view: LedgerView) -> None:
    """Bring the final table and the state's expiry to the ledger's head:
    after step 5, and in step 1 of every run (the module docstring). Not
    again in this process while the ledger has not moved since it last
    settled (a catch-up's next step 1): a run that commits or rewinds, or
    completes another's row, moves it."""
    event_time = pipeline.spec.event_time
    if event_time is None or view.head is None:
        return
    at = (view.version, view.position)
    if view.version >= 0 and pipeline.settled_at == at:
        return
    if event_time.final is not None:
        _finalize(pipeline, view)
        fault_point("after_final_rows")
    if event_time.expire is not None and not _expire(pipeline, view):
        return  # lost a race: the next settle tries again, this process's too
    pipeline.settled_at = at


def check_windows(spec: PipelineSpec, updates: pa.Table | Staged, watermark_in: datetime | None) -> None:
    """A batch with final rows must not change a window that is final
    already (ended at or before the watermark it was judged against): its
    late records were left out, so only a transform that does not window by
    `event_time.column` can. Checked before anything of the batch is written."""
    event_time = spec.event_time
    if event_time is None or event_time.final is None or event_time.window is None or watermark_in is None:
        return
    key = event_time.window.key
    if isinstance(updates, Staged):
        found = key_range(updates, key)
        earliest = found[0] if found is not None else None
    else:
        earliest = pa.compute.min(updates.column(key)).as_py() if updates.num_rows else None
    if earliest is None:
        return
    try:
        end = _moment(earliest) + timedelta(seconds=event_time.window.size_seconds)
    except OverflowError:
        return  # it ends after year 9999: not final
    if end <= utc(watermark_in):
        raise TransformError(
            f"pipeline {spec.name}: the transform returned a row for the window {key} = {iso(_moment(earliest))}, "
            f"which ended at {iso(end)}, at or before the watermark {iso(watermark_in)}: its final row is "
            f"appended already. Window by the event time: `window({event_time.column}, '{event_time.window.size}').start "
            f"AS {key}` (records before the watermark are late and never reach the transform). Nothing was written.",
            pipeline=spec.name,
        )


# -- final rows ------------------------------------------------------------------------


def _finalize(pipeline: Pipeline, view: LedgerView) -> None:
    spec, head = pipeline.spec, view.head
    assert head is not None and spec.final_path is not None
    fence = scoped(FINAL_FENCE, spec.name)
    for _ in range(FINAL_TRIES):
        state = _state_at(pipeline, head)
        existing = open_table(spec.final_path)
        if existing is None and state is None:
            return  # no state yet, and so no final row
        with storage_errors(f"pipeline {spec.name}: could not append the final rows of {view.position}", spec.final_path):
            table = existing or ensure_table(
                spec.final_path,
                pa.schema(state.schema().to_arrow()),  # type: ignore[union-attr]
                name=f"{spec.name} final",
                description=f"final rows of pipeline {spec.name}: each window once the watermark passed its end",
                configuration={"delta.enableChangeDataFeed": "true"},
            )
            if existing is None and head.batch_id > 1:
                log.warning(
                    "pipeline %s: the final table %s is made now, from the state, with the windows it holds (had it been "
                    "there before and been deleted, the rows of windows expired since are not in it)", spec.name, spec.final_path,
                )
            if transaction_position(table, fence) >= view.position:
                return
            _check_final_table(spec, table)
            try:
                _bring_to(spec, table, fence, view.position, head, state)
                return
            except Exception as exc:
                if not is_commit_conflict(exc):
                    raise
                # Another run's settle, most likely of the same batch: look again.
    raise ConcurrentRunError(
        f"pipeline {spec.name}: could not append the final rows of {view.position} (the table kept changing); run again",
        pipeline=spec.name,
        path=spec.final_path,
        position=view.position,
    )


def _check_final_table(spec: PipelineSpec, table: DeltaTable) -> None:
    """The table at `final.path` is this pipeline's table of final rows, of
    the windows the spec declares: another pipeline's (its marker, or a
    table this job did not make) or another window size would mix two sets
    of final rows, and a rewind of one would take back the other's."""
    assert spec.event_time is not None and spec.event_time.window is not None
    marker = _marker(table) or {}
    owner = marker.get("pipeline") or (table.metadata().name or "").removesuffix(" final")
    window = marker.get("window")
    problem = None
    if owner != spec.name:
        problem = f"holds the final rows of {'pipeline ' + repr(owner) if owner else 'a table this job did not make'}"
    elif window is not None and window != spec.event_time.window.model_dump():
        problem = f"holds windows {window}, and the spec now says {spec.event_time.window.model_dump()}"
    if problem:
        raise SpecChangedError(
            f"pipeline {spec.name}: event_time.final.path {spec.final_path} {problem}: give this pipeline's final rows "
            "a table of their own (a new final.path); nothing was written",
            pipeline=spec.name,
            path=spec.final_path,
        )


def _bring_to(spec: PipelineSpec, table: DeltaTable, fence: str, position: Position, head: LedgerRow, state: DeltaTable | None) -> None:
    """One fenced commit that brings the final table to `head`: a rewind's
    delete of the rows after it, or the rows of the windows that closed."""
    assert spec.event_time is not None and spec.event_time.window is not None
    window = spec.event_time.window
    watermark = head.watermark
    marker = {
        "through": iso(watermark) if watermark is not None else None,
        "batch_id": head.batch_id,
        "epoch": head.epoch,
        "pipeline": spec.name,
        "window": window.model_dump(),
    }
    props = commit_properties(fence, position, {FINAL_KEY: json.dumps(marker)})
    if head.status is RowStatus.REWOUND:
        before = table.version()
        table.delete(f"{BATCH_COLUMN} > {head.batch_id}", commit_properties=props)
        if table.version() == before:
            _empty_commit(table, props)
        log.info("final rows: taken back to batch %d", head.batch_id)
        return
    through = _through(table)
    watermark = utc(watermark) if watermark is not None else None
    if watermark is None or (through is not None and watermark <= through):
        return  # nothing closed
    size = timedelta(seconds=window.size_seconds)
    schema = pa.schema(state.schema().to_arrow()) if state is not None else None
    last_start, after_start = less(watermark, size), less(through, size)
    if state is None or schema is None or last_start is None:
        _empty_commit(table, props)  # (no window ends by a watermark in year 1)
        return
    kind = schema.field(window.key).type
    where = [_compare(window.key, kind, "<=", last_start)]
    if after_start is not None:
        where.append(_compare(window.key, kind, ">", after_start))
    rows = _rows(spec, state, schema, " AND ".join(where))
    rows = rows.set_column(rows.schema.get_field_index(BATCH_COLUMN), BATCH_COLUMN, pa.array([head.batch_id] * rows.num_rows, pa.int64()))
    write_deltalake(table, rows, mode="append", schema_mode="merge", commit_properties=props)
    log.info("final rows: %d windows closed by the watermark %s", rows.num_rows, iso(watermark))


def _rows(spec: PipelineSpec, state: DeltaTable, schema: pa.Schema, where: str) -> pa.Table:
    """The state's rows (one per key, also of an appended state) that `where` keeps."""
    rows = f"({state_sql(spec.state, schema)})" if is_appended(spec) else "state"
    found = arrow(QueryBuilder().register("state", state).execute(f"SELECT * FROM {rows} AS s WHERE {where}").read_all())
    return found.cast(schema) if found.num_rows else schema.empty_table()


def _through(table: DeltaTable) -> datetime | None:
    """The watermark the final table was last brought to (None: never)."""
    through = (_marker(table) or {}).get("through")
    return _parse(through) if through else None


def keep_marker_in_reach(spec: PipelineSpec, table: DeltaTable) -> None:
    """After `maintain`'s commits on the final table (a VACUUM's two, a
    compaction's, an untracked file's marker: none carries the marker, and
    delta-rs drops the fence from a compaction's commit), one empty commit
    carrying the final fence where it is and the newest marker again: else
    maintenance on a quiet pipeline pushes the marker out of `_marker`'s
    reach and the next settle appends every final window again.

    From a fresh snapshot, so the marker is the newest settle's; a settle
    landing between that snapshot and this commit carries the same fence,
    and delta-rs fails this commit (`maintain` then asks to be run again)."""
    table.update_incremental()
    fence = scoped(FINAL_FENCE, spec.name)
    marker = _marker(table)
    if table.transaction_version(fence) is None or marker is None:
        return
    _empty_commit(table, commit_properties(fence, transaction_position(table, fence), {FINAL_KEY: json.dumps(marker)}))


def _marker(table: DeltaTable) -> dict[str, Any] | None:
    """The newest `FINAL_KEY` of the final table's log (an OPTIMIZE by anyone carries none)."""
    latest = table.version()
    for info in commit_infos(table.table_uri, latest, latest - FINAL_SEARCH + 1):
        if info.get(FINAL_KEY):
            return json.loads(info[FINAL_KEY])
    return None


def _parse(moment: str) -> datetime:
    return datetime.fromisoformat(moment.replace("Z", "+00:00"))


def _state_at(pipeline: Pipeline, head: LedgerRow) -> DeltaTable | None:
    """The state as the head's commit left it (None: no state, a rewind to before the first batch)."""
    if head.state_version is None:
        return None
    path = pipeline.state.path
    return DeltaTable(path, version=head.state_version, storage_options=delta_storage_options(path))


def _empty_commit(table: DeltaTable, props: CommitProperties) -> None:
    write_deltalake(table, pa.schema(table.schema().to_arrow()).empty_table(), mode="append", commit_properties=props)


@dataclass(frozen=True)
class FinalSummary:
    """What the table of final rows holds, for `status` and the console."""

    path: str
    #: Final rows (one per window and key), and the watermark the table was
    #: last brought to: every window that ended by then is in it.
    rows: int
    through: datetime | None
    #: The batch whose settle last appended to it (or took rows back).
    batch_id: int | None

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "rows": self.rows, "through": iso(self.through) if self.through else None, "batch_id": self.batch_id}


def final_summary(spec: PipelineSpec) -> FinalSummary | None:
    """The final table's rows and how far it is, from its log (no data read); None without one."""
    if spec.final_path is None:
        return None
    table = open_table(spec.final_path)
    if table is None:
        return FinalSummary(spec.final_path, 0, None, None)
    actions = pa.table(table.get_add_actions(flatten=True))
    rows = int(pa.compute.sum(actions.column("num_records")).as_py() or 0) if actions.num_rows else 0
    marker = _marker(table) or {}
    through = marker.get("through")
    return FinalSummary(spec.final_path, rows, _parse(through) if through else None, marker.get("batch_id"))


# -- expiry ----------------------------------------------------------------------------


def _expire(pipeline: Pipeline, view: LedgerView) -> bool:
    """Delete the state's rows the head's watermark expires; False if the
    delete lost a race (another commit landed first), to be tried again."""
    spec, head = pipeline.spec, view.head
    assert head is not None and spec.event_time is not None and spec.event_time.expire is not None
    if head.watermark is None:
        return True
    event_time, expire = spec.event_time, spec.event_time.expire
    table = pipeline.state.open()
    # Only a state still at the head: a run that moved on expires by its own watermark.
    if table is None or pipeline.state.position(table) != view.position:
        return True
    column = expire.column or event_time.window.key  # type: ignore[union-attr]
    behind = expire.after_seconds + (event_time.window.size_seconds if expire.column is None else 0)  # type: ignore[union-attr]
    cutoff = less(utc(head.watermark), timedelta(seconds=behind))
    if cutoff is None:
        return True  # before year 1: nothing is that old
    kind = pa.schema(table.schema().to_arrow()).field(column).type
    marker = {"before": iso(cutoff), "column": column, "batch_id": head.batch_id, "epoch": head.epoch}
    props = CommitProperties(
        custom_metadata={EXPIRE_KEY: json.dumps(marker)},
        # The fence where it is: a commit from a snapshot before a batch's or
        # a rewind's fails (delta-rs's conflict check, `fencing`), so a run
        # that fell behind never expires by a watermark that is no longer the head's.
        app_transactions=[Transaction(STATE_FENCE, view.position.encode())],
    )
    try:
        with storage_errors(f"pipeline {spec.name}: could not expire the state's rows before {iso(cutoff)}", pipeline.state.path):
            metrics = table.delete(_compare(column, kind, "<", cutoff), commit_properties=props)
    except Exception as exc:
        if not is_commit_conflict(exc):
            raise
        log.info("expiry: the state moved on meanwhile; the next settle expires by its watermark")
        return False
    if int(metrics.get("num_deleted_rows", 0)):
        log.info("expired %s state rows (%s before %s)", metrics["num_deleted_rows"], column, iso(cutoff))
    return True


# -- helpers ---------------------------------------------------------------------------


def _compare(column: str, kind: pa.DataType, op: str, moment: datetime) -> str:
    """SQL comparing a TIMESTAMP, TIMESTAMP_NTZ (read as UTC) or DATE (its
    midnight, UTC) column with `moment`, exactly, for delta-rs's delete and
    queries (a literal of the column's own type, so that files are pruned)."""
    moment = utc(moment)
    name = f'"{column}"'
    if pa.types.is_date32(kind):
        day = moment.date()
        if op == "<" and moment != datetime(day.year, day.month, day.day, tzinfo=UTC):
            day += timedelta(days=1)  # a date is before a moment within it only if it is before its day's end
        return f"{name} {op} '{day.year:04d}-{day.month:02d}-{day.day:02d}'"
    # A literal of the column's own type: a plain string would be cast to
    # nanoseconds, which end in 2262 (an event time in year 9999 failed every run).
    text = stamp(moment)
    zone = 'Some("UTC")' if kind.tz is not None else "None"  # type: ignore[attr-defined]
    return f"{name} {op} arrow_cast('{text}{'Z' if kind.tz is not None else ''}', 'Timestamp(Microsecond, {zone})')"


def _moment(value: datetime | date) -> datetime:
    """A window's start as a UTC moment (a DATE: its midnight)."""
    if not isinstance(value, datetime):
        return datetime(value.year, value.month, value.day, tzinfo=UTC)
    return utc(value)
