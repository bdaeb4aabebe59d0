"""Late records marked on the executors, before the transform sees them.

`spark_jobs.core.event_time` says what a watermark is and when a record is
late; this module writes that as Spark columns over a batch's records, in the
two forms the reads give them (`spark_jobs.engine.spark_compute`):

* records numbered by line (the exact read, Kafka): a late record gets the
  quarantine's reason (`late: event time ... is before the watermark ...`)
  under `late: quarantine`, and a record without an event time gets its own;
* natively read rows: such rows mark their file suspect, and a suspect file is
  read again by line, where the reasons are given (late records are rare, and
  the quarantine names each by file and line);
* a Delta source's rows (`versions`): typed, none failed; they get the
  columns of numbered records, the upstream's version for a place and the
  row as JSON for its text, and are then marked as those are.

Either way the `LATE` column marks the late records, whatever the policy:
`split_terms` counts them and takes the newest event time among the records
the transform gets, as the batch's observed metrics (no second pass). It
also takes the newest late event time and the oldest on time: the gap
between them is every watermark that judges the batch's records alike,
which tells a read made ahead against a guessed watermark whether it stands
(`spark_jobs.core.event_time.judged_alike`).

The marks depend on the batch's watermark, so they are built for every read,
as SQL text parsed in one call each: built from `Column` objects, every
operator and function was a call into the JVM, about 70 of a read's 190
(docs/benchmarks.md, "Event time: windows beside Structured Streaming").
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from spark_jobs.core.event_time import iso
from spark_jobs.core.sql_text import spark_identifier
from spark_jobs.errors import SpecError
from spark_jobs.engine import native_read
from spark_jobs.engine.parse import FILE, KEEP, LINE, MAX_RAW_CHARS, RAW, REASON

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame

    from spark_jobs.core.spec import PipelineSpec

__all__ = ["LATE", "as_datetime", "check_column", "event_moment", "instant", "native", "numbered", "split_terms", "versions"]

#: Marks a valid record older than the batch's watermark.
LATE = "__late"
#: The metrics' names (`split_terms`), read back by `spark_compute`.
LATE_METRIC, NEWEST_METRIC = "late", "newest_event_micros"
NEWEST_LATE_METRIC, OLDEST_ON_TIME_METRIC = "newest_late_micros", "oldest_on_time_micros"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def numbered(parsed: DataFrame, spec: PipelineSpec, watermark: datetime | None, judged: str | None = None) -> DataFrame:
    """Records numbered by line (`REASON` marks the failed), late ones marked;
    under `late: quarantine` they fail with the reason that names their event
    time, and so does a valid record with no event time (always). Only the
    records `judged` (a SQL condition) says are judged at all (default: every one)."""
    from pyspark.sql import functions as F

    assert spec.event_time is not None
    moment, reason = _moment(spec), spark_identifier(REASON)
    valid = f"{reason} IS NULL" if judged is None else f"({reason} IS NULL AND {judged})"
    late = f"({valid} AND {_older(moment, watermark)})"
    # The column is an identifier (`spec.IDENTIFIER`): nothing in it to escape.
    cases = [f"WHEN {valid} AND {moment} IS NULL THEN 'no event time: {spec.event_time.column} is null (event_time.column)'"]
    if spec.event_time.late == "quarantine" and watermark is not None:
        cases.append(f"WHEN {late} THEN concat('late: event time ', {_iso(moment)}, ' is before the watermark {iso(watermark)}')")
    return parsed.withColumns({LATE: F.expr(late), REASON: F.expr(f"CASE {' '.join(cases)} ELSE {reason} END")})


def native(rows: DataFrame, spec: PipelineSpec, watermark: datetime | None) -> DataFrame:
    """Natively read rows, late ones marked; a file holding a row without an
    event time, or (`late: quarantine`) a late one, becomes suspect: it is
    read again by line, where `numbered` gives each its reason."""
    from pyspark.sql import functions as F

    assert spec.event_time is not None
    moment, suspect = _moment(spec), spark_identifier(native_read.SUSPECT)
    late = f"(NOT {suspect} AND {_older(moment, watermark)})"
    marks = [suspect, f"{moment} IS NULL", *([late] if spec.event_time.late == "quarantine" else [])]
    return rows.withColumns({LATE: F.expr(late), native_read.SUSPECT: F.expr(" OR ".join(marks))})


def versions(rows: DataFrame, spec: PipelineSpec, watermark: datetime | None, table: str, span: str) -> DataFrame:
    """A Delta source's rows as records numbered by line, marked (`numbered`):
    a quarantined row is placed at `table`'s version (``<table>@v<version>``;
    `span`, the batch's versions, where the rows do not say theirs) and
    kept as JSON.

    Of a change feed's rows only inserts are judged: an update's pre-image
    and a delete take back a row taken before, with that row's old event
    time, and an update's post-image goes with its pre-image. Judged apart,
    a pre-image found late would be quarantined while its post-image is
    taken, and a downstream netting the two would count the row twice."""
    from pyspark.sql import functions as F

    version = F.col("_commit_version").cast("string") if "_commit_version" in rows.columns else F.lit(span)
    framed = rows.select(
        "*",
        F.concat(F.lit(f"{table}@v"), version).alias(FILE),
        F.lit(None).cast("long").alias(LINE),
        F.to_json(F.struct(*[F.col(spark_identifier(c)) for c in rows.columns])).alias(RAW),
        F.lit(None).cast("string").alias(REASON),
        F.lit(MAX_RAW_CHARS).alias(KEEP),
    )
    judged = "`_change_type` = 'insert'" if "_change_type" in rows.columns else None
    return numbered(framed, spec, watermark, judged)


def check_column(spec: PipelineSpec, columns: pa.Schema, where: str) -> None:
    """A Delta source's event time must be a timestamp or date column of the
    batch's rows (known only from the upstream's table): else the run stops
    before any write, naming the field."""
    import pyarrow as pa

    assert spec.event_time is not None
    name = spec.event_time.column
    if name not in columns.names:
        problem = f"event_time.column {name!r} is not a column of the source table {where} (its columns: {', '.join(columns.names)})"
    elif not (pa.types.is_timestamp(columns.field(name).type) or pa.types.is_date(columns.field(name).type)):
        problem = f"event_time.column {name!r} is {columns.field(name).type} in the source table {where}: an event time is a TIMESTAMP or DATE column"
    else:
        return
    raise SpecError(spec.spec_path, [problem])


def split_terms(spec: PipelineSpec, valid: Column) -> tuple[Column, list[Column]]:
    """For a spec with event time: which rows the transform gets (`valid`,
    less the late ones under `late: drop`) and the metrics observed over all
    rows: the late count, the newest event time among those it gets, the
    newest among the late and the oldest among the valid ones not late (in
    microseconds, `as_datetime` reads them). The last two bound the
    watermarks that would have judged every record as this one did; they
    count a change feed's unjudged rows as on time, which narrows the bound,
    never widens it."""
    from pyspark.sql import functions as F

    assert spec.event_time is not None
    micros = F.unix_micros(event_moment(spec))
    on_time = valid & ~F.col(LATE)
    if spec.event_time.late == "drop":
        valid = on_time
    metrics = [
        F.count(F.when(F.col(LATE), F.lit(1))).alias(LATE_METRIC),
        F.max(F.when(valid, micros)).alias(NEWEST_METRIC),
        F.max(F.when(F.col(LATE), micros)).alias(NEWEST_LATE_METRIC),
        F.min(F.when(on_time, micros)).alias(OLDEST_ON_TIME_METRIC),
    ]
    return valid, metrics


def as_datetime(micros: int | None) -> datetime | None:
    """An event time as observed (microseconds since the epoch, UTC), held
    within Python's calendar: Spark holds years before 1 and after 9999,
    which become its first and last moments (order kept, so a bound taken
    from one stays on its side of every watermark Python can hold)."""
    if micros is None:
        return None
    try:
        return _EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        return (datetime.max if micros > 0 else datetime.min).replace(tzinfo=UTC)


def event_moment(spec: PipelineSpec) -> Column:
    """The event time as a TIMESTAMP (a DATE counts from its midnight, UTC: the session's zone)."""
    from pyspark.sql import functions as F

    return F.expr(_moment(spec))


def _moment(spec: PipelineSpec) -> str:
    """`event_moment` as SQL text."""
    assert spec.event_time is not None
    return f"CAST({spark_identifier(spec.event_time.column)} AS TIMESTAMP)"


def _older(moment: str, watermark: datetime | None) -> str:
    """Whether `moment` is before `watermark`, as SQL text (never, before the
    first watermark; null moments are not late)."""
    if watermark is None:
        return "false"
    return f"coalesce({moment} < timestamp_micros({_micros(watermark)}), false)"


def instant(moment: datetime) -> Column:
    """`moment` as a Spark timestamp, exactly: by its microseconds since
    1970 (`F.lit` of a datetime before 1582 is shifted by Spark's change of
    calendar, by days)."""
    from pyspark.sql import functions as F

    return F.expr(f"timestamp_micros({_micros(moment)})")


def _micros(moment: datetime) -> int:
    return (moment.astimezone(UTC) - _EPOCH) // timedelta(microseconds=1)


def _iso(moment: str) -> str:
    """`moment` spelled as `iso` spells a watermark, as SQL text."""
    text = f"""date_format({moment}, "yyyy-MM-dd'T'HH:mm:ss.SSSSSS")"""
    return f"concat(regexp_replace({text}, '[.]000000$', ''), 'Z')"
