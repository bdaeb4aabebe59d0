"""The compute step of a batch, kept behind a small interface.

The protocol (`spark_jobs.core.protocol`) only needs two things from compute:
check that the transform fits the spec before anything is written, and turn
a planned range into (state updates, quarantined records). Spark implements
it (`spark_jobs.engine.spark_compute`); keeping it an interface lets the protocol be
exercised without a JVM, and keeps Spark out of runs that have nothing to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, cast

import pyarrow as pa
import pyarrow.compute as pc

from spark_jobs.errors import TransformError
from spark_jobs.sources.base import BatchRange
from spark_jobs.core.event_time import is_quiet
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.staged import Sink, Staged, StagedFile, delete_files
from spark_jobs.core.widen import sql_type
from spark_jobs.core.write_path import executors_write

__all__ = [
    "QUARANTINE_COLUMNS",
    "Compute",
    "ComputeResult",
    "Engine",
    "FileWriting",
    "check_result_columns",
    "check_result_types",
    "check_unique_keys",
    "duplicate_keys_error",
    "null_keys_error",
    "validate_updates",
    "writes_files",
]

#: Columns of the quarantine rows compute returns (the table adds bookkeeping).
QUARANTINE_COLUMNS = pa.schema(
    [("file", pa.string()), ("line", pa.int64()), ("raw", pa.string()), ("reason", pa.string())]
)


@dataclass
class ComputeResult:
    """Output of one batch's compute step."""

    #: One row per key: the key columns and the merge columns (no rows when
    #: the executors wrote them: `staged`).
    updates: pa.Table
    #: Records that failed parsing or validation (QUARANTINE_COLUMNS; none
    #: when the executors wrote them: `staged_quarantine`).
    quarantine: pa.Table
    #: Records read from the range (valid + quarantined).
    records_in: int
    #: With a sink: the updates' files, checked (keys non-null and unique).
    staged: Staged | None = None
    #: With a sink: the quarantined records' files (bookkeeping columns included).
    staged_quarantine: Staged | None = None
    #: Event time (`spark_jobs.core.event_time`): records older than the
    #: batch's watermark, whatever became of them, and the newest event time
    #: among the records the transform took. None without `event_time`.
    records_late: int | None = None
    newest_event_time: datetime | None = None
    #: The newest event time among the late records, and the oldest among
    #: the valid ones on time: any watermark above the one and at most the
    #: other judges the records alike (`event_time.judged_alike`).
    newest_late: datetime | None = None
    oldest_on_time: datetime | None = None
    #: Duplicates (`spark_jobs.core.dedup`): the records dropped as such,
    #: and the ids the kept ones take (rows of `dedup.SCHEMA`'s `id` and
    #: `event_time`, or, with a sink, its files). None without `dedup`.
    records_duplicate: int | None = None
    seen_ids: pa.Table | Staged | None = None


class Compute(Protocol):
    """A batch engine: everything the protocol asks of one.

    `catch_up` (`spark_jobs.core.catch_up`) calls `process` for the batches
    it reads ahead on reader threads, not the thread that started the
    engine, as many at once as ``reads_at_once`` says (at most
    `spark_jobs.core.catch_up.READ_AHEAD`). Every `check` and `process` is
    told ``alongside``: True for every batch of a run whose reads overlap
    on an engine that runs more than one at once, so the engine need not
    spread one read over the whole machine while others share it."""

    #: How many `process` calls the engine runs at once, from as many threads.
    reads_at_once: int

    def start(self) -> None:
        """Start the engine (a JVM, a session, a connection). Called once, and
        only when a batch has work."""

    def check(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False) -> None:
        """Raise `TransformError` if the transform cannot produce the state's
        columns from `batch`; called before anything of it is written. May
        prepare `batch`'s read for `process`."""

    def process(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False, sink: Sink | None = None) -> ComputeResult:
        """Read exactly `batch`, quarantine bad records, run the transform.
        With a `sink` (engines that `write_files`), the executors write the
        updates and the quarantined records there instead of returning them."""

    def close(self) -> None:
        """Release engine resources."""


class FileWriting(Compute, Protocol):
    """An engine whose executors write rows as data files (`spark_jobs.core.staged`):
    a batch's rows never pass through the job's process."""

    def result_schema(self, spec: PipelineSpec, batch: BatchRange) -> pa.Schema:
        """The transform's result columns over `batch` (analysed, not run)."""

    def merge_files(
        self, spec: PipelineSpec, root: str, schema: pa.Schema, rewritten: list[str], updates: Staged, *,
        changes: bool = False, vectors: dict[str, dict[str, Any]] | None = None,
    ) -> tuple[StagedFile, ...]:
        """The state's files `rewritten` (paths in `root`) merged with
        `updates` by the spec's rules, written into `root` as new files;
        with `changes`, their change data files too (paths under `_change_data/`).
        `vectors`: the deletion vector descriptors of the files among them
        that carry one (by path): the rows those delete are not merged."""

    def rewrite_files(self, spec: PipelineSpec, root: str, schema: pa.Schema, rewritten: list[str], updates: Staged) -> tuple[StagedFile, ...]:
        """`merge_files` for a small batch: each of the files `rewritten`
        merged with `updates` where it stands, with no shuffle of the state."""

    def stage(self, root: str, rows: pa.Table, schema: pa.Schema) -> tuple[StagedFile, ...]:
        """Rows already in this process written as files into `root`, in
        `schema` (the state's), for the executors to merge in."""

    def fold_files(self, spec: PipelineSpec, root: str, schema: pa.Schema, paths: list[str]) -> tuple[StagedFile, ...]:
        """An appended state's files `paths` folded into one row per key
        (`folding.state_sql`), written into `root` as new files."""


def writes_files(compute: Compute) -> bool:
    """Whether `compute`'s executors write rows as files (`FileWriting`)."""
    return callable(getattr(compute, "result_schema", None))


class Engine:
    """A run's compute, started on first use: a run with nothing to do never starts Spark.

    `alongside`: the run reads batches at once (`catch_up`); on an engine
    that can (``reads_at_once`` > 1) its checks and reads then say so, the
    first batch's too.
    """

    def __init__(self, factory: Callable[[], Compute], *, alongside: bool = False) -> None:
        self._factory = factory
        self._alongside_reads = alongside
        self._compute: Compute | None = None
        #: Seconds its start took (a JVM, a session, a connection).
        self.start_s = 0.0

    @property
    def reads_at_once(self) -> int:
        return max(1, self.get().reads_at_once)

    def check(self, spec: PipelineSpec, batch: BatchRange) -> None:
        if is_quiet(batch):
            return  # it reads nothing, so there is no transform to analyse (and no engine to start)
        self._for(spec, batch).check(spec, batch, alongside=self._alongside())

    def process(
        self, spec: PipelineSpec, batch: BatchRange, sink: Sink | None = None, check: Callable[[BatchRange], None] | None = None
    ) -> ComputeResult:
        """The compute's `process`, and then `check` of what it read (the
        source's `check_read`), right as the read ends."""
        compute = self._for(spec, batch)
        if sink is None:
            result = compute.process(spec, batch, alongside=self._alongside())
        else:
            result = compute.process(spec, batch, alongside=self._alongside(), sink=sink)
        if check is not None:
            try:
                check(batch)
            except Exception:
                # What was read is not what was planned: its files are no one's.
                for staged in (result.staged, result.staged_quarantine):
                    if staged is not None:
                        delete_files(staged.root, staged.files)
                raise
        return result

    @property
    def writes_files(self) -> bool:
        """Whether the engine's executors write rows as files (`FileWriting`)."""
        return writes_files(self.get())

    def executors_write(self, spec: PipelineSpec, batch: BatchRange) -> bool:
        """Whether the executors write `batch`'s rows (`write_path.executors_write`)."""
        return executors_write(spec, batch, writes_files(self._for(spec, batch)))

    def files(self) -> FileWriting:
        """The engine, as one that writes files (`writes_files` must be True)."""
        return cast(FileWriting, self.get())

    def _alongside(self) -> bool:
        return self._alongside_reads and self.reads_at_once > 1

    def _for(self, spec: PipelineSpec, batch: BatchRange) -> Compute:
        """The compute, started for `batch` if this is the first batch it
        meets (a new plan's check, or a replay's read): a factory may start
        it for what the batch needs (`SparkFactory.expect`)."""
        if self._compute is None:
            expect = getattr(self._factory, "expect", None)
            if expect is not None:
                expect(spec, batch)
        return self.get()

    def get(self) -> Compute:
        if self._compute is None:
            begun = time.monotonic()
            self._compute = self._factory()
            self._compute.start()
            self.start_s = time.monotonic() - begun
        return self._compute

    def close(self) -> None:
        if self._compute is not None:
            self._compute.close()


def check_result_columns(spec: PipelineSpec, columns: list[str]) -> None:
    """The transform must return exactly the key and merge columns."""
    wanted = list(spec.state.keys) + spec.value_columns
    missing = [c for c in wanted if c not in columns]
    extra = [c for c in columns if c not in wanted]
    problems = []
    if missing:
        problems.append(
            f"lacks column(s) {', '.join(missing)} (named in state.keys / state.merge; "
            "column names are case-sensitive)"
        )
    if extra:
        problems.append(
            f"returns column(s) {', '.join(extra)} that have no merge rule: add them under "
            "state.merge or drop them from the SELECT"
        )
    if problems:
        raise TransformError(f"pipeline {spec.name}: the transform result " + "; ".join(problems))


def check_result_types(spec: PipelineSpec, schema: pa.Schema) -> None:
    """Each column of the transform's result must be of a type the state
    table can hold, and its merge rule must be able to merge it, in the
    spec's layout; else a `TransformError` naming each column, its type and
    what to do. Every engine checks the result's types when it analyses the
    transform (before the batch's plan is recorded), and `StateTable.align`
    checks the batch again before anything of it is written: a type no rule
    can merge would otherwise commit and then fail every query and fold."""
    problems = [p for f in schema if (p := _type_problem(spec, f.name, f.type))]
    if problems:
        raise TransformError(f"pipeline {spec.name}: the transform result " + "; ".join(problems), pipeline=spec.name)


def _type_problem(spec: PipelineSpec, column: str, column_type: pa.DataType) -> str | None:
    """Why `column` of this type cannot be a key or be merged by its rule, or None."""
    named = f"column {column!r} is {sql_type(column_type)}"
    if pa.types.is_null(column_type):
        return f"column {column!r} has no type (a bare NULL): cast it, e.g. CAST(NULL AS BIGINT)"
    if not _storable(column_type):
        return f"{named}, which a Delta table cannot hold: {_how_to_store(column_type)}"
    rule = spec.state.merge.get(column)
    if column in spec.state.keys and pa.types.is_nested(column_type):
        return f"{named}: a key must be a plain value (a number, string, date, ...), not a nested type"
    if rule in ("min", "max") and not _orderable(column_type):
        return f"{named}, which `{rule}` cannot order (a MAP has no order): merge it with `first` or `last`, or return an orderable type"
    if rule == "sum" and not (pa.types.is_signed_integer(column_type) or pa.types.is_decimal(column_type) or pa.types.is_floating(column_type)):
        return f"{named}, which `sum` cannot add: return a number"
    timed = _event_time_columns(spec)
    if column in timed and not (pa.types.is_timestamp(column_type) or pa.types.is_date32(column_type)):
        return f"{named}, but {timed[column]} names it: return a TIMESTAMP or DATE (`window(ts, '1 hour').start`)"
    if rule == "sum" and pa.types.is_float32(column_type) and spec.state.layout == "appended":
        return (
            f"{named} summed in an appended state, whose partial rows are added in DOUBLE and rounded to FLOAT "
            "only when stored, so the value would depend on when folds ran: return it as DOUBLE "
            "(`CAST(... AS DOUBLE)`), or use `state.layout: merged`"
        )
    return None


def _event_time_columns(spec: PipelineSpec) -> dict[str, str]:
    """The state columns the `event_time` block reads as times, and the field that names each."""
    event_time = spec.event_time
    if event_time is None:
        return {}
    named = {}
    if event_time.window is not None:
        named[event_time.window.key] = "event_time.window.key"
    if event_time.expire is not None and event_time.expire.column is not None:
        named[event_time.expire.column] = "event_time.expire.column"
    return named


def _orderable(column_type: pa.DataType) -> bool:
    """Whether both engines order values of this type (min, max): any but a
    MAP, also inside an ARRAY or a STRUCT (which order element by element)."""
    t = column_type
    if pa.types.is_map(t):
        return False
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _orderable(t.value_type)
    if pa.types.is_struct(t):
        return all(_orderable(t.field(i).type) for i in range(t.num_fields))
    return True


def _how_to_store(column_type: pa.DataType) -> str:
    """What to cast a column to that a Delta table cannot hold as it is."""
    text = str(column_type)
    if "duration" in text or "interval" in text:
        return "cast the interval to a number (its seconds or months as BIGINT, say)"
    if "time32" in text or "time64" in text:
        return "cast the time of day to a STRING, or make it a TIMESTAMP"
    if "null" in text:
        return "give its NULLs a type (e.g. CAST(NULL AS BIGINT), `array(CAST(NULL AS STRING))`)"
    return "cast it to a type a Delta table holds (a number, STRING, BINARY, DATE, TIMESTAMP, or an ARRAY, MAP or STRUCT of them)"


def _storable(column_type: pa.DataType) -> bool:
    """Whether a Delta table holds values of this Arrow type (as its column type)."""
    t = column_type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _storable(t.value_type)
    if pa.types.is_map(t):
        return _storable(t.key_type) and _storable(t.item_type)
    if pa.types.is_struct(t):
        return all(_storable(t.field(i).type) for i in range(t.num_fields))
    return (
        pa.types.is_boolean(t) or pa.types.is_signed_integer(t) or pa.types.is_float32(t) or pa.types.is_float64(t)
        or pa.types.is_decimal128(t) or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
        or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_date32(t) or pa.types.is_timestamp(t)
    )


def validate_updates(spec: PipelineSpec, updates: pa.Table) -> pa.Table:
    """Check keys are non-null and unique; make every column nullable.

    Nullability is dropped so that the state table's schema does not depend
    on what Spark could prove about one batch (count(*) is non-null, sum is
    not); the merge needs batch and table schemas to agree.
    """
    check_result_columns(spec, updates.column_names)
    keys = list(spec.state.keys)
    for key in keys:
        nulls = updates.column(key).null_count
        if nulls:
            raise null_keys_error(spec, nulls, key)
    check_unique_keys(spec, updates)
    schema = pa.schema([f.with_nullable(True) for f in updates.schema])
    return updates.select(keys + spec.value_columns).cast(pa.schema([schema.field(c) for c in keys + spec.value_columns]))


def check_unique_keys(spec: PipelineSpec, updates: pa.Table) -> None:
    """`updates` (its key columns at least) must hold each key once."""
    keys = list(spec.state.keys)
    if updates.num_rows < 2:
        return
    counts = updates.group_by(keys).aggregate([([], "count_all")])
    dupes = counts.filter(pc.greater(counts.column("count_all"), 1))
    if dupes.num_rows:
        raise duplicate_keys_error(spec, dupes.num_rows, {k: dupes.column(k)[0].as_py() for k in keys})


def null_keys_error(spec: PipelineSpec, rows: int, key: str | None = None) -> TransformError:
    named = f"key {key!r}" if key else f"key ({', '.join(spec.state.keys)})"
    return TransformError(
        f"pipeline {spec.name}: the transform returned {rows} row(s) with a null "
        f"{named}; filter them out or coalesce the key in the transform"
    )


def duplicate_keys_error(spec: PipelineSpec, count: int | None, example: dict[str, Any]) -> TransformError:
    how_many = f"{count} key(s)" if count is not None else "keys"
    return TransformError(
        f"pipeline {spec.name}: the transform returned {how_many} more "
        f"than once (e.g. {example}); it must return one row per key: GROUP BY "
        f"{', '.join(spec.state.keys)}"
    )
