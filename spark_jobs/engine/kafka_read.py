"""Reading a batch's Kafka offset ranges on the Spark executors, with confluent-kafka.

Spark's Kafka connector ships as JARs this project cannot fetch, so records
are fetched by Python on the executors instead, the way `s3_read` fetches
objects: the planned ranges become a small DataFrame of tasks (one per
partition range, large ranges split), and each task assigns its range to a
consumer and reads it (`mapInArrow`). The driver never handles records.

A range ``[start, end)`` is complete when the consumer's position reaches
``end``, not when ``end - start`` records arrived: under ``read_committed``
the offsets of transaction markers and aborted records are never delivered.
The consumer reports its position by the next record it delivers (at or
past ``end``: the range is done, that record belongs to a later batch) or by
reaching the partition's end (``enable.partition.eof``); a partition that
ends before ``end`` lost records after the plan, which fails the task.

Executors need confluent-kafka and pyarrow, not this package: the module is
pickled by value. The consumer settings (`KafkaClient.settings`, secrets
included) travel inside the task, as Spark's own Kafka parameters do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from spark_jobs.core.spec import KAFKA_COLUMN_TYPES, KAFKA_COLUMNS

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["MAX_TASK_OFFSETS", "RECORD_SCHEMA", "STALL_TIMEOUT_ENV", "records", "split", "stall_timeout"]

#: A range longer than this is read by several tasks.
MAX_TASK_OFFSETS = 50_000
#: Records handed to Spark per Arrow batch, at most, and value bytes (a
#: batch's binary column must stay far below Arrow's 2 GiB per array).
_CHUNK = 10_000
_CHUNK_BYTES = 32 * 1024 * 1024
#: A task fails if its consumer delivers nothing for this long while its
#: range is unfinished: long enough to ride out a broker's restart (librdkafka
#: reconnects by itself), short enough that a broker gone for good fails the
#: run (exit 1, retried) rather than hanging it. The environment variable
#: sets it, read on the driver when a batch's read is built.
STALL_TIMEOUT_S = 120.0
STALL_TIMEOUT_ENV = "MICROBATCH_STALL_TIMEOUT_S"  # not MICROBATCH_KAFKA_*: those are librdkafka settings

#: Columns of the fetched records: the Kafka columns of the `batch` view, and the raw value.
RECORD_SCHEMA = ", ".join(f"{name} {kind}" for name, kind in KAFKA_COLUMN_TYPES) + ", value BINARY"
#: Their names, as the fetch task builds its Arrow batches (a plain tuple, pickled with the task).
_NAMES = (*KAFKA_COLUMNS, "value")


def split(ranges: tuple[tuple[int, int, int], ...], most: int = MAX_TASK_OFFSETS) -> list[tuple[int, int, int]]:
    """The ranges cut into pieces of at most `most` offsets."""
    return [(p, a, min(a + most, end)) for p, start, end in ranges for a in range(start, end, most)]


def records(spark: SparkSession, topic: str, ranges: tuple[tuple[int, int, int], ...], settings: Mapping[str, Any]) -> DataFrame:
    """The records of `ranges` of `topic`, fetched on the executors (`RECORD_SCHEMA`).

    Task i reads range i: `spark.range` with one slice per range puts
    exactly one id in each Spark partition (a repartitioned frame of the
    ranges would not: some tasks would read two ranges, some none).
    """
    _pickle_by_value()
    tasks = split(ranges)
    fetch = _fetch(topic, tasks, dict(settings), stall_timeout())
    return spark.range(0, len(tasks), 1, max(1, len(tasks))).mapInArrow(fetch, RECORD_SCHEMA)


def stall_timeout() -> float:
    """Seconds a read task waits for its next record (`STALL_TIMEOUT_ENV`, else `STALL_TIMEOUT_S`)."""
    import os

    return float(os.environ.get(STALL_TIMEOUT_ENV, STALL_TIMEOUT_S))


def _pickle_by_value() -> None:
    import sys

    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _fetch(
    topic: str, tasks: list[tuple[int, int, int]], settings: dict[str, Any], stall_s: float
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def fetch(ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from confluent_kafka import Consumer

        consumer = Consumer(settings)
        try:
            for batch in ids:
                for task in batch.column(0).to_pylist():
                    yield from _read_range(consumer, topic, *tasks[task], stall_s=stall_s)
        finally:
            consumer.close()

    return fetch


def _read_range(consumer: Any, topic: str, partition: int, start: int, end: int, *, stall_s: float) -> Iterator[pa.RecordBatch]:
    import time

    from confluent_kafka import TopicPartition

    where = f"kafka://{topic}/{partition}"
    consumer.assign([TopicPartition(topic, partition, start)])
    offsets: list[int] = []
    stamps: list[int] = []
    keys: list[str | None] = []
    values: list[bytes | None] = []
    position, last_progress = start, time.monotonic()

    def chunk() -> pa.RecordBatch:
        batch = _records(topic, partition, offsets, stamps, keys, values)
        for column in (offsets, stamps, keys, values):
            column.clear()
        return batch

    size = 0
    while position < end:
        message = consumer.poll(1.0)
        if message is None:
            if time.monotonic() - last_progress > stall_s:
                raise OSError(f"cannot read {where} offsets {position}..{end - 1}: no record for {stall_s:.0f} s")
            continue
        if message.error() is not None:
            if _at_end(message, where, partition, position, end):
                break
            continue
        offset = message.offset()
        if offset >= end:
            break  # a later batch's record: the range is done
        if offset < start:
            raise OSError(f"cannot read {where}: asked for offset {start}, got {offset}")
        key, value = message.key(), message.value()
        offsets.append(offset)
        stamps.append(message.timestamp()[1])
        keys.append(key.decode("utf-8", "replace") if key is not None else None)
        values.append(value)
        size += len(value) if value is not None else 0
        position, last_progress = offset + 1, time.monotonic()
        if len(offsets) >= _CHUNK or size >= _CHUNK_BYTES:
            yield chunk()
            size, last_progress = 0, time.monotonic()  # time waiting for Spark to take it is not a stall
    if offsets:
        yield chunk()


def _records(topic: str, partition: int, offsets: list[int], stamps: list[int], keys: list[str | None], values: list[bytes | None]) -> pa.RecordBatch:
    """One chunk of a range's records, in the columns the parser reads."""
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(
        [
            pa.array([topic] * len(offsets), pa.string()),
            pa.array([partition] * len(offsets), pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(stamps, pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC")),
            pa.array(keys, pa.string()),
            pa.array(values, pa.binary()),
        ],
        names=list(_NAMES),
    )


def _at_end(message: Any, where: str, partition: int, position: int, end: int) -> bool:
    """A poll that returned an error: True if it is the partition's end,
    reached at `end`; False for a passing one (a broker restarting, a
    connection dropped: librdkafka retries by itself, and the stall timeout
    bounds how long that may take); raises what ends the read."""
    from confluent_kafka import KafkaError

    error = message.error()
    code = error.code()
    if code == KafkaError._PARTITION_EOF:
        if message.offset() < end:
            raise OSError(
                f"cannot read {where} offsets {message.offset()}..{end - 1}: the partition ends at "
                f"{message.offset()} (deleted or recreated since the batch was planned)"
            )
        return True
    if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
        # `auto.offset.reset=error`: never jump past records silently.
        raise OSError(f"cannot read {where} offsets {position}..{end - 1}: retention deleted them ({error.str()})")
    if error.fatal() or message.partition() == partition:
        raise OSError(f"cannot read {where} at offset {position}: {error.str()}")
    return False
