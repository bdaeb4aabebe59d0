"""The exact read: every record with its file and line number.

Text files (JSON lines, CSV) are read whole and split into lines by Spark,
so each record keeps its file and line number for quarantine: the read that
defines what a record is. It costs more than Spark's own readers (a file is
one value before it is split; nothing is parsed straight from bytes), so
local files are read natively first (`spark_jobs.engine.native_read`) and
only files that hold a suspect line come here. S3 objects, Parquet (whose
row numbers Spark gives anyway) and Kafka records (numbered by their
offsets) are read this way always.
"""

from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING

from spark_jobs.core.spec import KAFKA_COLUMNS, PipelineSpec
from spark_jobs.engine import kafka_read, s3_read
from spark_jobs.engine.parse import FILE, KEEP, LINE, MAX_RAW_CHARS, RAW, REASON, Check, parse_lines, reason, value_checks
from spark_jobs.storage.s3 import client_settings, is_s3

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from spark_jobs.sources.kafka import KafkaManifest

__all__ = ["kafka_records", "parquet_records", "text_records"]


def text_records(spark: SparkSession, spec: PipelineSpec, paths: list[str]) -> DataFrame:
    """Parsed records of JSON-lines or CSV files, numbered by line.

    `paths` are as Spark reads them (`spark_jobs.engine.spark_compute.spark_path`) or S3 URIs.
    """
    from pyspark.sql import functions as F

    # Spark decodes text as UTF-8, replacing bytes that are not UTF-8 with
    # U+FFFD, and `split` works on the decoded text: validity can only be
    # tested on the whole file, before the split. In a file that is not
    # valid UTF-8, the lines holding U+FFFD are the ones that were not.
    #
    # Validity is taken in a select of its own, before the explode: in the
    # same select it would be computed over the explode's output, so every
    # line's row would carry (and copy) its whole file, quadratic memory
    # that ran a 15k-record batch out of heap.
    files = _whole_files(spark, paths).select(FILE, F.expr("is_valid_utf8(value)").alias("__utf8_file"), "value")
    lines = files.select(FILE, "__utf8_file", F.posexplode(F.split(F.col("value"), "\r?\n")).alias("__pos", RAW))
    # A byte-order mark is not part of the first record (editors on
    # Windows write one; left in, it breaks the first JSON object or header).
    lines = lines.withColumn(RAW, F.when(F.col("__pos") == 0, F.regexp_replace(RAW, "^\ufeff", "")).otherwise(F.col(RAW)))
    # Whitespace-only lines (tabs included) are not records.
    lines = lines.where(F.col(RAW).rlike("\\S")).withColumn(LINE, F.col("__pos") + 1)
    lines = lines.withColumn("__utf8", F.col("__utf8_file") | ~F.col(RAW).contains("\ufffd"))
    checks: list[Check] = []
    if spec.source.format == "csv" and spec.source.csv.header:
        lines, header_reason = _csv_header(lines, spec)
        checks.append(header_reason)
    return parse_lines(spec, lines, checks)


def kafka_records(spark: SparkSession, spec: PipelineSpec, manifest: KafkaManifest) -> DataFrame:
    """A Kafka batch's records: each record's value is one record, named
    ``kafka://topic/partition`` and numbered by its offset in quarantine."""
    from pyspark.sql import functions as F

    settings = manifest.client.settings if manifest.client is not None else {}
    fetched = kafka_read.records(spark, manifest.topic, manifest.ranges, settings)
    text = F.col("value").cast("string")
    valid = F.expr("is_valid_utf8(CAST(value AS STRING))")
    lines = fetched.select(
        F.concat(F.lit(f"kafka://{manifest.topic}/"), F.col("_kafka_partition").cast("string")).alias(FILE),
        F.col("_kafka_offset").alias(LINE),
        # Bytes that are not UTF-8 are shown as U+FFFD in quarantine, as for files.
        F.when(valid, text).otherwise(F.expr("make_valid_utf8(CAST(value AS STRING))")).alias(RAW),
        F.coalesce(valid, F.lit(True)).alias("__utf8"),
        *KAFKA_COLUMNS,
    )
    null_value = Check(F.col(RAW).isNull(), F.lit("record has no value (null, e.g. a tombstone); not parsed"))
    return parse_lines(spec, lines, [null_value], extra=KAFKA_COLUMNS)


def parquet_records(spark: SparkSession, spec: PipelineSpec, paths: list[str]) -> DataFrame:
    """Rows of Parquet files, numbered from 1 within each file; fields cast by name.

    Local files are read together, their schemas merged. Files whose types
    for one column cannot be merged (INT in one, BIGINT in another) are read
    one by one instead, each converted to `source.schema` on its own, so a
    value that does not convert is quarantined as in any other file (Spark's
    merge error names no file, and would fail the batch for good)."""
    from pyspark.sql import functions as F

    if any(is_s3(path) for path in paths):
        df = s3_read.parquet_rows(spark, paths, client_settings(), [f.name for f in spec.source.fields])
        return _parquet_typed(spec, df, F.col(FILE), F.col(LINE), 2)
    try:
        return _parquet_local(spark, spec, paths)
    except Exception as exc:
        if "CANNOT_MERGE_SCHEMAS" not in str(exc) or len(paths) == 1:
            raise
    records = [_parquet_local(spark, spec, [path]) for path in paths]
    return reduce(lambda a, b: a.union(b), records)


def _parquet_local(spark: SparkSession, spec: PipelineSpec, paths: list[str]) -> DataFrame:
    from pyspark.sql import functions as F

    df = spark.read.option("mergeSchema", "true").parquet(*paths)
    return _parquet_typed(spec, df, F.col("_metadata.file_path"), F.col("_metadata.row_index") + 1, 0)


def _parquet_typed(spec: PipelineSpec, df: DataFrame, file_col: Column, line_col: Column, first_data: int) -> DataFrame:
    """`df`'s rows as records: file, line, the raw row as JSON, the fields
    converted to their `source.schema` types, and the reason of a failure."""
    from pyspark.sql import functions as F

    fields = spec.source.fields
    # Columns by position: a file's column names are not validated
    # identifiers and must not be parsed as SQL.
    data = [df[i] for i in range(first_data, len(df.columns))]
    # Each column with its type in the files (merged over them): a column
    # already of the spec's type needs no conversion check. Spark keeps such
    # a check (`x IS NOT NULL AND x IS NULL`) in the plan, so the column
    # would be read for it even when the transform does not use it.
    present = {
        field.name.lower(): (column, field.dataType.simpleString().upper())
        for column, field in zip(data, df.schema.fields[first_data:])
    }
    checks: list[Check] = []
    typed: dict[str, Column] = {}
    for f in fields:
        column, stored = present.get(f.name.lower(), (None, None))
        if column is None:
            value = F.lit(None).cast(f.type)
        elif stored == f.type:
            value = column
        else:
            value = column.try_cast(f.type)
            checks.append(Check(column.isNotNull() & value.isNull(), F.lit(f"field {f.name}: value cannot be converted to {f.type}")))
        typed[f.name] = value
    checks.extend(value_checks(spec, typed))
    return df.select(
        file_col.alias(FILE),
        line_col.alias(LINE),
        F.to_json(F.struct(*data)).alias(RAW),
        *[value.alias(name) for name, value in typed.items()],
        reason(checks).alias(REASON),
        F.lit(MAX_RAW_CHARS).alias(KEEP),
    )


def _whole_files(spark: SparkSession, paths: list[str]) -> DataFrame:
    """One row per file: ``__file`` and `value` (its whole text)."""
    from pyspark.sql import functions as F

    if any(is_s3(path) for path in paths):
        return s3_read.whole_objects(spark, paths, client_settings())
    return spark.read.text(paths, wholetext=True).select(F.col("_metadata.file_path").alias(FILE), "value")


def _csv_header(lines: DataFrame, spec: PipelineSpec) -> tuple[DataFrame, Check]:
    """Drop each file's header line; a check failing records under a header that does not fit.

    The first non-blank line of each file is its header. Records of a file
    whose header does not name the schema's columns in order would be
    misread, so they are quarantined instead. Columns are compared one by
    one (spaces and quotes around names ignored), so any delimiter works,
    a tab included.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    by_file = Window.partitionBy(FILE)
    delimiter = spec.source.csv.delimiter
    expected = ",".join(f.name for f in spec.source.fields)
    first = F.min(LINE).over(by_file)
    header_line = F.first(F.when(F.col(LINE) == first, F.col(RAW)), ignorenulls=True).over(by_file)
    names = F.transform(F.split(header_line, "\\Q" + delimiter + "\\E"), lambda c: F.regexp_replace(F.trim(c), '^"|"$', ""))
    lines = lines.withColumn("__is_header", F.col(LINE) == first).withColumn("__header", F.array_join(names, ","))
    lines = lines.where(~F.col("__is_header"))
    return lines, Check(
        F.col("__header") != F.lit(expected),
        F.concat(F.lit("CSV header '"), F.col("__header"), F.lit(f"' does not match source.schema '{expected}'")),
    )
