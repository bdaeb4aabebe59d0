"""Spark compute: read the planned range, quarantine bad records, transform.

A batch is one Spark job when nothing in it is bad: records are parsed,
checked and transformed in one pass, and what the protocol needs besides
the state updates (how many records were read; whether any failed, and in
which files) comes back as observed metrics of that same job
(`DataFrame.observe`), not from a second pass over cached rows. Only a
batch with bad records runs a second job, which collects them for
quarantine.

Local JSON and CSV files are read by Spark's own readers, which parse
straight from the bytes but number no lines. A file goes the exact way,
numbered by line, when the driver's scan of its bytes finds it suspect
before the batch is read, or when one of its records fails in the native
read (then it is read again); `spark_jobs.engine.native_read` says what is
suspect, and why the two reads agree on every other file. S3 objects,
Parquet files and Kafka records are always read the exact way
(`spark_jobs.engine.exact_read`). Records are parsed by the executors, not
the driver; only the (small, aggregated) transform result and the
quarantined records come back to the driver, as Arrow.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import unquote, urlparse
from weakref import WeakKeyDictionary

import pyarrow as pa

from spark_jobs.core.compute import QUARANTINE_COLUMNS, ComputeResult, check_result_columns, check_result_types, validate_updates
from spark_jobs.core.delta_io import is_commit_conflict
from spark_jobs.core.identity import SpecIdentity
from spark_jobs.core.spec import KAFKA_COLUMNS, PipelineSpec
from spark_jobs.core.sql_text import spark_identifier
from spark_jobs.core.quarantine import SCHEMA as QUARANTINE_SCHEMA
from spark_jobs.core.staged import CAST_FAILED, Sink, Staged, StagedFile, delete_files
from spark_jobs.engine import dedup_rows, event_marks, delta_read, exact_read, native_read, spark_files, spark_state
from spark_jobs.engine.failures import never_retried
from spark_jobs.engine.spark_state import Out
from spark_jobs.engine.parse import FILE, KEEP, LINE, MAX_RAW_CHARS, RAW, REASON
from spark_jobs.engine.session import SPARK_JARS_ENV, built_once, connect_session, default_session, redact_master, under_spark_submit
from spark_jobs.errors import ComputeError, MicrobatchError, ResultTooLargeError, SourceError, SourceRefusedError, TransformError, first_line
from spark_jobs.sources.base import BatchRange
from spark_jobs.sources.delta import DeltaManifest
from spark_jobs.sources.files import HADOOP_GLOB_CHARS, FilesManifest, SourceFile
from spark_jobs.sources.kafka import KafkaManifest
from spark_jobs.storage.s3 import is_s3

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

    from spark_jobs.engine.driver import EarlyDriver

__all__ = ["SparkCompute", "spark_path"]

log = logging.getLogger("microbatch")

#: The name of a batch's observed metrics.
_METRICS = "microbatch_batch"
#: Spark's thread-local properties naming the jobs (and RDDs) a thread creates (`_call_site`).
_DESCRIPTION, _CALL_SITE_SHORT, _CALL_SITE_LONG = "spark.job.description", "callSite.short", "callSite.long"
#: Spec identities whose transform a session has checked.
_CHECKED: WeakKeyDictionary[SparkSession, set[str]] = WeakKeyDictionary()


_T = TypeVar("_T")


@dataclass(frozen=True)
class _Split:
    """How a read's rows split: the `valid` ones go to the transform (as its
    `fields`), and `metrics` are observed over all of them."""

    valid: Column
    metrics: list[Column]
    fields: list[Column]
    #: The fields' names (duplicates are ordered by them: `dedup_rows`).
    names: tuple[str, ...] = ()


def _split(spark: SparkSession, spec: PipelineSpec, *, native: bool, extra: tuple[str, ...] = ()) -> _Split:
    """The split of natively read rows (`native_read.SUSPECT` marks the failed),
    or of records numbered by line (a `REASON` marks them; `extra` columns
    pass through to the transform); built once per session (`built_once`)."""
    from pyspark.sql import functions as F

    def build() -> _Split:
        if native:
            valid = ~F.col(native_read.SUSPECT)
            suspect = F.collect_set(F.when(F.col(native_read.SUSPECT), F.col(FILE)))
            metrics = {"records": F.count(F.lit(1)), "suspect": suspect}
        else:
            valid = F.col(REASON).isNull()
            metrics = {"records": F.count(F.lit(1)), "bad": F.count(REASON)}
        observed = [column.alias(name) for name, column in metrics.items()]
        if spec.event_time is not None:
            valid, timed = event_marks.split_terms(spec, valid)
            observed += timed
        names = (*[f.name for f in spec.source.fields], *extra)
        return _Split(valid, observed, [F.col(spark_identifier(name)) for name in names], names)

    timed = (spec.event_time.column, spec.event_time.late) if spec.event_time is not None else ()
    key = ("split", "native" if native else "numbered", *[f.name for f in spec.source.fields], "|", *extra, "|", *timed)
    return built_once(spark, key, build)


@dataclass(frozen=True)
class _Query:
    """A batch's transform, built and analysed, with the metrics observed over its rows."""

    result: DataFrame
    rows: DataFrame
    metrics: list[Column]
    #: With `dedup`: the kept records' ids and the counts (`dedup_rows.Deduplicated`).
    dedup: dedup_rows.Deduplicated | None = None


@dataclass(frozen=True)
class _FirstRead:
    """How a batch is read first: `native` (the clean and the already suspect
    files) for a native read, else the exact read's `parsed` records."""

    batch: BatchRange
    query: _Query
    native: tuple[list[SourceFile], list[SourceFile]] | None = None
    parsed: DataFrame | None = None


class SparkCompute:
    """Runs batches on a Spark session created on first use.

    Stops the session on `close()` only if it created it: a session passed
    in, or one already active in the process (an embedding application's),
    is left running.
    """

    def __init__(
        self,
        session: SparkSession | None = None,
        master: str | None = None,
        *,
        native_reads: bool = True,
        stop_on_close: bool = True,
        early: EarlyDriver | None = None,
        short_lived: bool = True,
        delta: bool = False,
    ) -> None:
        self._session = session
        self._master = master
        #: The session it starts runs one batch (`default_session`'s flags for a fast start), or many.
        self._short_lived = short_lived
        #: The session it starts loads delta-spark (a Delta source read by Spark).
        self._delta = delta
        #: A driver JVM launched ahead of need, for this compute's session to
        #: take; its owner (`SparkFactory`) stops it if none does.
        self._early = early
        self._owns_session = False
        #: False for a process that exits after the batch: its driver JVM
        #: ends when this process does (it watches its standard input), and
        #: stopping it first cost a third of a second of the run.
        self._stop_on_close = stop_on_close
        #: False reads local files the exact way too (tests compare the two reads).
        self._native_reads = native_reads
        #: The batch `check` built the read of, for `process` to run.
        self._first: _FirstRead | None = None
        #: Guards `_first` and the session's `batch` view: reads run on several threads (`reads_at_once`).
        self._lock = threading.Lock()

    @property
    def spark(self) -> SparkSession:
        if self._session is None:
            from pyspark.sql import SparkSession

            if self._master and self._master.startswith("sc://"):
                log.info("connecting to Spark Connect at %s", redact_master(self._master))
                self._session, self._owns_session = connect_session(self._master), True
            else:
                active = SparkSession.getActiveSession()
                if active is None:
                    log.info("starting Spark (master %s)", redact_master(self._master))
                    self._session = default_session(
                        self._master, short_lived=self._short_lived, early=self._early, delta=self._delta
                    )
                else:
                    self._session = active
                self._owns_session = active is None
        return self._session

    @property
    def reads_at_once(self) -> int:
        """Two batches may be read at once, from two threads (`catch_up`
        reads ahead): Spark runs their jobs side by side. One through Spark
        Connect, whose client's concurrent use this project has not tested."""
        return 1 if _is_connect(self.spark) else 2

    def start(self) -> None:
        """Start (or connect to) Spark now rather than at the first query."""
        self.spark  # noqa: B018 - the property starts the session

    def close(self) -> None:
        # A prepared read its batch never took (a read ahead stood in): its
        # records, if marked for caching, hold no data yet (nothing ran on
        # them), but the session's cache would keep the entry.
        first, self._first = self._first, None
        if first is not None and first.parsed is not None and first.parsed.is_cached and self._session is not None:
            try:
                first.parsed.unpersist()
            except Exception as exc:  # noqa: BLE001 - clean-up only, as stopping below
                log.debug("a prepared read was not unpersisted (%s)", type(exc).__name__)
        if self._session is not None and self._owns_session and (self._stop_on_close or _is_connect(self._session)):
            session, self._session = self._session, None
            try:
                session.stop()
            except Exception as exc:
                # Typically a run interrupted (SIGTERM) in the middle of a py4j
                # call, which leaves the bridge unusable. Stopping is clean-up
                # only: no table depends on it, and the JVM exits with us. Not
                # raising keeps the real reason the run ended visible.
                log.warning("Spark did not stop cleanly (%s); it ends with this process", type(exc).__name__)

    # -- checks ---------------------------------------------------------------

    def check(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False) -> None:
        """Analyse the transform over `batch` before anything is written; no job runs.

        The batch's first read is built for it (and kept for `process`), so
        the transform is analysed once, over the plan that then runs: in a
        new process, on a cold JVM, a second analysis of an empty stand-in
        cost half a second. Once a session has passed a files or Kafka spec,
        it is not checked again: its `batch` has the spec's columns. (A
        Delta source's columns are its table's, which may change, and its
        rows are read on the driver: it is checked over an empty frame of
        the table's columns, every time.)
        """
        reader = _reader_of(spec, batch)
        if reader.columns_on_driver is not None:
            columns = reader.columns_on_driver(spec, batch.manifest)
            if spec.event_time is not None:
                event_marks.check_column(spec, columns, batch.manifest.uri)
            empty = delta_read.arrow_frame(self.spark, columns.empty_table())
            _check_result(spec, self._transform(spec, empty).schema)
            return
        checked = _CHECKED.setdefault(self.spark, set())
        key = SpecIdentity.of(spec).fingerprint
        if key not in checked:
            with _call_site(self.spark, spec, batch):
                first = self._explained(spec, batch, lambda: self._first_read(spec, batch, alongside=alongside))
            with self._lock:
                self._first = first
            checked.add(key)

    # -- a batch ------------------------------------------------------------------

    def process(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False, sink: Sink | None = None) -> ComputeResult:
        """Read `batch`, quarantine its bad records, transform it. With a
        `sink`, the executors write the result and the quarantined records
        as data files there (`spark_jobs.engine.spark_state`), and only the
        files' names and statistics come back."""
        out = Out(sink, _planned_names(batch)) if sink is not None else None
        with _call_site(self.spark, spec, batch):
            return self._process(spec, batch, alongside, out)

    def _process(self, spec: PipelineSpec, batch: BatchRange, alongside: bool, out: Out | None) -> ComputeResult:
        reader = _reader_of(spec, batch)
        if reader.read_on_driver is not None:
            return reader.read_on_driver(self, spec, batch, out)
        first = self._take_first(batch)

        def run() -> ComputeResult:
            return self._finish(spec, first or self._first_read(spec, batch, alongside=alongside), out)

        return reader.as_planned(self._explained(spec, batch, run), batch.manifest)

    def _take_first(self, batch: BatchRange) -> _FirstRead | None:
        """The first read `check` (or `result_schema`) built for `batch`, once."""
        with self._lock:
            first = self._first
            if first is not None and first.batch == batch:
                self._first = None
                return first
            return None  # (another run's plan won the race, or this is a read ahead)

    # -- the executors' writes (`FileWriting`) ---------------------------------

    def result_schema(self, spec: PipelineSpec, batch: BatchRange) -> pa.Schema:
        """The transform's result columns over `batch`, in the order the state
        keeps them (keys, then the merge columns), analysed and not run; the
        batch's first read is kept for `process`."""
        reader = _reader_of(spec, batch)
        if reader.columns_on_driver is not None:
            empty = delta_read.arrow_frame(self.spark, reader.columns_on_driver(spec, batch.manifest).empty_table())
            schema = self._transform(spec, empty).schema
        else:
            first = self._take_first(batch) or self._explained(spec, batch, lambda: self._first_read(spec, batch))
            with self._lock:
                self._first = first
            schema = first.query.result.schema
        _check_result(spec, schema)
        fields = {f.name: pa.field(f.name, _arrow_type(spec, f.name, f.dataType)) for f in schema.fields}
        return pa.schema([fields[name] for name in [*spec.state.keys, *spec.value_columns]])

    def merge_files(
        self, spec: PipelineSpec, root: str, schema: pa.Schema, rewritten: list[str], updates: Staged, *,
        changes: bool = False, vectors: dict[str, dict[str, Any]] | None = None,
    ) -> tuple[StagedFile, ...]:
        with _writing_state(spec):
            return spark_state.merge_files(self.spark, spec, root, schema, rewritten, updates, changes=changes, vectors=vectors)

    def fold_files(self, spec: PipelineSpec, root: str, schema: pa.Schema, paths: list[str]) -> tuple[StagedFile, ...]:
        with _writing_state(spec):
            return spark_state.fold_files(self.spark, spec, root, schema, paths)

    def rewrite_files(self, spec: PipelineSpec, root: str, schema: pa.Schema, rewritten: list[str], updates: Staged) -> tuple[StagedFile, ...]:
        with _writing_state(spec):
            return spark_state.rewrite_files(self.spark, spec, root, schema, rewritten, updates)

    def stage(self, root: str, rows: pa.Table, schema: pa.Schema) -> tuple[StagedFile, ...]:
        return spark_files.write_table(rows, root, schema, spark_state.client(root))

    def _explained(self, spec: PipelineSpec, batch: BatchRange, step: Callable[[], _T]) -> _T:
        """`step`, with a Spark failure turned into an error that names what to look at."""
        try:
            return step()
        except Exception as exc:
            too_big = re.search(r"Total size of serialized results[^\n]*maxResultSize[^\n)]*\)", str(exc))
            if too_big:
                raise ResultTooLargeError(
                    f"pipeline {spec.name}: this batch's result is bigger than Spark lets come back to the job's "
                    f"process ({too_big.group(0)}). Nothing was committed; a retry meets the same size. Set "
                    "`engine.state_write: executors` in the spec to have Spark's executors write it (the way "
                    "batches this big are written: docs/architecture.md, \"Where the rows go\"), or raise "
                    "spark.driver.maxResultSize and give the driver the memory for it.",
                    pipeline=spec.name,
                ) from exc
            found = re.search(f"{re.escape(CAST_FAILED)} [^\n]*", str(exc))
            if found:
                # A writing task could not cast a value to the state's column type, as `align` refuses it here.
                raise TransformError(
                    f"pipeline {spec.name}: this batch's columns do not fit the state table's types ({found.group(0)}); "
                    f"cast them in the transform to the types in {spec.state_path}",
                    pipeline=spec.name,
                    path=spec.state_path,
                ) from exc
            raise never_retried(spec, exc) or _reader_of(spec, batch).explain(spec, batch.manifest, exc) from exc

    def _first_read(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False) -> _FirstRead:
        """How a batch is read first, up to its transform (analysed, not run):
        by the reader of its manifest (`_READERS`)."""
        read = _reader_of(spec, batch).first_read
        assert read is not None  # readers on the driver have no first read
        return read(self, spec, batch, alongside)

    def _read_kafka(self, spec: PipelineSpec, batch: BatchRange, alongside: bool) -> _FirstRead:
        """Kafka records, fetched on the executors and cached: fetching them
        from the brokers again for the quarantine pass would cost more than
        keeping them."""
        parsed = _marked(exact_read.kafka_records(self.spark, spec, batch.manifest), spec, batch).cache()
        return _FirstRead(batch, self._numbered_query(spec, parsed, batch, KAFKA_COLUMNS), parsed=parsed)

    def _read_files(self, spec: PipelineSpec, batch: BatchRange, alongside: bool) -> _FirstRead:
        """Files: local JSON and CSV files natively, but for those found
        suspect on the driver (`native_read.suspect_on_driver`); S3 objects,
        Parquet files and JSON with `unknown_fields: quarantine` the exact way.

        A native read `alongside` others (a `catch_up`, whose reads run at
        once) of no more than Spark's split size
        (``spark.sql.files.maxPartitionBytes``) is one task, where those
        reads occupy every core Spark has (`_reads_fill_cores`: on a bigger
        machine a read still wants several). Spark splits a
        read over every core, as if it ran alone, and the transform's
        aggregation then needs a shuffle and a second stage; in one
        partition the rows are already grouped, so the batch is one stage,
        and the reads beside it use the other cores. The first batch of a
        catch-up, read before any other, is one task as well: measured, it
        was faster so on a cold JVM, and every batch then runs the same
        plan, compiled once (docs/benchmarks.md).
        """
        entries = list(batch.manifest.files)
        remote = any(is_s3(f.uri) for f in entries)
        # Spark's JSON reader keeps no record's text, whose keys
        # `unknown_fields: quarantine` checks: such a source is read the exact way.
        strict = spec.source.unknown_fields == "quarantine"
        if remote or spec.source.format == "parquet" or strict or not self._native_reads:
            read = exact_read.parquet_records if spec.source.format == "parquet" else exact_read.text_records
            parsed = _marked(read(self.spark, spec, [f.uri if remote else spark_path(f.uri) for f in entries]), spec, batch)
            # S3 objects are cached for the same reason as Kafka records.
            parsed = parsed.cache() if remote else parsed
            return _FirstRead(batch, self._numbered_query(spec, parsed, batch), parsed=parsed)
        if spec.source.format == "csv":
            # Spark's CSV reader, parsing only the columns a query uses, no
            # longer sees a record with too few or too many columns as
            # malformed (from_csv, in the exact read, does).
            self.spark.conf.set("spark.sql.csv.parser.columnPruning.enabled", "false")
        suspect = [f for f in entries if native_read.suspect_on_driver(spec, _local_path(f.uri))]
        clean = [f for f in entries if f not in suspect]
        if not clean:
            parsed = _marked(exact_read.text_records(self.spark, spec, [spark_path(f.uri) for f in suspect]), spec, batch)
            return _FirstRead(batch, self._numbered_query(spec, parsed, batch), parsed=parsed)
        one_task = alongside and self._reads_fill_cores() and sum(f.size for f in clean) <= self._split_bytes()
        rows = native_read.records(self.spark, spec, [spark_path(f.uri) for f in clean], one_task=one_task)
        query = self._query(spec, _marked(rows, spec, batch, native=True), _split(self.spark, spec, native=True), batch)
        return _FirstRead(batch, query, native=(clean, suspect))

    def _reads_fill_cores(self) -> bool:
        """Whether the reads run at once occupy every core Spark has (a classic
        session's ``defaultParallelism``, no more than `reads_at_once`): only
        then is a read of one task no slower than a read spread over them."""
        return not _is_connect(self.spark) and self.spark.sparkContext.defaultParallelism <= self.reads_at_once

    def _split_bytes(self) -> int:
        """The most bytes Spark reads in one task (``spark.sql.files.maxPartitionBytes``)."""
        return int(self.spark._jsparkSession.sessionState().conf().filesMaxPartitionBytes())

    def _finish(self, spec: PipelineSpec, first: _FirstRead, out: Out | None) -> ComputeResult:
        """Run the first read; read the suspect files again by line, if any."""
        if first.native is None:
            return self._numbered_result(spec, first.query, first.parsed, out)
        clean, suspect = first.native
        updates, seen = self._execute(first.query, spec, out)
        found = _planned_files(clean, seen["suspect"])
        if not found and not suspect:
            return self._result(spec, updates, seen, out, first.query)
        if out is not None:
            # The first read's files hold records of files now read again by line.
            delete_files(out.sink.root, spark_state.written(updates))
            taken = seen.get(dedup_rows.TAKEN)
            if isinstance(taken, Staged):
                delete_files(taken.root, taken.files)
        suspect = suspect + found
        clean = [f for f in clean if f not in found]
        log.info("%d of %d file(s) hold a bad or unusual line: reading them by line", len(suspect), len(clean) + len(suspect))
        parsed = exact_read.text_records(self.spark, spec, [spark_path(f.uri) for f in suspect])
        if clean:
            native = native_read.records(self.spark, spec, [spark_path(f.uri) for f in clean])
            parsed = parsed.unionByName(_numbered_like_exact(spec, native))
        parsed = _marked(parsed, spec, first.batch)
        return self._numbered_result(spec, self._numbered_query(spec, parsed, first.batch), parsed, out)

    def _numbered_query(self, spec: PipelineSpec, parsed: DataFrame, batch: BatchRange, extra: tuple[str, ...] = ()) -> _Query:
        """The transform of the valid records of `parsed` (records numbered by line)."""
        return self._query(spec, parsed, _split(self.spark, spec, native=False, extra=extra), batch)

    def _numbered_result(self, spec: PipelineSpec, query: _Query, parsed: DataFrame, out: Out | None) -> ComputeResult:
        """Run `query`; then quarantine the failed records of `parsed`, if any."""
        try:
            updates, seen = self._execute(query, spec, out)
            if out is None:
                quarantine = self._quarantine(parsed) if seen["bad"] else QUARANTINE_COLUMNS.empty_table()
                return ComputeResult(validate_updates(spec, updates), quarantine, int(seen["records"]), **self._counts(spec, query, seen))
            result = self._result(spec, updates, seen, out, query)
            if seen["bad"]:
                written = spark_state.quarantine_job(parsed, out).toArrow()
                result.staged_quarantine = Staged(spark_state.written(written), QUARANTINE_SCHEMA, out.sink.quarantine_root)
            return result
        finally:
            if parsed.is_cached:
                parsed.unpersist()

    def _result(self, spec: PipelineSpec, updates: pa.Table, seen: dict[str, Any], out: Out | None, query: _Query | None = None) -> ComputeResult:
        """The batch's result: its rows checked (`validate_updates`), or, when
        the executors wrote them, their files checked (`spark_state.checked`)."""
        counts = self._counts(spec, query, seen)
        if out is None:
            return ComputeResult(validate_updates(spec, updates), QUARANTINE_COLUMNS.empty_table(), int(seen["records"]), **counts)
        staged = spark_state.checked(
            self.spark, spec, updates, seen.get(spark_state.RESULT_METRICS), out.sink, unique=bool(seen.get(spark_state.UNIQUE_KEYS))
        )
        return ComputeResult(out.sink.schema.empty_table(), QUARANTINE_COLUMNS.empty_table(), int(seen["records"]), staged=staged, **counts)

    @staticmethod
    def _counts(spec: PipelineSpec, query: _Query | None, seen: dict[str, Any]) -> dict[str, Any]:
        """A result's event-time and dedup fields (`ComputeResult`)."""
        return {**_event_counts(spec, seen), **_dedup_counts(query, seen)}

    def _query(self, spec: PipelineSpec, rows: DataFrame, split: _Split, batch: BatchRange) -> _Query:
        """The transform of the valid rows, with the split's metrics observed over all `rows`:
        built and analysed (a bad transform fails here), not run.

        The metrics are observed where the rows are made (`DataFrame.observe`),
        below the filter, and `_execute` reads them back from the query that
        ran the transform: the batch is one Spark job. (Not with an
        `Observation` object: it waits for a query whose own plan holds the
        observed node, and the transform's plan holds it only inside the
        `batch` view, so it would wait forever.)
        """
        valid, dedup = rows.observe(_METRICS, *split.metrics).where(split.valid), None
        if batch.remembered is not None:
            dedup = dedup_rows.deduplicated(self.spark, spec, valid, list(split.names), batch.remembered, spark_state.client(batch.remembered.path))
            valid = dedup.kept
        batch_view = valid.select(*split.fields)
        if not _is_connect(self.spark):
            result = self._transform(spec, batch_view)
            _check_result(spec, result.schema)
            return _Query(result, rows, split.metrics, dedup)
        # Through Spark Connect, the server returns the metrics of observed
        # nodes the request holds, not those inside a temporary view: the
        # transform's SQL goes with `batch` as a reference to the observed
        # relation (what ``spark.sql(text, batch=df)`` sends, without
        # rewriting the user's SQL into a format string).
        from pyspark.sql.connect.dataframe import DataFrame as ConnectDataFrame
        from pyspark.sql.connect.plan import SQL, SubqueryAlias

        result = ConnectDataFrame(SQL(spec.transform, None, None, [SubqueryAlias(batch_view._plan, "batch")]), self.spark)
        try:
            result.schema  # analyses the SQL: a bad transform fails here, by its own error
        except Exception as exc:
            raise _transform_failed(spec, exc) from exc
        _check_result(spec, result.schema)
        return _Query(result, rows, split.metrics, dedup)

    def _execute(self, query: _Query, spec: PipelineSpec | None = None, out: Out | None = None) -> tuple[pa.Table, dict[str, Any]]:
        """Run `query` (one Spark job): the transform's result, and the metrics.
        With `out`, the job writes the result as files, and returns what it
        wrote (`spark_state.result_job`), its own metrics among the others.
        With `dedup`, the same job takes the batch's ids (`dedup_rows.together`),
        and the metrics hold them (`dedup_rows.TAKEN`)."""
        job = query.result if out is None else spark_state.result_job(query.result, spec, out.sink)
        ids = self._ids_job(query, out)
        ran = job if ids is None else dedup_rows.together(job, ids)
        updates, taken = ran.toArrow(), {}
        if ids is not None:
            updates, ids_rows = dedup_rows.apart(updates, self._arrow_schema(job), self._arrow_schema(ids))
            taken = {dedup_rows.TAKEN: ids_rows if out is None else dedup_rows.staged(ids_rows, out.sink)}
        found = self._observed(ran, _METRICS)
        if not found:
            # Adaptive execution drops a stage whose output turned out empty
            # (no valid record at all) from the plan it reports, metrics and
            # all (a Spark Connect server reports the observation with no
            # values); count them apart then, which costs a second read only
            # when nothing in the batch was valid.
            log.debug("no observed metrics for this batch: counting apart")
            return updates, {**query.rows.agg(*query.metrics).first().asDict(), **taken}
        if out is not None:
            found = {**found, **self._written_metrics(ran, query.result, spec, out)}
        if query.dedup is not None:
            found[dedup_rows.METRICS] = self._observed(ran, dedup_rows.METRICS)
        return updates, {**found, **taken}

    def _arrow_schema(self, frame: DataFrame) -> pa.Schema:
        """The schema `frame.toArrow()` gives (as pyspark derives it, classic or Connect)."""
        from pyspark.sql.pandas.types import to_arrow_schema

        large = not _is_connect(self.spark) and self.spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes") == "true"
        return to_arrow_schema(frame.schema, error_on_duplicated_field_names_in_struct=True, timezone="UTC", prefers_large_types=large)

    @staticmethod
    def _ids_job(query: _Query, out: Out | None) -> DataFrame | None:
        """With `dedup`: the batch's ids, or (with `out`) the job writing them into the dedup table's folder."""
        if query.dedup is None:
            return None
        if out is None or out.sink.dedup_root is None:
            return query.dedup.ids
        return dedup_rows.writing(query.dedup.ids, out.sink, spark_state.client(out.sink.dedup_root))

    def _written_metrics(self, job: DataFrame, result: DataFrame, spec: PipelineSpec, out: Out) -> dict[str, Any]:
        """What the checks of a result the executors wrote need (`spark_state.checked`):
        the writing job's observed metrics, and whether the plan proves its keys unique."""
        return {
            spark_state.RESULT_METRICS: self._observed(job, spark_state.RESULT_METRICS),
            spark_state.UNIQUE_KEYS: spark_state.unique_keys(result, spec, out.sink.schema),
        }

    def _observed(self, job: DataFrame, name: str) -> dict[str, Any] | None:
        """The metrics observed as `name` in the plan `job` ran (None: none reported)."""
        if _is_connect(self.spark):
            return dict(job.executionInfo.flows if job.executionInfo else []).get(name)
        observed = job._jdf.queryExecution().observedMetrics().get(name)
        return _python_row(self.spark, observed.get()) if observed.isDefined() else None

    @staticmethod
    def _quarantine(parsed: DataFrame) -> pa.Table:
        """The failed records: file, line, raw text (cut as each record's reason allows) and reason."""
        from pyspark.sql import functions as F

        cut = F.length(RAW) > F.col(KEEP)
        bad = parsed.where(F.col(REASON).isNotNull()).select(
            F.col(FILE).alias("file"),
            F.col(LINE).cast("long").alias("line"),
            F.when(cut, F.col(RAW).substr(F.lit(1), F.col(KEEP))).otherwise(F.col(RAW)).alias("raw"),
            F.when(cut, F.concat(F.col(REASON), F.lit(" (raw text cut to "), F.col(KEEP).cast("string"), F.lit(" characters)")))
            .otherwise(F.col(REASON))
            .alias("reason"),
        )
        return bad.toArrow().cast(QUARANTINE_COLUMNS)

    def _process_versions(self, spec: PipelineSpec, batch: BatchRange, out: Out | None) -> ComputeResult:
        """A Delta source's batch: its rows come typed, so nothing is
        quarantined (but, with event time, what `_timed_versions` judges).
        Read by the driver, or by Spark (`source.reader`): see
        `spark_jobs.engine.delta_read`."""
        manifest = cast(DeltaManifest, batch.manifest)
        if manifest.reader_for(spec.source.reader) == "spark":
            return self._versions_by_spark(spec, batch, out)
        try:
            rows = delta_read.read_versions(manifest)
        except Exception as exc:
            raise _unreadable_versions(spec, manifest, exc) from exc
        if spec.event_time is not None:
            return self._timed_versions(spec, batch, delta_read.arrow_frame(self.spark, rows), out)
        if batch.remembered is not None:
            return self._untimed_versions(spec, batch, delta_read.arrow_frame(self.spark, rows), out)
        result = self._transform(spec, delta_read.arrow_frame(self.spark, rows))
        if out is None:
            return self._result(spec, result.toArrow(), {"records": rows.num_rows}, None)
        job = spark_state.result_job(result, spec, out.sink)
        written = job.toArrow()
        return self._result(spec, written, {"records": rows.num_rows, **self._written_metrics(job, result, spec, out)}, out)

    def _versions_by_spark(self, spec: PipelineSpec, batch: BatchRange, out: Out | None) -> ComputeResult:
        """The versions read by delta-spark on the executors, transformed in
        the same job, their rows counted as it runs (observed metrics)."""

        manifest = cast(DeltaManifest, batch.manifest)
        log.info("versions %d..%d of %s read by delta-spark on the executors", manifest.first, manifest.last, manifest.uri)
        try:
            rows = delta_read.spark_versions(self.spark, manifest)
            if spec.event_time is not None:
                return self._timed_versions(spec, batch, rows, out)
            return self._untimed_versions(spec, batch, rows, out)
        except MicrobatchError:
            raise
        except Exception as exc:
            if _no_delta_spark(exc):
                raise _delta_spark_missing(spec) from exc
            raise _unreadable_versions(spec, manifest, exc) from exc

    def _untimed_versions(self, spec: PipelineSpec, batch: BatchRange, rows: DataFrame, out: Out | None) -> ComputeResult:
        """A Delta source's rows, transformed in one job, their rows counted as it runs (observed metrics)."""
        from pyspark.sql import functions as F

        names = tuple(rows.columns)
        split = _Split(F.lit(True), [F.count(F.lit(1)).alias("records")], [dedup_rows.column(c) for c in names], names)
        query = self._query(spec, rows, split, batch)
        updates, seen = self._execute(query, spec, out)
        return self._result(spec, updates, seen, out, query)

    def _timed_versions(self, spec: PipelineSpec, batch: BatchRange, rows: DataFrame, out: Out | None) -> ComputeResult:
        """A Delta source's rows judged by event time (`event_marks.versions`):
        the late ones and those without an event time quarantined (each at its
        upstream version, as JSON), dropped or accepted as from any source,
        counted by the job that transforms them."""
        from pyspark.sql import functions as F

        manifest = cast(DeltaManifest, batch.manifest)
        names = tuple(rows.columns)
        marked = event_marks.versions(rows, spec, batch.watermark, manifest.uri, f"{manifest.first}..{manifest.last}")
        valid, timed = event_marks.split_terms(spec, F.col(REASON).isNull())
        split = _Split(valid, [F.count(F.lit(1)).alias("records"), F.count(REASON).alias("bad"), *timed], [F.col(spark_identifier(c)) for c in names], names)
        return self._numbered_result(spec, self._query(spec, marked, split, batch), marked, out)

    # -- internals ------------------------------------------------------------

    def _transform(self, spec: PipelineSpec, batch_df: DataFrame) -> DataFrame:
        try:
            # The view is the session's: two reads at once must not swap it
            # between one's creating it and its SQL's analysis (which binds
            # the view's plan into the result).
            with self._lock:
                batch_df.createOrReplaceTempView("batch")
                return self.spark.sql(spec.transform)
        except Exception as exc:
            raise _transform_failed(spec, exc) from exc


@contextmanager
def _writing_state(spec: PipelineSpec) -> Iterator[None]:
    """The executors writing the state's files (a merge, a fold): a failure a
    replay meets again is terminal (`failures.never_retried`); any other
    is the engine's, and retried."""
    try:
        yield
    except MicrobatchError:
        raise
    except Exception as exc:
        if is_commit_conflict(exc):
            raise  # delta-spark's MERGE lost a race: the protocol's step 4 judges it
        raise never_retried(spec, exc) or ComputeError(
            f"pipeline {spec.name}: writing the state's files failed in Spark: {first_line(exc, 500)}", pipeline=spec.name
        ) from exc


def _transform_failed(spec: PipelineSpec, exc: Exception) -> MicrobatchError:
    """The error for a transform's SQL that Spark refused. A Delta source
    read without delta-spark fails here too, not the transform's fault: the
    read is lazy, so Spark finds no data source named delta only when the
    SQL over it is analysed; and a session given Delta's catalog without its
    JARs fails every SQL."""
    if spec.source.type == "delta" and _no_delta_spark(exc):
        return _delta_spark_missing(spec)
    return TransformError(f"pipeline {spec.name}: the transform SQL failed: {first_line(exc, 10_000)}", pipeline=spec.name)


def _no_delta_spark(exc: BaseException | None) -> bool:
    """Whether `exc` says this Spark session lacks delta-spark: no data
    source named delta, or Delta's catalog set but its class not on the
    driver (spark-submit given the `--conf`s but not the `--jars`)."""
    text = str(exc)
    return ("DATA_SOURCE_NOT_FOUND" in text and "delta" in text.lower()) or (
        "Cannot find catalog plugin class" in text and "DeltaCatalog" in text
    )


def _delta_spark_missing(spec: PipelineSpec) -> SourceRefusedError:
    if under_spark_submit():
        fix = ("give spark-submit delta-spark's JARs and SQL extension (`--jars` with the JARs of "
               "~/.cache/microbatch/jars/spark-*/ and the two `--conf`s README.md names)")
    else:
        fix = (f"fetch its JARs (`make jars`; a run finds them itself, or in ${SPARK_JARS_ENV}); on Spark Connect, "
               "start the server with them and Delta's SQL extension (docker/README.md)")
    return SourceRefusedError(
        f"pipeline {spec.name}: the Delta source {spec.source_path} is read through delta-spark, which this Spark session does not "
        f"have (`source.reader: spark`, or `auto` off `local[*]` or for a batch of more than 4 MB on it; or Delta's catalog set without its JARs). To read it, "
        f"{fix}; or read it on the driver (`source.reader: driver`, without Delta's `--conf`s). Nothing was committed.",
        pipeline=spec.name,
        path=spec.source_path,
    )


def spark_path(uri: str) -> str:
    """The path to give Spark's file readers for a planned file's URI.

    Local files are planned as percent-encoded ``file://`` URIs, but Hadoop's
    `Path` does not decode its argument, so ``dt%3D2024-01-01`` would name a
    folder that does not exist; and Spark expands glob characters in every
    path it reads, so a file named ``a[1].json`` would not match itself. Hence
    the decoded path, with Hadoop's glob characters escaped. (S3 objects are
    fetched by key with boto3, not through Hadoop.)
    """
    if not uri.startswith("file:"):
        return uri
    path = _local_path(uri)
    return "file://" + re.sub(f"([{re.escape(HADOOP_GLOB_CHARS)}])", r"\\\1", path)


def _local_path(uri: str) -> str:
    """A local file's path from a URI as Spark or the manifest writes it."""
    return unquote(urlparse(uri).path)


@contextmanager
def _call_site(spark: SparkSession, spec: PipelineSpec, batch: BatchRange) -> Iterator[None]:
    """Name the Spark jobs this thread runs after the pipeline and its batch,
    and give the thread back what it had after.

    The job description is what the Spark UI lists a job by. The call site
    (short and long form) is also a saving: where none is set, Spark finds
    one by walking the driver thread's stack, py4j's frames and all, for
    every RDD and job it creates, dozens a batch, and in a long-lived session
    the JIT compiler kept spending CPU on that walk (Spark sets a dummy call
    site in its own loops for the same reason, `Utils.withDummyCallSite`).
    PySpark names each action's call site itself (``toArrow at ...``) but
    only in the short form, so without the long one the walk still ran. Not
    through Spark Connect, whose server names its own jobs.
    """
    if _is_connect(spark):
        yield
        return
    context = spark.sparkContext
    name = f"microbatch {spec.name}: {batch.manifest.describe()}"
    ours = {_DESCRIPTION: name, _CALL_SITE_SHORT: name, _CALL_SITE_LONG: f"{name}, offsets after {batch.end.to_dict()}"[:2000]}
    before = {key: context.getLocalProperty(key) for key in ours}
    for key, value in ours.items():
        context.setLocalProperty(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            context.setLocalProperty(key, value)


def _is_connect(spark: SparkSession) -> bool:
    """Whether `spark` is a Spark Connect client session (no JVM in this process)."""
    return not hasattr(spark, "_jsparkSession")


def _python_row(spark: SparkSession, jrow: Any) -> dict[str, Any]:
    """A JVM `Row` of observed metrics as a dict (as pyspark's `Observation.get` converts it)."""
    from pyspark.serializers import CPickleSerializer

    # By the name pyspark imports into the JVM's view: each step of a
    # package path would be a call into the JVM of its own.
    return CPickleSerializer().loads(spark.sparkContext._jvm.PythonSQLUtils.toPyRow(jrow)).asDict(recursive=False)


def _marked(records: DataFrame, spec: PipelineSpec, batch: BatchRange, *, native: bool = False) -> DataFrame:
    """`records` with their late ones marked against the batch's watermark
    (`spark_jobs.engine.event_marks`); as they are without event time."""
    if spec.event_time is None:
        return records
    return (event_marks.native if native else event_marks.numbered)(records, spec, batch.watermark)


def _dedup_counts(query: _Query | None, seen: dict[str, Any]) -> dict[str, Any]:
    """With `dedup`: the batch's duplicates, and the ids its kept records
    take, which its job collected here or wrote into the dedup table's
    folder (`_execute`, `spark_jobs.core.dedup`)."""
    if query is None or query.dedup is None:
        return {}
    # The ids are taken whatever the metrics say: an observation can be
    # missing (below), never an id the batch took.
    ids: pa.Table | Staged = seen[dedup_rows.TAKEN]
    # Adaptive execution drops the observed metrics of a stage that came
    # out empty (a transform that filtered out every kept record, say):
    # counted apart then.
    counts = seen.get(dedup_rows.METRICS) or query.dedup.counts.first().asDict()
    kept = ids.num_rows if isinstance(ids, pa.Table) else ids.rows
    return {"records_duplicate": dedup_rows.duplicates(counts, kept), "seen_ids": ids}


def _event_counts(spec: PipelineSpec, seen: dict[str, Any]) -> dict[str, Any]:
    """A result's event-time fields, from the batch's observed metrics."""
    if spec.event_time is None:
        return {}
    return {
        "records_late": int(seen.get(event_marks.LATE_METRIC) or 0),
        "newest_event_time": event_marks.as_datetime(seen.get(event_marks.NEWEST_METRIC)),
        "newest_late": event_marks.as_datetime(seen.get(event_marks.NEWEST_LATE_METRIC)),
        "oldest_on_time": event_marks.as_datetime(seen.get(event_marks.OLDEST_ON_TIME_METRIC)),
    }


def _numbered_like_exact(spec: PipelineSpec, native: DataFrame) -> DataFrame:
    """Natively read records of clean files, in the exact read's columns. They
    need no line number: none of them failed when first read. (One that
    fails now is in a file rewritten while the batch read it: it goes to
    quarantine, file named, rather than nowhere.)"""
    from pyspark.sql import functions as F

    changed = "the file changed while this batch read it (a first read found this record valid); land new data as new files"
    return native.select(
        FILE,
        F.lit(None).cast("long").alias(LINE),
        F.lit(None).cast("string").alias(RAW),
        *[spark_identifier(f.name) for f in spec.source.fields],
        F.when(F.col(native_read.SUSPECT), F.lit(changed)).alias(REASON),
        F.lit(MAX_RAW_CHARS).alias(KEEP),
    )


def _planned_files(files: list[SourceFile], spelled: list[str]) -> list[SourceFile]:
    """The planned files among paths as Spark spells them (percent-encoded URIs)."""
    named = {_local_path(path) for path in spelled}
    return [f for f in files if _local_path(f.uri) in named]


def _named_as_planned(result: ComputeResult, manifest: FilesManifest) -> ComputeResult:
    """Report quarantined records' files by the URIs in the batch's manifest.

    Spark reports a local file as Hadoop spells it (``file:/a/x%20y.json``);
    the manifest, the ledger and the quarantine should agree on one spelling.
    """
    quarantine = result.quarantine
    if quarantine.num_rows == 0:
        return result
    planned = {_local_path(uri): uri for uri in manifest.uris if uri.startswith("file:")}
    if not planned:
        return result
    files = [
        planned.get(_local_path(f), f) if f and f.startswith("file:") else f
        for f in quarantine.column("file").to_pylist()
    ]
    index = quarantine.schema.get_field_index("file")
    named = quarantine.set_column(index, quarantine.schema.field(index), pa.array(files, pa.string()))
    return replace(result, quarantine=named)


def _explain_kafka(spec: PipelineSpec, manifest: KafkaManifest, exc: Exception) -> Exception:
    """A failed Kafka batch: a fetch that could not finish names its partition and offsets."""
    if isinstance(exc, (TransformError, SourceError)):
        return exc
    found = re.search(r"cannot read (kafka://\S+)[^\n]*", str(exc))
    if found:
        return SourceError(
            f"pipeline {spec.name}: {found.group(0).strip()}. Nothing was consumed and nothing committed; a retry "
            "replays exactly the planned offsets. If retention deleted them, rewind to the last committed batch "
            "(`microbatch rewind SPEC --to-batch K`): the next run plans afresh and `source.on_data_loss` decides.",
            pipeline=spec.name,
            path=found.group(1),
        )
    return ComputeError(f"pipeline {spec.name}: the batch failed in Spark: {first_line(exc, 500)}", pipeline=spec.name)


def _explain(spec: PipelineSpec, manifest: FilesManifest, exc: Exception) -> Exception:
    """Turn a Spark failure into an error that names what to look at."""
    if isinstance(exc, (TransformError, SourceError)):
        return exc
    text = str(exc)
    # Spark's messages spell local paths as Hadoop does (percent-encoded).
    decoded = unquote(text)
    for entry in manifest.files:
        if entry.name in text or entry.name in decoded or entry.uri in text:
            return SourceError(
                f"pipeline {spec.name}: cannot read source file {entry.name} ({entry.uri}): "
                f"{first_line(exc)}. Nothing was consumed and nothing committed. "
                "The batch is already planned and a replay reads exactly its planned files, as they "
                "were when planned, so neither moving nor replacing the file gets past it: give up "
                "this batch with `microbatch rewind SPEC --to-batch K` (K, the last committed batch, "
                "as `microbatch status` shows it), then fix or move the file; the next run plans "
                "afresh from the files that are there.",
                pipeline=spec.name,
                path=entry.uri,
            )
    return ComputeError(f"pipeline {spec.name}: the batch failed in Spark: {first_line(exc, 500)}", pipeline=spec.name)


@dataclass(frozen=True)
class _Reader:
    """How this engine reads one kind of manifest (`_READERS`).

    On the executors: `first_read` builds the batch's read up to its
    transform, `explain` turns a failure into an error that names what to
    look at, `as_planned` reports the result in the manifest's own terms.
    On the driver (typed rows, nothing to quarantine): `read_on_driver`
    reads and transforms, and `columns_on_driver` gives the columns the
    transform is checked over (every time: they are the upstream's, which
    may change).
    """

    first_read: Callable[[SparkCompute, PipelineSpec, BatchRange, bool], _FirstRead] | None = None
    explain: Callable[[PipelineSpec, Any, Exception], Exception] = lambda spec, manifest, exc: exc
    as_planned: Callable[[ComputeResult, Any], ComputeResult] = lambda result, manifest: result
    read_on_driver: Callable[[SparkCompute, PipelineSpec, BatchRange, Out | None], ComputeResult] | None = None
    columns_on_driver: Callable[[PipelineSpec, Any], pa.Schema] | None = None


#: Each source's manifest and how this engine reads it: a source and its
#: reader are added together, here.
_READERS: dict[type, _Reader] = {
    FilesManifest: _Reader(first_read=SparkCompute._read_files, explain=_explain, as_planned=_named_as_planned),
    KafkaManifest: _Reader(first_read=SparkCompute._read_kafka, explain=_explain_kafka),
    DeltaManifest: _Reader(
        read_on_driver=SparkCompute._process_versions,
        # Spark reads a column-mapped table's versions with their own names
        # (a batch never spans a rename: `DeltaSource.plan`), so the batch's
        # columns are those of its last version; the driver's, the table's now.
        columns_on_driver=lambda spec, manifest: delta_read.batch_schema(
            spec.source_path, spec.source.read, manifest.last if manifest.reader_for(spec.source.reader) == "spark" and manifest.last >= 0 else None
        ),
    ),
}


def _unreadable_versions(spec: PipelineSpec, manifest: DeltaManifest, exc: Exception) -> SourceError:
    return SourceError(
        f"pipeline {spec.name}: cannot read versions {manifest.first}..{manifest.last} of source table "
        f"{manifest.uri}: {first_line(exc)}. If a VACUUM of that table removed their files, the "
        "versions are lost: rewind to the last committed batch (`microbatch rewind SPEC --to-batch K`) "
        "and set `source.on_data_loss: skip` only if losing them is acceptable. Nothing was committed.",
        pipeline=spec.name,
        path=manifest.uri,
    )


def _reader_of(spec: PipelineSpec, batch: BatchRange) -> _Reader:
    """The reader of the batch's manifest; an engine error for a kind it cannot read."""
    reader = _READERS.get(type(batch.manifest))
    if reader is None:
        raise ComputeError(
            f"pipeline {spec.name}: the Spark engine cannot read a {type(batch.manifest).__name__} batch",
            pipeline=spec.name,
        )
    return reader


def _check_result(spec: PipelineSpec, schema: StructType) -> None:
    """The transform's columns, and their types as the state will hold them
    (`check_result_types`), from its analysed schema: no job runs."""
    check_result_columns(spec, schema.names)
    check_result_types(spec, pa.schema([pa.field(f.name, _arrow_type(spec, f.name, f.dataType)) for f in schema.fields]))


def _arrow_type(spec: PipelineSpec, column: str, data_type: DataType) -> pa.DataType:
    """A result column's type as `toArrow()` will give it, or a `TransformError`
    for a type no Delta table holds as such."""
    from pyspark.sql.pandas.types import to_arrow_type

    spark_name = data_type.simpleString().upper()
    if "VARIANT" in spark_name:
        # `toArrow()` gives a VARIANT as a struct of its binary encoding:
        # stored so, it would no longer read as a VARIANT.
        raise TransformError(
            f"pipeline {spec.name}: the transform result column {column!r} is {spark_name}, which the state "
            "cannot hold as such: return it as STRING (`to_json(...)`) and parse it when reading",
            pipeline=spec.name,
        )
    try:
        return to_arrow_type(data_type, timezone="UTC")
    except Exception as exc:  # noqa: BLE001 - pyspark refuses types Arrow has no form for (a YEAR TO MONTH interval)
        raise TransformError(
            f"pipeline {spec.name}: the transform result column {column!r} is {spark_name}, which a Delta table "
            "cannot hold: cast it (an interval to its months or seconds as BIGINT, say)",
            pipeline=spec.name,
        ) from exc


def _planned_names(batch: BatchRange) -> dict[str, str]:
    """The planned URI of each local file of a files batch, by its decoded
    path: how quarantined records name their files, whatever Spark's spelling."""
    if not isinstance(batch.manifest, FilesManifest):
        return {}
    return {_local_path(uri): uri for uri in batch.manifest.uris if uri.startswith("file:")}
