"""Spark compute: read the planned files, quarantine bad records, transform.

Text formats (json lines, csv) are read as whole files and split into lines
by Spark, so every record keeps its file and line number for quarantine.
Each field is first extracted as text and then cast with `try_cast`, so a
bad value yields a precise reason ("field amount: 'abc' is not a DOUBLE")
instead of a silently null column. Files are read by the executors, not the
driver; only the (small, aggregated) transform result and the quarantined
records come back to the driver, as Arrow.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from spark_jobs import s3_read
from spark_jobs.compute import QUARANTINE_COLUMNS, ComputeResult, check_result_columns, validate_updates
from spark_jobs.errors import ComputeError, SourceError, TransformError
from spark_jobs.jvm_cache import driver_java_options
from spark_jobs.sources.base import BatchRange
from spark_jobs.spec import PipelineSpec
from spark_jobs.storage import endpoint_url, is_s3, region

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger("microbatch")

#: Raw text kept for a quarantined record; longer lines are cut (and say so).
MAX_RAW_CHARS = 65_536


def _q(name: str) -> str:
    """Quote a (validated) identifier for Spark SQL."""
    return f"`{name}`"


def default_session(master: str | None = None, app_name: str = "microbatch", *, short_lived: bool = True) -> SparkSession:
    """A Spark session tuned for micro-batches.

    Few shuffle partitions (AQE coalesces further), UTC session time zone so
    timestamps mean the same everywhere, no UI. `short_lived`: the process
    runs one batch and exits (CLI, Airflow task), which picks JVM flags for a
    fast start (`spark_jobs.jvm_cache`); pass False for a session that runs
    many batches.
    """
    from pyspark.sql import SparkSession

    master = master or os.environ.get("MICROBATCH_SPARK_MASTER", "local[*]")
    # Python workers (S3 fetches, Arrow transfers) need this interpreter's
    # packages; Spark's default is whatever `python3` is on the PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master.startswith("local"):
        # Bind the driver to loopback: nothing local needs another interface.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", os.environ.get("MICROBATCH_SHUFFLE_PARTITIONS", "8"))
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.driver.memory", os.environ.get("MICROBATCH_DRIVER_MEMORY", "2g"))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.extraJavaOptions", driver_java_options(short_lived))
    )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(os.environ.get("MICROBATCH_SPARK_LOG_LEVEL", "ERROR"))
    return session


class SparkCompute:
    """Runs batches on a Spark session created on first use.

    Stops the session on `close()` only if it created it: a session passed
    in, or one already active in the process (an embedding application's),
    is left running.
    """

    def __init__(self, session: SparkSession | None = None, master: str | None = None) -> None:
        self._session = session
        self._master = master
        self._owns_session = False

    @property
    def spark(self) -> SparkSession:
        if self._session is None:
            from pyspark.sql import SparkSession

            active = SparkSession.getActiveSession()
            if active is None:
                log.info("starting Spark (%s)", self._master or os.environ.get("MICROBATCH_SPARK_MASTER", "local[*]"))
            self._session = active or default_session(self._master)
            self._owns_session = active is None
        return self._session

    def close(self) -> None:
        if self._session is not None and self._owns_session:
            self._session.stop()
            self._session = None

    # -- checks ---------------------------------------------------------------

    def check(self, spec: PipelineSpec) -> None:
        """Analyse the transform over an empty `batch` (no job runs)."""
        from pyspark.sql import functions as F

        # An empty typed frame built in the JVM (createDataFrame([]) goes through Python).
        empty = self.spark.range(0).select(*[F.lit(None).cast(f.type).alias(f.name) for f in spec.source.fields])
        columns = self._transform(spec, empty).columns
        check_result_columns(spec, columns)

    # -- a batch ------------------------------------------------------------------

    def process(self, spec: PipelineSpec, batch: BatchRange) -> ComputeResult:
        from pyspark.sql import functions as F

        parsed = self._read(spec, batch.uris).cache()
        try:
            records_in = parsed.count()
            bad = parsed.where(F.col("_reason").isNotNull()).select(
                F.col("_file").alias("file"),
                F.col("_line").cast("long").alias("line"),
                F.when(F.length("_raw") > MAX_RAW_CHARS, F.substring("_raw", 1, MAX_RAW_CHARS))
                .otherwise(F.col("_raw"))
                .alias("raw"),
                F.when(
                    F.length("_raw") > MAX_RAW_CHARS,
                    F.concat(F.col("_reason"), F.lit(f" (raw text cut to {MAX_RAW_CHARS} characters)")),
                )
                .otherwise(F.col("_reason"))
                .alias("reason"),
            )
            quarantine = bad.toArrow().cast(QUARANTINE_COLUMNS)
            valid = parsed.where(F.col("_reason").isNull()).select(
                *[F.col(_q(f.name)) for f in spec.source.fields]
            )
            updates = self._transform(spec, valid).toArrow()
        except Exception as exc:
            raise _explain(spec, batch, exc) from exc
        finally:
            parsed.unpersist()
        return ComputeResult(validate_updates(spec, updates), quarantine, records_in)

    # -- internals ------------------------------------------------------------

    def _typed_schema(self, spec: PipelineSpec) -> str:
        return ", ".join(f"{_q(f.name)} {f.type}" for f in spec.source.fields)

    def _transform(self, spec: PipelineSpec, batch_df: DataFrame) -> DataFrame:
        batch_df.createOrReplaceTempView("batch")
        try:
            return self.spark.sql(spec.transform)
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TransformError(f"pipeline {spec.name}: the transform SQL failed: {first_line}") from exc

    def _read(self, spec: PipelineSpec, uris: list[str]) -> DataFrame:
        """Parsed records: typed fields, `_file`, `_line`, `_raw`, `_reason`."""
        if spec.source.format == "parquet":
            return self._read_parquet(spec, uris)
        return self._read_text(spec, uris)

    def _read_text(self, spec: PipelineSpec, uris: list[str]) -> DataFrame:
        from pyspark.sql import functions as F

        fields = spec.source.fields
        lines = self._whole_files(uris).select(
            "_file", F.posexplode(F.split(F.col("value"), "\r?\n")).alias("_pos", "_raw")
        )
        lines = lines.where(F.trim(F.col("_raw")) != "").withColumn("_line", F.col("_pos") + 1)
        text_schema = ", ".join(f"{_q(f.name)} STRING" for f in fields) + ", `_corrupt` STRING"
        options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt"}
        header_reason: Column | None = None
        if spec.source.format == "json":
            record = F.from_json(F.col("_raw"), text_schema, options)
            shape_reason = "malformed JSON: not a JSON object on one line"
        else:
            csv = spec.source.csv
            options["sep"] = csv.delimiter
            record = F.from_csv(F.col("_raw"), text_schema, options)
            shape_reason = f"malformed CSV: expected {len(fields)} columns separated by {csv.delimiter!r}"
            if csv.header:
                # The first non-blank line of each file is its header; records
                # of a file whose header does not name the schema's columns in
                # order would be misread, so they are quarantined instead.
                expected = csv.delimiter.join(f.name for f in fields)
                first = F.min("_line").over(_by_file())
                header_line = F.first(F.when(F.col("_line") == first, F.col("_raw")), ignorenulls=True).over(_by_file())
                lines = lines.withColumn("_is_header", F.col("_line") == first).withColumn(
                    "_header", F.regexp_replace(header_line, r"[\s\"]", "")
                )
                lines = lines.where(~F.col("_is_header"))
                header_reason = F.when(
                    F.col("_header") != F.lit(expected),
                    F.concat(F.lit("CSV header '"), F.col("_header"), F.lit(f"' does not match source.schema '{expected}'")),
                )
        parsed = lines.withColumn("_r", record)
        checks: list[Column] = []
        if header_reason is not None:
            checks.append(header_reason)
        checks.append(F.when(F.col("_r").isNull() | F.col("_r._corrupt").isNotNull(), F.lit(shape_reason)))
        typed: list[Column] = []
        for f in fields:
            text = F.col(f"_r.{_q(f.name)}")
            value = text if f.type == "STRING" else F.expr(f"try_cast(_r.{_q(f.name)} AS {f.type})")
            typed.append(value.alias(f.name))
            if f.type != "STRING":
                checks.append(
                    F.when(
                        text.isNotNull() & value.isNull(),
                        F.concat(F.lit(f"field {f.name}: '"), F.substring(text, 1, 200), F.lit(f"' is not a {f.type}")),
                    )
                )
        checks.extend(self._key_checks(spec, {f.name: v for f, v in zip(fields, typed)}))
        reason = F.coalesce(*checks)
        return parsed.select("_file", "_line", "_raw", *typed, reason.alias("_reason"))

    def _read_parquet(self, spec: PipelineSpec, uris: list[str]) -> DataFrame:
        from pyspark.sql import functions as F

        fields = spec.source.fields
        if any(is_s3(uri) for uri in uris):
            df = s3_read.parquet_rows(self.spark, uris, endpoint_url(), region(), [f.name for f in fields])
            file_col, line_col, data_columns = F.col("_file"), F.col("_line"), [f.name for f in fields]
        else:
            df = self.spark.read.option("mergeSchema", "true").parquet(*uris)
            file_col, line_col, data_columns = F.col("_metadata.file_path"), F.col("_metadata.row_index") + 1, df.columns
        present = {c.lower(): c for c in data_columns}
        checks: list[Column] = []
        typed: list[Column] = []
        for f in fields:
            if f.name.lower() in present:
                source_col = F.col(_q(present[f.name.lower()]))
                value = F.expr(f"try_cast({_q(present[f.name.lower()])} AS {f.type})")
                checks.append(
                    F.when(
                        source_col.isNotNull() & value.isNull(),
                        F.lit(f"field {f.name}: value cannot be converted to {f.type}"),
                    )
                )
            else:
                value = F.lit(None).cast(f.type)
            typed.append(value.alias(f.name))
        checks.extend(self._key_checks(spec, {f.name: v for f, v in zip(fields, typed)}))
        raw = F.to_json(F.struct(*[F.col(_q(c)) for c in data_columns]))
        return df.select(
            file_col.alias("_file"),
            line_col.alias("_line"),
            raw.alias("_raw"),
            *typed,
            F.coalesce(*checks).alias("_reason"),
        )

    def _whole_files(self, uris: list[str]) -> DataFrame:
        """One row per file: `_file` (its URI) and `value` (its whole text)."""
        from pyspark.sql import functions as F

        if any(is_s3(uri) for uri in uris):
            return s3_read.whole_objects(self.spark, uris, endpoint_url(), region())
        return self.spark.read.text(uris, wholetext=True).select(F.col("_metadata.file_path").alias("_file"), "value")

    @staticmethod
    def _key_checks(spec: PipelineSpec, typed: dict[str, Column]) -> list[Column]:
        """Null keys cannot be merged: quarantine records whose key is missing."""
        from pyspark.sql import functions as F

        return [
            F.when(typed[key].isNull(), F.lit(f"key {key} is missing or null"))
            for key in spec.state.keys
            if key in typed
        ]


def _by_file():
    from pyspark.sql import Window

    return Window.partitionBy("_file")


def _explain(spec: PipelineSpec, batch: BatchRange, exc: Exception) -> Exception:
    """Turn a Spark failure into an error that names what to look at."""
    if isinstance(exc, (TransformError, SourceError)):
        return exc
    text = str(exc)
    for entry in batch.manifest.get("files", []):
        if entry["name"] in text or entry["uri"] in text:
            return SourceError(
                f"pipeline {spec.name}: cannot read source file {entry['name']} "
                f"({text.strip().splitlines()[0][:300]}). Nothing was consumed. The batch is "
                "planned and replays exactly its planned files: put a readable copy of the "
                "file back and run again."
            )
    first = text.strip().splitlines()[0][:500] if text.strip() else type(exc).__name__
    return ComputeError(f"pipeline {spec.name}: the batch failed in Spark: {first}")

