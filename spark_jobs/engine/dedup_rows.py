"""Duplicates dropped on the executors, before the transform sees the records.

`spark_jobs.core.dedup` says which records are duplicates; this module
writes that as Spark columns over a batch's valid records, in the one job
that transforms them (`spark_jobs.engine.spark_compute`):

* each record's id is the JSON text of its key fields (`ID`; the session's
  time zone is UTC, so a timestamp's text is the same in every run);
* the remembered ids (the dedup table's files, read by the executors) mark
  the records they name, with a left join on the id;
* a window over the id ranks the batch's records, earliest event time
  first, then by their fields: the first, if not remembered, is kept;
* both counts are observed metrics of the same job (`METRICS`);
* the ids to remember, the kept records' ids with their event times
  (`Deduplicated.ids`), come out of the same job as the transform's result
  (`together`, `apart`): the two branches share the plan up to the window
  over the ids, and Spark runs that part once, its shuffle reused, where a
  second job read and parsed the batch's records again (no cache holds
  them, or leaks, between the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from spark_jobs.core import dedup
from spark_jobs.core.staged import Sink, Staged
from spark_jobs.engine import event_marks, spark_files
from spark_jobs.errors import SpecError

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import DataType

    from spark_jobs.core.spec import PipelineSpec

__all__ = ["METRICS", "TAKEN", "Deduplicated", "apart", "column", "deduplicated", "duplicates", "staged", "together", "writing"]

#: The columns the marks use (not the transform's: it gets its fields only).
ID, SEEN, RANK = "__dedup_id", "__dedup_seen", "__dedup_rank"
_MARKS = frozenset({ID, SEEN, RANK})
#: The name of the observed metrics, and their two counts.
METRICS = "microbatch_dedup"
_CONSIDERED, _KEPT = "considered", "kept"
#: What a batch's job saw, under this name: the ids it took (`apart`), or the files it wrote them to (`staged`).
TAKEN = "microbatch_dedup_taken"
#: `together`'s columns: whose row it is (0: the result's, 1: an id's), and the prefix of the ids' columns.
_PART, _IDS = "__dedup_part", "__dedup_ids_"


@dataclass(frozen=True)
class Deduplicated:
    """The batch's records left after the duplicates, and the ids they take."""

    kept: DataFrame
    #: `dedup.SCHEMA`'s `id` and `event_time` of each kept record.
    ids: DataFrame
    #: The two counts, as a job of their own: for a batch whose observed
    #: metrics adaptive execution dropped with a stage that came out empty.
    counts: DataFrame


def deduplicated(spark: SparkSession, spec: PipelineSpec, valid: DataFrame, fields: list[str], remembered: dedup.Remembered, client: dict[str, Any]) -> Deduplicated:
    """`valid` (the records the transform would get, `fields` among their
    columns) less the duplicates: their remembered ids read from the
    dedup table's files (`client`: the store's settings the executors need)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    assert spec.dedup is not None
    missing = [name for name in spec.dedup.key if name not in fields]
    if missing:  # (a Delta source's columns are its table's: known only now)
        named = ", ".join(map(repr, missing))
        raise SpecError(spec.spec_path, [f"dedup.key names {named}, not a column of the source's records ({', '.join(fields)}): name columns it has"])
    taken = [name for name in fields if name.lower() in _MARKS]
    if taken:  # (a files source's schema may not name them; a Delta table's columns may)
        raise SpecError(spec.spec_path, [
            f"dedup: the source's column {taken[0]!r} has a name the job gives its own column while it drops "
            f"duplicates ({', '.join(sorted(_MARKS))}): rename it in the source table, or drop dedup"
        ])
    moment = event_marks.event_moment(spec) if spec.event_time is not None else None
    types = {f.name: f.dataType for f in valid.schema.fields}
    marked = valid.withColumn(ID, F.to_json(F.struct(*[_id_part(name, types[name]) for name in spec.dedup.key])))
    files = remembered.files()
    if files:
        seen = spark_files.read_files(spark, remembered.path, files, dedup.SCHEMA, client)
        seen = seen.where((F.col("pipeline") == F.lit(remembered.pipeline)) & F.expr(remembered.where))
        if remembered.since is not None:
            # (An id taken before `event_time` was declared has no event time: remembered.)
            seen = seen.where(F.col("event_time").isNull() | (F.col("event_time") >= event_marks.instant(remembered.since)))
        seen = seen.select(F.col("id").alias(SEEN)).distinct()
        marked = marked.join(seen, marked[ID] == seen[SEEN], "left")
    else:
        marked = marked.withColumn(SEEN, F.lit(None).cast("string"))
    order = ([moment.asc_nulls_last()] if moment is not None else []) + [column(n).asc_nulls_first() for n in fields if _orderable(types.get(n))]
    ranked = marked.withColumn(RANK, F.row_number().over(Window.partitionBy(ID).orderBy(*order)))
    keep = (F.col(RANK) == 1) & F.col(SEEN).isNull()
    counts = [F.count(F.lit(1)).alias(_CONSIDERED), F.count(F.when(keep, F.lit(1))).alias(_KEPT)]
    kept = ranked.observe(METRICS, *counts).where(keep)
    # Every id is stamped with its event time when there is one, `within` or
    # not: `within` added later then forgets by it.
    stamp = moment if moment is not None else F.lit(None).cast("timestamp")
    return Deduplicated(kept, kept.select(F.col(ID).alias("id"), stamp.alias("event_time")), ranked.agg(*counts))


def writing(ids: DataFrame, sink: Sink, client: dict[str, Any]) -> DataFrame:
    """The job writing a batch's `ids` into the dedup table's folder, each
    with the batch's position (as `dedup.SeenIds.write` does), not yet run:
    a row for each file it writes (`staged` reads them)."""
    from pyspark.sql import functions as F

    assert sink.dedup_root is not None
    rows = ids.select(
        F.lit(sink.pipeline).alias("pipeline"),
        F.lit(sink.epoch).cast("long").alias("epoch"),
        F.lit(sink.batch_id).cast("long").alias("batch_id"),
        F.col("id"),
        F.col("event_time"),
    )
    return spark_files.writing(rows, sink.dedup_root, dedup.SCHEMA, client)


def staged(written: pa.Table, sink: Sink) -> Staged:
    """The files a `writing` job wrote (its rows, `written`), for the dedup table's fenced commit."""
    assert sink.dedup_root is not None
    return Staged(spark_files.written(written), dedup.SCHEMA, sink.dedup_root)


def together(result: DataFrame, ids: DataFrame) -> DataFrame:
    """One job of `result` (the transform's rows, or the files a job wrote
    them to) and `ids` (the batch's ids, or the files they went to), for
    `apart` to split: a row of either, its columns first, then the other's
    (null), with `_PART` saying whose.

    Both come from the same records through the same window over the ids:
    Spark runs that part of the plan once and reads its shuffle for both
    (an exchange reused), so the batch's records are read and parsed once."""
    from pyspark.sql import functions as F

    def own(frame: DataFrame, prefix: str) -> list[Column]:
        # Nested fields made nullable: a row of the other part holds null there.
        return [column(f.name).cast(_nullable(f.dataType)).alias(prefix + f.name) for f in frame.schema.fields]

    def none(frame: DataFrame, prefix: str) -> list[Column]:
        return [F.lit(None).cast(_nullable(f.dataType)).alias(prefix + f.name) for f in frame.schema.fields]

    first = result.select(F.lit(0).alias(_PART), *own(result, ""), *none(ids, _IDS))
    second = ids.select(F.lit(1).alias(_PART), *none(result, ""), *own(ids, _IDS))
    return first.unionAll(second)


def apart(both: pa.Table, result: pa.Schema, ids: pa.Schema) -> tuple[pa.Table, pa.Table]:
    """`together`'s rows, as the two frames would each have given them
    (`result` and `ids`: their `toArrow` schemas, nullability and all)."""
    import pyarrow.compute as pc

    # (By position: a transform's column may have any name, `_PART`'s too.)
    part, width = both.column(0), len(result)
    mine = both.filter(pc.equal(part, 0)).select(list(range(1, 1 + width))).rename_columns(result.names)
    theirs = both.filter(pc.equal(part, 1)).select(list(range(1 + width, both.num_columns))).rename_columns(ids.names)
    return mine.cast(result), theirs.cast(ids)


def _nullable(kind: DataType) -> DataType:
    """`kind` with every nested field nullable (a struct's, an array's
    elements, a map's values)."""
    from pyspark.sql.types import ArrayType, MapType, StructField, StructType

    if isinstance(kind, StructType):
        return StructType([StructField(f.name, _nullable(f.dataType), True, f.metadata) for f in kind.fields])
    if isinstance(kind, ArrayType):
        return ArrayType(_nullable(kind.elementType), True)
    if isinstance(kind, MapType):
        return MapType(_nullable(kind.keyType), _nullable(kind.valueType), True)
    return kind


def duplicates(seen: dict[str, Any] | None, kept: int) -> int:
    """The records a batch dropped as duplicates: those its `METRICS` saw
    less the `kept` ones (counted from the ids the batch took)."""
    return int((seen or {}).get(_CONSIDERED) or 0) - kept


def _id_part(name: str, kind: DataType) -> Column:
    """A key field as its id holds it: a timestamp as text to the
    microsecond (JSON's default format stops at the millisecond), a float's
    -0.0 as 0.0 (equal, as `dropDuplicates` has them)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType, FloatType, TimestampNTZType, TimestampType

    part = column(name)
    if isinstance(kind, (TimestampType, TimestampNTZType)):
        part = F.date_format(part, "yyyy-MM-dd HH:mm:ss.SSSSSS")
    elif isinstance(kind, (DoubleType, FloatType)):
        part = part + F.lit(0.0).cast(kind)
    return part.alias(name)


def column(name: str) -> Column:
    """A column by its name as the records have it (a Delta source's may hold any character)."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def _orderable(kind: DataType | None) -> bool:
    """Whether rows can be ordered by a column of `kind` (nothing holding a MAP can)."""
    return kind is not None and "map<" not in kind.simpleString()
