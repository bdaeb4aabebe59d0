"""The state's rows on Spark's executors: a batch's result and quarantined
records written as files, a merged state's files merged with a batch, an
appended state's files folded.

Everything here runs Spark jobs whose tasks read and write the tables' data
files (`spark_jobs.engine.spark_files`); what comes back to the job's
process is one short row a file, and the few numbers the protocol checks
(rows written, null keys, a duplicate key's example). The job's process
commits the files (`spark_jobs.core.staged`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from spark_jobs.core.compute import check_unique_keys, duplicate_keys_error, null_keys_error
from spark_jobs.core.folding import state_sql
from spark_jobs.core.quarantine import SCHEMA as QUARANTINE_SCHEMA
from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec
from spark_jobs.core.sql_text import spark_identifier
from spark_jobs.core.staged import IN_PROCESS_ROWS, Sink, Staged, StagedFile, delete_files, read_staged
from spark_jobs.core.state import merge_expression
from spark_jobs.engine.parse import FILE, KEEP, LINE, RAW, REASON
from spark_jobs.engine import spark_files
from spark_jobs.engine.spark_files import read_files, working_names, writing, writing_changes, written
from spark_jobs.storage.s3 import client_settings, is_s3

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "Out", "RESULT_METRICS", "UNIQUE_KEYS", "checked", "fold_files", "merge_files", "quarantine_job", "result_job", "rewrite_files",
    "unique_keys",
]

log = logging.getLogger("microbatch")

#: The name of the observed metrics of a batch's written result.
RESULT_METRICS = "microbatch_result"
#: Beside them: whether the result's plan proves its keys unique (`unique_keys`).
UNIQUE_KEYS = "microbatch_unique_keys"


@dataclass(frozen=True)
class Out:
    """Where a batch's rows go, and how its quarantined records name their files."""

    sink: Sink
    #: The planned URI of each local file by its decoded path (Spark spells them its own way).
    planned: dict[str, str] = field(default_factory=dict)


def client(root: str) -> dict[str, Any]:
    """The S3 client's settings the executors need for `root` (none for a local folder)."""
    return client_settings() if is_s3(root) else {}


def result_job(result: DataFrame, spec: PipelineSpec, sink: Sink) -> DataFrame:
    """The job writing a batch's result into `sink.root`: its keys and values
    (cast to the state's types by the writing tasks) and the batch id, with
    the rows and the rows with a null key observed (`RESULT_METRICS`)."""
    from pyspark.sql import functions as F

    keys = [F.col(spark_identifier(k)) for k in spec.state.keys]
    null_key = F.lit(False)
    for key in keys:
        null_key = null_key | key.isNull()
    columns = [F.col(spark_identifier(name)) for name in sink.schema.names if name != BATCH_COLUMN]
    frame = result.select(*columns, F.lit(sink.batch_id).cast("long").alias(BATCH_COLUMN))
    frame = frame.observe(RESULT_METRICS, F.count(F.lit(1)).alias("rows"), F.count(F.when(null_key, 1)).alias("null_keys"))
    return writing(frame, sink.root, sink.schema, client(sink.root))


def quarantine_job(parsed: DataFrame, out: Out) -> DataFrame:
    """The job writing the failed records of `parsed` into the quarantine
    table's folder, each with the batch's position (as `Quarantine.write` does)."""
    from pyspark.sql import functions as F

    sink = out.sink
    cut = F.length(RAW) > F.col(KEEP)
    now = datetime.now(timezone.utc)
    bad = parsed.where(F.col(REASON).isNotNull()).select(
        F.lit(sink.pipeline).alias("pipeline"),
        F.lit(sink.epoch).cast("long").alias("epoch"),
        F.lit(sink.batch_id).cast("long").alias("batch_id"),
        F.col(FILE).alias("file"),
        F.col(LINE).cast("long").alias("line"),
        F.when(cut, F.col(RAW).substr(F.lit(1), F.col(KEEP))).otherwise(F.col(RAW)).alias("raw"),
        F.when(cut, F.concat(F.col(REASON), F.lit(" (raw text cut to "), F.col(KEEP).cast("string"), F.lit(" characters)")))
        .otherwise(F.col(REASON))
        .alias("reason"),
        F.lit(now).alias("quarantined_at"),
    )
    rename = ("file", out.planned) if out.planned else None
    return writing(bad, sink.quarantine_root, QUARANTINE_SCHEMA, client(sink.quarantine_root), rename)


def checked(
    spark: SparkSession, spec: PipelineSpec, result: pa.Table, seen: dict[str, Any] | None, sink: Sink, *, unique: bool = False
) -> Staged:
    """The files a `result_job` wrote, once their rows pass the checks every
    result passes (`compute.validate_updates`): no null key, no key twice
    (`unique`: the result's plan proves it, `unique_keys`). A failed check
    deletes them (no commit names them) and raises."""
    staged = Staged(written(result), sink.schema, sink.root)
    nulls = int((seen or {}).get("null_keys") or 0)
    try:
        if nulls:
            raise null_keys_error(spec, nulls)
        if not unique:
            _check_unique(spark, spec, staged, sink.root)
    except Exception:
        delete_files(sink.root, staged.files)
        raise
    return staged


def unique_keys(result: DataFrame, spec: PipelineSpec, schema: pa.Schema) -> bool:
    """Whether Spark's optimizer proves that `result` holds each key once as
    written in `schema` (the state's types): one of the distinct-key sets of
    its optimized plan (`distinctKeys`: the grouping columns of a GROUP BY, a
    DISTINCT's columns, carried through projections, aliases and filters) is
    made of key columns only, and each key is written in its own type. (A
    key cast to a narrower type, DOUBLE to the state's FLOAT say, may turn
    two keys into one: a review committed such a duplicate. Those are
    checked in the files, as written.)

    The proof Spark's own optimizer relies on (to drop a redundant
    aggregate, say), here to spare the written files a second Spark job
    that groups them by key (a shuffle of every key). Only a classic session shows its plan: over Spark Connect, or
    with `spark.sql.optimizer.propagateDistinctKeys.enabled` off, it proves
    nothing and the files are checked."""
    jdf = getattr(result, "_jdf", None)
    if jdf is None:
        return False
    from py4j.protocol import Py4JError
    from pyspark.sql.pandas.types import to_arrow_type

    types = {f.name: f.dataType for f in result.schema.fields}
    for key in spec.state.keys:
        try:
            # In the state's terms, as the result is written (`SparkCompute.result_schema`).
            same = key in types and to_arrow_type(types[key], timezone="UTC") == schema.field(key).type
        except Exception as exc:  # noqa: BLE001 - no proof is no failure: the written files are checked
            log.debug("key %s of the result has no Arrow type to compare (%s): its files are checked", key, exc)
            same = False
        if not same:
            return False

    try:
        plan = jdf.queryExecution().optimizedPlan()
        names = {a.exprId().id(): a.name() for a in _scala(plan.output())}
        keys = set(spec.state.keys)
        for keyset in _scala(plan.distinctKeys()):
            columns = list(_scala(keyset))
            found = {names.get(c.exprId().id()) for c in columns if c.getClass().getSimpleName() == "AttributeReference"}
            if columns and len(found) == len(columns) and found <= keys:
                return True
    except Py4JError as exc:
        log.debug("the result's plan shows no distinct keys (%s): its files are checked", exc)
    return False


def _scala(collection: Any) -> Iterator[Any]:
    """The elements of a Scala collection, through py4j."""
    items = collection.iterator()
    while items.hasNext():
        yield items.next()


def _check_unique(spark: SparkSession, spec: PipelineSpec, staged: Staged, root: str) -> None:
    """No key twice: a small result's keys are read back here (its key
    columns only), a big one's are counted by Spark."""
    keys = list(spec.state.keys)
    if staged.rows < 2:
        return
    if staged.rows <= IN_PROCESS_ROWS:
        check_unique_keys(spec, read_staged(staged, keys))
        return
    from pyspark.sql import functions as F

    schema = pa.schema([staged.schema.field(k) for k in keys])
    frame = read_files(spark, root, [f.path for f in staged.files], schema, client(root))
    found = frame.groupBy(*[spark_identifier(k) for k in keys]).count().where(F.col("count") > 1).limit(1).collect()
    if found:
        raise duplicate_keys_error(spec, None, {k: found[0][k] for k in keys})


def merge_files(
    spark: SparkSession, spec: PipelineSpec, root: str, schema: pa.Schema, rewritten: list[str], updates: Staged, *,
    changes: bool = False, vectors: dict[str, dict[str, Any]] | None = None,
) -> tuple[StagedFile, ...]:
    """The state's files `rewritten` merged with `updates` by the spec's
    rules, as the MERGE does (`state.merge_expression`), written as new files
    into `root`: a full outer join on the keys, every column of a key the
    batch does not touch kept as it is. With `changes`, each task also
    writes the change data of its rows, as delta-rs's MERGE would
    (`spark_files.writing_changes`: their paths start with `CHANGE_DATA`).
    `vectors`: the deletion vectors of the files that carry one (by path),
    whose rows they delete are not read, so not written again."""
    from pyspark.sql import functions as F

    keys = list(spec.state.keys)
    settings = client(root)
    old = read_files(spark, root, rewritten, schema, settings, vectors).alias("t")
    new = read_files(spark, updates.root, [f.path for f in updates.files], updates.schema, client(updates.root)).alias("s")
    condition = None
    for key in keys:
        equal = F.col(f"t.{spark_identifier(key)}") == F.col(f"s.{spark_identifier(key)}")
        condition = equal if condition is None else condition & equal
    joined = old.join(new, condition, "full_outer")
    untouched = F.col(f"s.{spark_identifier(keys[0])}").isNull()
    inserted = F.col(f"t.{spark_identifier(keys[0])}").isNull()
    columns = []
    for name in schema.names:
        t, s = F.col(f"t.{spark_identifier(name)}"), F.col(f"s.{spark_identifier(name)}")
        if name in keys:
            value = F.coalesce(s, t)
        elif name == BATCH_COLUMN:
            value = F.when(untouched, t).otherwise(s)
        elif name not in updates.schema.names:
            value = t  # a column the batch does not return (it cannot: the spec's columns are the batch's)
        else:
            merged = F.expr(merge_expression(name, spec.state.merge[name], quote=spark_identifier))
            value = F.when(untouched, t).when(inserted, s).otherwise(merged)
        columns.append(value.alias(name))
    if not changes:
        return written(writing(joined.select(*columns), root, schema, settings).toArrow())
    prefix, change_name = working_names(schema.names)
    before = [F.col(f"t.{spark_identifier(name)}").alias(prefix + name) for name in schema.names]
    change = F.when(untouched, F.lit(None)).when(inserted, F.lit("insert")).otherwise(F.lit("update")).alias(change_name)
    return written(writing_changes(joined.select(*columns, *before, change), root, schema, settings).toArrow())


def rewrite_files(
    spark: SparkSession, spec: PipelineSpec, root: str, schema: pa.Schema, rewritten: list[str], updates: Staged
) -> tuple[StagedFile, ...]:
    """The state's files `rewritten` with a small batch (`updates`) merged
    in, file by file, by the executors (`spark_files.rewrite_files`): no
    shuffle of the state's rows, as the full outer join of `merge_files`
    makes, and no row of them in this process, as delta-rs's MERGE here.

    A `min` or `max` of a nested column (a STRUCT, an ARRAY: Spark orders
    them field by field) has no pyarrow comparison: such a state is merged
    by the join, whose rules are Spark's SQL."""
    rules = dict(spec.state.merge)
    if any(rules.get(f.name) in ("min", "max") and pa.types.is_nested(f.type) for f in schema):
        return merge_files(spark, spec, root, schema, rewritten, updates)
    keys = list(spec.state.keys)
    return spark_files.rewrite_files(spark, root, schema, client(root), rewritten, updates, keys, rules, BATCH_COLUMN)


def fold_files(spark: SparkSession, spec: PipelineSpec, root: str, schema: pa.Schema, paths: list[str]) -> tuple[StagedFile, ...]:
    """An appended state's files `paths` folded into one row per key by the
    query that reads it (`folding.state_sql`, in Spark's dialect), written
    as new files into `root`."""
    rows = read_files(spark, root, paths, schema, client(root))
    view = f"microbatch_fold_{abs(hash((root, tuple(paths)))) % 10**12}"
    rows.createOrReplaceTempView(view)
    try:
        folded = spark.sql(state_sql(spec.state, schema, view, quote=spark_identifier))
        return written(writing(folded, root, schema, client(root)).toArrow())
    finally:
        spark.catalog.dropTempView(view)
