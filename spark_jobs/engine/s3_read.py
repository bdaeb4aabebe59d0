"""Reading a batch's S3 objects on the Spark executors, with boto3.

Spark reads ``s3a://`` only with the hadoop-aws JARs, which a pip-installed
pyspark does not ship (and this project cannot download). So objects are
fetched by Python on the executors instead: the planned object URIs become a
small DataFrame, repartitioned so that each task fetches a share of them with
boto3 (`mapInArrow`), and Spark parses the bytes exactly as it parses local
files. The driver never handles record data, and the same code runs in
local mode, on a standalone cluster and behind Spark Connect.

The functions below run on executors, which need boto3 and pyarrow but not
this package: the module is pickled by value. Executors resolve their own
credentials (boto3's chain: environment, profile, instance role), and only
the endpoint and region travel with the task, unless the driver was handed a
session (an Airflow AWS connection): then its current credentials travel
too (`spark_jobs.storage.s3.client_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["MAX_FETCH_TASKS", "parquet_rows", "whole_objects"]

#: At most this many fetch tasks a batch (one object per task below it).
MAX_FETCH_TASKS = 64


def whole_objects(spark: SparkSession, uris: list[str], client: dict[str, Any]) -> DataFrame:
    """One row per object: `__file` (its URI) and `value` (its bytes as text, unvalidated).

    The same shape as ``spark.read.text(paths, wholetext=True)`` with the
    file path, so text parsing is shared with local files.
    """
    from pyspark.sql import functions as F

    fetched = _uri_frame(spark, uris).mapInArrow(_fetch_bytes(client), "__file STRING, content BINARY")
    # A binary-to-string cast keeps the bytes as they are, as the text reader does.
    return fetched.select("__file", F.col("content").cast("string").alias("value"))


def parquet_rows(
    spark: SparkSession, uris: list[str], client: dict[str, Any], fields: list[str]
) -> DataFrame:
    """Rows of the Parquet objects: `__file`, `__line` (row number) and `fields` as text.

    Fields are turned into text on the executor and cast to the schema's
    types by the caller, which gives the same per-field quarantine reasons as
    local Parquet. A field the file lacks is null.
    """
    schema = "__file STRING, __line BIGINT, " + ", ".join(f"`{name}` STRING" for name in fields)
    return _uri_frame(spark, uris).mapInArrow(_fetch_parquet(client, fields), schema)


def _uri_frame(spark: SparkSession, uris: list[str]) -> DataFrame:
    _pickle_by_value()
    frame = spark.createDataFrame([(uri,) for uri in uris], "uri STRING")
    return frame.repartition(max(1, min(len(uris), MAX_FETCH_TASKS)))


def _pickle_by_value() -> None:
    import sys

    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _client(settings: dict[str, Any]) -> Any:
    import boto3

    return boto3.session.Session().client("s3", **settings)


def _get(client: Any, uri: str) -> bytes:
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        # Name the object: the driver turns this into "cannot read source file ...".
        raise OSError(f"cannot read {uri}: {exc}") from exc


def _fetch_bytes(settings: dict[str, Any]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def fetch(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        client = _client(settings)
        for batch in batches:
            for uri in batch.column(0).to_pylist():
                yield pa.RecordBatch.from_arrays(
                    [pa.array([uri], pa.string()), pa.array([_get(client, uri)], pa.binary())], names=["__file", "content"]
                )

    return fetch


def _fetch_parquet(
    settings: dict[str, Any], fields: list[str]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def fetch(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import io

        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        client = _client(settings)
        for batch in batches:
            for uri in batch.column(0).to_pylist():
                try:
                    table = pq.read_table(io.BytesIO(_get(client, uri)))
                except OSError:
                    raise
                except Exception as exc:
                    raise OSError(f"cannot read {uri}: not a readable Parquet file ({exc})") from exc
                # Match columns case-insensitively, as Spark's Parquet reader does.
                present = {name.lower(): name for name in table.column_names}
                rows = table.num_rows
                columns = [pa.array([uri] * rows, pa.string()), pa.array(range(1, rows + 1), pa.int64())]
                for name in fields:
                    source = present.get(name.lower())
                    columns.append(
                        pc.cast(table.column(source), pa.string()).combine_chunks()
                        if source is not None
                        else pa.nulls(rows, pa.string())
                    )
                yield pa.RecordBatch.from_arrays(columns, names=["__file", "__line", *fields])

    return fetch
