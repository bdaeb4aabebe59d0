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
import re
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import pyarrow as pa

from spark_jobs.core.compute import QUARANTINE_COLUMNS, ComputeResult, check_result_columns, validate_updates
from spark_jobs.core.spec import KAFKA_COLUMN_TYPES, KAFKA_COLUMNS, PipelineSpec
from spark_jobs.core.sql_text import spark_identifier
from spark_jobs.engine import delta_read, kafka_read, s3_read
from spark_jobs.engine.session import connect_session, default_session, redact_master
from spark_jobs.errors import ComputeError, SourceError, TransformError, first_line
from spark_jobs.sources.base import BatchRange
from spark_jobs.sources.delta import DeltaManifest
from spark_jobs.sources.files import HADOOP_GLOB_CHARS, FilesManifest
from spark_jobs.sources.kafka import KafkaManifest
from spark_jobs.storage.s3 import client_settings, is_s3

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["LONG_LINE_RAW_CHARS", "MAX_RAW_CHARS", "SparkCompute", "spark_path"]

log = logging.getLogger("microbatch")

#: Raw text kept for a quarantined record; longer lines are cut (and say so).
MAX_RAW_CHARS = 65_536
#: Raw text kept for a line over `source.max_line_bytes`: it was never parsed,
#: and a few such lines must not bloat the quarantine table.
LONG_LINE_RAW_CHARS = 1_024
_FLOATING = ("FLOAT", "DOUBLE")
_INTEGRAL = ("TINYINT", "SMALLINT", "INT", "BIGINT")


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

            if self._master and self._master.startswith("sc://"):
                log.info("connecting to Spark Connect at %s", redact_master(self._master))
                self._session, self._owns_session = connect_session(self._master), True
                return self._session
            active = SparkSession.getActiveSession()
            if active is None:
                log.info("starting Spark (master %s)", redact_master(self._master))
            self._session = active or default_session(self._master)
            self._owns_session = active is None
        return self._session

    def close(self) -> None:
        if self._session is not None and self._owns_session:
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

    def check(self, spec: PipelineSpec) -> None:
        """Analyse the transform over an empty `batch` (no job runs)."""
        from pyspark.sql import functions as F

        if spec.source.type == "delta":
            empty = self.spark.createDataFrame(delta_read.batch_schema(spec.source_path, spec.source.read).empty_table())
        else:
            # An empty typed frame built in the JVM (createDataFrame([]) goes through Python).
            columns = [(f.name, f.type) for f in spec.source.fields]
            columns += list(KAFKA_COLUMN_TYPES) if spec.source.type == "kafka" else []
            empty = self.spark.range(0).select(*[F.lit(None).cast(kind).alias(name) for name, kind in columns])
        check_result_columns(spec, self._transform(spec, empty).columns)

    # -- a batch ------------------------------------------------------------------

    def process(self, spec: PipelineSpec, batch: BatchRange) -> ComputeResult:
        if isinstance(batch.manifest, DeltaManifest):
            return self._process_versions(spec, batch.manifest)
        if isinstance(batch.manifest, KafkaManifest):
            records = batch.manifest
            return self._process_records(
                spec,
                lambda: self._read_kafka(spec, records),
                extra=KAFKA_COLUMNS,
                explain=lambda exc: _explain_kafka(spec, records, exc),
            )
        files = _files_manifest(spec, batch)
        return self._process_records(
            spec,
            lambda: self._read(spec, [spark_path(uri) for uri in files.uris]),
            name_files=lambda quarantine: _name_files_as_planned(quarantine, files),
            explain=lambda exc: _explain(spec, files, exc),
        )

    def _process_records(
        self,
        spec: PipelineSpec,
        read: Callable[[], DataFrame],
        *,
        explain: Callable[[Exception], Exception],
        extra: tuple[str, ...] = (),
        name_files: Callable[[pa.Table], pa.Table] = lambda quarantine: quarantine,
    ) -> ComputeResult:
        """Parse, quarantine and transform records read as `read` says (files or
        Kafka records); `extra` columns (the source's own) pass to `batch`."""
        from pyspark.sql import functions as F

        parsed = None
        try:
            # Inside the try: reading a Parquet schema already opens the files.
            parsed = read().cache()
            records_in = parsed.count()
            cut = F.length("_raw") > F.col("_keep")
            bad = parsed.where(F.col("_reason").isNotNull()).select(
                F.col("_file").alias("file"),
                F.col("_line").cast("long").alias("line"),
                F.when(cut, F.col("_raw").substr(F.lit(1), F.col("_keep"))).otherwise(F.col("_raw")).alias("raw"),
                F.when(
                    cut,
                    F.concat(F.col("_reason"), F.lit(" (raw text cut to "), F.col("_keep").cast("string"), F.lit(" characters)")),
                )
                .otherwise(F.col("_reason"))
                .alias("reason"),
            )
            quarantine = name_files(bad.toArrow().cast(QUARANTINE_COLUMNS))
            valid = parsed.where(F.col("_reason").isNull()).select(
                *[F.col(spark_identifier(f.name)) for f in spec.source.fields], *extra
            )
            updates = self._transform(spec, valid).toArrow()
        except Exception as exc:
            raise explain(exc) from exc
        finally:
            if parsed is not None:
                parsed.unpersist()
        return ComputeResult(validate_updates(spec, updates), quarantine, records_in)

    def _process_versions(self, spec: PipelineSpec, manifest: DeltaManifest) -> ComputeResult:
        """A Delta source's batch: its rows come typed, so nothing is quarantined;
        the driver reads them (see `spark_jobs.engine.delta_read`)."""
        try:
            rows = delta_read.read_versions(manifest)
        except Exception as exc:
            raise SourceError(
                f"pipeline {spec.name}: cannot read versions {manifest.first}..{manifest.last} of source table "
                f"{manifest.uri}: {first_line(exc)}. If a VACUUM of that table removed their files, the "
                "versions are lost: rewind to the last committed batch (`microbatch rewind SPEC --to-batch K`) "
                "and set `source.on_data_loss: skip` only if losing them is acceptable. Nothing was committed.",
                pipeline=spec.name,
                path=manifest.uri,
            ) from exc
        updates = self._transform(spec, self.spark.createDataFrame(rows)).toArrow()
        return ComputeResult(validate_updates(spec, updates), QUARANTINE_COLUMNS.empty_table(), rows.num_rows)

    # -- internals ------------------------------------------------------------

    def _transform(self, spec: PipelineSpec, batch_df: DataFrame) -> DataFrame:
        batch_df.createOrReplaceTempView("batch")
        try:
            return self.spark.sql(spec.transform)
        except Exception as exc:
            raise TransformError(
                f"pipeline {spec.name}: the transform SQL failed: {first_line(exc, 10_000)}", pipeline=spec.name
            ) from exc

    def _read(self, spec: PipelineSpec, uris: list[str]) -> DataFrame:
        """Parsed records: typed fields, `_file`, `_line`, `_raw`, `_reason`."""
        if spec.source.format == "parquet":
            return self._read_parquet(spec, uris)
        return self._read_text(spec, uris)

    def _read_text(self, spec: PipelineSpec, uris: list[str]) -> DataFrame:
        from pyspark.sql import functions as F

        # Spark decodes text as UTF-8, replacing bytes that are not UTF-8 with
        # U+FFFD, and `split` works on the decoded text: validity can only be
        # tested on the whole file, before the split. In a file that is not
        # valid UTF-8, the lines holding U+FFFD are the ones that were not.
        lines = self._whole_files(uris).select(
            "_file",
            F.expr("is_valid_utf8(value)").alias("_utf8_file"),
            F.posexplode(F.split(F.col("value"), "\r?\n")).alias("_pos", "_raw"),
        )
        # A byte-order mark is not part of the first record (editors on
        # Windows write one; left in, it breaks the first JSON object or header).
        lines = lines.withColumn(
            "_raw", F.when(F.col("_pos") == 0, F.regexp_replace("_raw", "^\ufeff", "")).otherwise(F.col("_raw"))
        )
        # Whitespace-only lines (tabs included) are not records.
        lines = lines.where(F.col("_raw").rlike("\\S")).withColumn("_line", F.col("_pos") + 1)
        lines = lines.withColumn("_utf8", F.col("_utf8_file") | ~F.col("_raw").contains("\ufffd"))
        checks: list[Column] = []
        if spec.source.format == "csv" and spec.source.csv.header:
            lines, header_reason = self._csv_header(lines, spec)
            checks.append(header_reason)
        return self._parse(spec, lines, checks)

    def _read_kafka(self, spec: PipelineSpec, manifest: KafkaManifest) -> DataFrame:
        """A Kafka batch's records as lines: each record's value is one record,
        named ``kafka://topic/partition`` and its offset in quarantine."""
        from pyspark.sql import functions as F

        settings = manifest.client.settings if manifest.client is not None else {}
        fetched = kafka_read.records(self.spark, manifest.topic, manifest.ranges, settings)
        text = F.col("value").cast("string")
        valid = F.expr("is_valid_utf8(CAST(value AS STRING))")
        lines = fetched.select(
            F.concat(F.lit(f"kafka://{manifest.topic}/"), F.col("_kafka_partition").cast("string")).alias("_file"),
            F.col("_kafka_offset").alias("_line"),
            # Bytes that are not UTF-8 are shown as U+FFFD in quarantine, as for files.
            F.when(valid, text).otherwise(F.expr("make_valid_utf8(CAST(value AS STRING))")).alias("_raw"),
            F.coalesce(valid, F.lit(True)).alias("_utf8"),
            *KAFKA_COLUMNS,
        )
        null_value = F.when(F.col("_raw").isNull(), F.lit("record has no value (null, e.g. a tombstone); not parsed"))
        return self._parse(spec, lines, [null_value], extra=KAFKA_COLUMNS)

    def _parse(self, spec: PipelineSpec, lines: DataFrame, checks: list[Column], extra: tuple[str, ...] = ()) -> DataFrame:
        """Typed fields and a reason from lines (`_file`, `_line`, `_raw`, `_utf8`)."""
        from pyspark.sql import functions as F

        fields = spec.source.fields
        limit = spec.source.max_line_bytes
        lines = lines.withColumn("_bytes", F.octet_length("_raw"))
        too_long = F.col("_bytes") > F.lit(limit)
        not_utf8 = ~F.col("_utf8")
        # Over-long and undecodable lines are not parsed at all.
        parse_input = F.when(~too_long & ~not_utf8, F.col("_raw"))
        checks = [
            F.when(
                too_long,
                F.concat(
                    F.lit("line is "),
                    F.col("_bytes").cast("string"),
                    F.lit(f" bytes, longer than source.max_line_bytes ({limit}); not parsed"),
                ),
            ),
            F.when(
                not_utf8,
                F.lit("line is not valid UTF-8 (the bytes that are not were replaced by U+FFFD in raw); not parsed"),
            ),
            *checks,
        ]
        if spec.source.format == "text":
            value = parse_input.alias("value")
            reason = F.coalesce(*checks)
            keep = F.when(too_long, F.lit(LONG_LINE_RAW_CHARS)).otherwise(F.lit(MAX_RAW_CHARS))
            return lines.select("_file", "_line", "_raw", value, reason.alias("_reason"), keep.alias("_keep"), *extra)
        text_schema = ", ".join(f"{spark_identifier(f.name)} STRING" for f in fields) + ", `_corrupt` STRING"
        options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt"}
        if spec.source.format == "json":
            record = F.from_json(parse_input, text_schema, options)
            shape_reason = "malformed JSON: not a JSON object on one line"
        else:
            csv = spec.source.csv
            options["sep"] = csv.delimiter
            record = F.from_csv(parse_input, text_schema, options)
            shape_reason = f"malformed CSV: expected {len(fields)} columns separated by {csv.delimiter!r}"
        parsed = lines.withColumn("_r", record)
        checks.append(F.when(F.col("_r").isNull() | F.col("_r._corrupt").isNotNull(), F.lit(shape_reason)))
        typed: list[Column] = []
        for f in fields:
            text = F.col(f"_r.{spark_identifier(f.name)}")
            if f.type in _FLOATING:
                # from_json hands JSON's bare NaN / Infinity tokens (and numbers
                # too large for a double, which Jackson reads as Infinity) to a
                # STRING field quoted; unquote them so they are reported as
                # non-finite rather than as text.
                text = F.regexp_replace(text, '^"(NaN|[+-]?Infinity)"$', "$1")
            value = text if f.type == "STRING" else text.try_cast(f.type)
            typed.append(value.alias(f.name))
            if f.type != "STRING":
                checks.append(
                    F.when(
                        text.isNotNull() & value.isNull(),
                        F.concat(F.lit(f"field {f.name}: '"), F.substring(text, 1, 200), F.lit(f"' {_cast_problem(f.type)}")),
                    )
                )
        checks.extend(self._value_checks(spec, {f.name: v for f, v in zip(fields, typed)}))
        reason = F.coalesce(*checks)
        keep = F.when(too_long, F.lit(LONG_LINE_RAW_CHARS)).otherwise(F.lit(MAX_RAW_CHARS))
        return parsed.select("_file", "_line", "_raw", *typed, reason.alias("_reason"), keep.alias("_keep"), *extra)

    @staticmethod
    def _csv_header(lines: DataFrame, spec: PipelineSpec) -> tuple[DataFrame, Column]:
        """Drop each file's header line; a reason for records under a header that does not fit.

        The first non-blank line of each file is its header. Records of a file
        whose header does not name the schema's columns in order would be
        misread, so they are quarantined instead. Columns are compared one by
        one (spaces and quotes around names ignored), so any delimiter works,
        a tab included.
        """
        from pyspark.sql import functions as F

        delimiter = spec.source.csv.delimiter
        expected = ",".join(f.name for f in spec.source.fields)
        first = F.min("_line").over(_by_file())
        header_line = F.first(F.when(F.col("_line") == first, F.col("_raw")), ignorenulls=True).over(_by_file())
        names = F.transform(
            F.split(header_line, "\\Q" + delimiter + "\\E"), lambda c: F.regexp_replace(F.trim(c), '^"|"$', "")
        )
        lines = lines.withColumn("_is_header", F.col("_line") == first).withColumn("_header", F.array_join(names, ","))
        lines = lines.where(~F.col("_is_header"))
        reason = F.when(
            F.col("_header") != F.lit(expected),
            F.concat(F.lit("CSV header '"), F.col("_header"), F.lit(f"' does not match source.schema '{expected}'")),
        )
        return lines, reason

    def _read_parquet(self, spec: PipelineSpec, uris: list[str]) -> DataFrame:
        from pyspark.sql import functions as F

        fields = spec.source.fields
        if any(is_s3(uri) for uri in uris):
            df = s3_read.parquet_rows(self.spark, uris, client_settings(), [f.name for f in fields])
            file_col, line_col, first_data = F.col("_file"), F.col("_line"), 2
        else:
            df = self.spark.read.option("mergeSchema", "true").parquet(*uris)
            file_col, line_col, first_data = F.col("_metadata.file_path"), F.col("_metadata.row_index") + 1, 0
        # Columns by position: a file's column names are not validated
        # identifiers and must not be parsed as SQL.
        data = [df[i] for i in range(first_data, len(df.columns))]
        present = {name.lower(): column for name, column in zip(df.columns[first_data:], data)}
        checks: list[Column] = []
        typed: list[Column] = []
        for f in fields:
            if f.name.lower() in present:
                source_col = present[f.name.lower()]
                value = source_col.try_cast(f.type)
                checks.append(
                    F.when(
                        source_col.isNotNull() & value.isNull(),
                        F.lit(f"field {f.name}: value cannot be converted to {f.type}"),
                    )
                )
            else:
                value = F.lit(None).cast(f.type)
            typed.append(value.alias(f.name))
        checks.extend(self._value_checks(spec, {f.name: v for f, v in zip(fields, typed)}))
        raw = F.to_json(F.struct(*data))
        return df.select(
            file_col.alias("_file"),
            line_col.alias("_line"),
            raw.alias("_raw"),
            *typed,
            F.coalesce(*checks).alias("_reason"),
            F.lit(MAX_RAW_CHARS).alias("_keep"),
        )

    def _whole_files(self, uris: list[str]) -> DataFrame:
        """One row per file: `_file` (its URI) and `value` (its whole text)."""
        from pyspark.sql import functions as F

        if any(is_s3(uri) for uri in uris):
            return s3_read.whole_objects(self.spark, uris, client_settings())
        return self.spark.read.text(uris, wholetext=True).select(F.col("_metadata.file_path").alias("_file"), "value")

    @staticmethod
    def _value_checks(spec: PipelineSpec, typed: dict[str, Column]) -> list[Column]:
        """Reasons for typed values that are well-formed but unusable.

        NaN and infinities are refused in FLOAT/DOUBLE columns: one of them
        summed into the state would poison that key's total for good (JSON's
        1e400 arrives as Infinity). NOT NULL columns and keys must be present:
        a null key cannot be merged.
        """
        from pyspark.sql import functions as F

        checks = []
        for f in spec.source.fields:
            if f.type in _FLOATING:
                value = typed[f.name]
                checks.append(
                    F.when(
                        F.isnan(value) | (F.abs(value) == F.lit(float("inf"))),
                        F.concat(
                            F.lit(f"field {f.name}: "),
                            value.cast("string"),
                            F.lit(f" is not a finite {f.type} (NaN, Infinity and numbers beyond its range are refused)"),
                        ),
                    )
                )
        for f in spec.source.fields:
            if not f.nullable:
                checks.append(
                    F.when(
                        typed[f.name].isNull(),
                        F.lit(f"field {f.name} is missing or null (NOT NULL in source.schema)"),
                    )
                )
        checks.extend(
            F.when(typed[key].isNull(), F.lit(f"key {key} is missing or null"))
            for key in spec.state.keys
            if key in typed
        )
        return checks


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


def _files_manifest(spec: PipelineSpec, batch: BatchRange) -> FilesManifest:
    """The batch's files: this engine reads files sources."""
    if not isinstance(batch.manifest, FilesManifest):
        raise ComputeError(
            f"pipeline {spec.name}: the Spark engine cannot read a {type(batch.manifest).__name__} batch",
            pipeline=spec.name,
        )
    return batch.manifest


def _name_files_as_planned(quarantine: pa.Table, manifest: FilesManifest) -> pa.Table:
    """Report quarantined records' files by the URIs in the batch's manifest.

    Spark reports a local file as Hadoop spells it (``file:/a/x%20y.json``);
    the manifest, the ledger and the quarantine should agree on one spelling.
    """
    if quarantine.num_rows == 0:
        return quarantine
    planned = {_local_path(uri): uri for uri in manifest.uris if uri.startswith("file:")}
    if not planned:
        return quarantine
    files = [
        planned.get(_local_path(f), f) if f and f.startswith("file:") else f
        for f in quarantine.column("file").to_pylist()
    ]
    index = quarantine.schema.get_field_index("file")
    return quarantine.set_column(index, quarantine.schema.field(index), pa.array(files, pa.string()))


def _cast_problem(sql_type: str) -> str:
    """How a value that did not cast to `sql_type` is described."""
    if sql_type in _INTEGRAL:
        return f"is not a {sql_type} (or is out of its range)"
    if sql_type.startswith("DECIMAL"):
        return f"is not a {sql_type} (or has too many digits for it)"
    return f"is not a {sql_type}"


def _by_file():
    from pyspark.sql import Window

    return Window.partitionBy("_file")


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

