"""A Kafka topic as a source, against a real Apache Kafka broker (KRaft, one
node, on loopback; tests/kafka_broker.py): what librdkafka's mock cluster
cannot show. Its topics have ids (KIP-516) that change when a topic is
deleted and created again, and it answers timestamp lookups
(`offsets_for_times`) from its time index."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from spark_jobs.core.inspect import status
from spark_jobs.core.ledger import OffsetLedger
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.errors import EXIT_TERMINAL, SourceChangedError, exit_code
from spark_jobs.sources import make_source
from tests.conftest import BatchesLineage
from tests.spark_jobs.sources.test_kafka import assert_exact, events, produce, run, spec_file


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    from tests.kafka_broker import KafkaBroker, KafkaJarsMissing

    try:
        started = KafkaBroker.start(tmp_path_factory.mktemp("kafka"))
    except KafkaJarsMissing as exc:
        pytest.skip(str(exc))
    yield started.bootstrap
    started.stop()


def _create(servers: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": servers})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)
    # The broker's metadata follows a moment after the controller's answer.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = admin.list_topics(topic, timeout=10).topics.get(topic)
        if found is not None and found.error is None and len(found.partitions) == partitions:
            return
        time.sleep(0.2)
    raise AssertionError(f"topic {topic} did not appear")


def _delete(servers: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": servers})
    admin.delete_topics([topic])[topic].result(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = admin.list_topics(timeout=10).topics
        if topic not in found:
            return
        time.sleep(0.2)
    raise AssertionError(f"topic {topic} was not deleted")


def test_a_topic_deleted_and_created_again_is_refused_by_its_id(broker, tmp_path, compute):
    """Reproduced on a real broker: once the new topic held as many records as
    the ledger's offsets, the run planned [old offset, high) and silently
    skipped the new topic's first records. The offsets now carry the topic's
    id, and a new id is refused (exit 2) before anything is read."""
    topic = "recreated"
    _create(broker, topic, 4)
    path = spec_file(tmp_path, broker, topic)
    first = events(0, 8)
    produce(broker, topic, first)
    assert run(path, compute) == "committed"
    spec = load_spec(path)
    [row] = [r for r in OffsetLedger(spec.ledger_path, spec.name).load().rows if r.status.value == "committed"]
    assert row.end_offsets["@topic_id"] and row.manifest["topic_id"] == row.end_offsets["@topic_id"]

    _delete(broker, topic)
    _create(broker, topic, 4)
    second = events(100, 20, bad_every=9)  # 5 a partition: past the 2 the ledger holds for each
    produce(broker, topic, second)
    rows = len(OffsetLedger(spec.ledger_path, spec.name).load().rows)
    with pytest.raises(SourceChangedError, match="deleted and created again") as info:
        run(path, compute)
    assert exit_code(info.value) == EXIT_TERMINAL
    assert row.end_offsets["@topic_id"] in str(info.value)
    assert len(OffsetLedger(spec.ledger_path, spec.name).load().rows) == rows, "nothing was written"
    assert "deleted and created again" in (status(spec).note or "")
    # The way out the message names: rewind to 0, and the new topic is read from its start.
    rewind(spec, 0, run_id="test-rewind")
    while run(path, compute) == "committed":
        pass
    assert_exact(path, second)


def test_a_record_dated_in_the_future_is_named_where_it_holds_scheduled_runs(broker, tmp_path, caplog):
    """A record timestamped ahead stops its partition's bound
    (`offsets_for_times(interval end)`) for every scheduled interval until
    then. The run's log and `status` name the partition, offset and time.
    (Kafka 4 brokers refuse records more than `log.message.timestamp.after.max.ms`
    ahead, one hour by default; older brokers, or ones set otherwise, take
    any date.)"""
    topic = "future"
    _create(broker, topic, 1)
    now = datetime.now(timezone.utc)
    ahead = now + timedelta(minutes=50)
    producer = Producer({"bootstrap.servers": broker, "log_level": 2})
    for i, when in enumerate([now - timedelta(hours=1)] * 2 + [ahead] + [now - timedelta(minutes=30)] * 2):
        producer.produce(topic, value=events(i, 1)[0].encode(), partition=0, timestamp=int(when.timestamp() * 1000))
    assert producer.flush(10) == 0
    spec = load_spec(spec_file(tmp_path, broker, topic))
    with caplog.at_level("WARNING", logger="microbatch"):
        bounded = make_source(spec).plan(BatchesLineage(), until=now)
    assert bounded.manifest.ranges == ((0, 0, 2),), "the bound stops at the record dated ahead"
    stamp = ahead.isoformat(timespec="seconds").replace("+00:00", "")
    [warning] = [r.getMessage() for r in caplog.records if "in the future" in r.getMessage()]
    assert f"topic {topic} partition 0 offset 2 is timestamped {stamp}" in warning and "manual run" in warning
    note = status(spec).note or ""
    assert f"partition 0 offset 2 is timestamped {stamp}" in note
    # A manual run (no interval) is not held.
    assert make_source(spec).plan(BatchesLineage()).manifest.ranges == ((0, 0, 5),)
