"""The real broker (tests/kafka_broker.py) starts and does what the mock cluster cannot.

librdkafka's mock cluster has no topic ids that change across a delete and
re-create; a real KRaft broker gives every incarnation of a topic name a new
id. That is what a source must notice to tell "the topic was re-created,
offsets start over" from "offsets went backwards".

Two things a reader of topic ids must know, both checked here:

* ``str(TopicDescription.topic_id)`` (librdkafka) is *standard* base64
  (``+`` and ``/``), while Kafka itself (its tools, logs and the
  ``partition.metadata`` files) writes the same 16 bytes as *URL-safe*
  base64 (``-`` and ``_``). Compare ids from the two sources only after
  translating one alphabet to the other.
* A topic made (or deleted) by the controller reaches the broker's metadata
  a moment later: describing it at once can answer "unknown topic", or the
  old incarnation. The helpers below wait for the broker's view.
"""

from __future__ import annotations

import gc
import re
import time

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from tests.kafka_broker import KafkaBroker, KafkaJarsMissing, jar_dir

TOPIC = "smoke"
PARTITIONS = 2
LIBRDKAFKA_UUID = re.compile(r"^[A-Za-z0-9+/]{22}$")  # 16 bytes, standard base64 without padding
TO_KAFKA_ALPHABET = str.maketrans("+/", "-_")
ZERO_UUID = "AAAAAAAAAAAAAAAAAAAAAA"  # Kafka's "no topic id"
WAIT = 20.0


@pytest.fixture
def broker(tmp_path):
    try:
        jar_dir()
    except KafkaJarsMissing as error:
        pytest.skip(f"no Kafka broker JARs: {error}")
    with KafkaBroker.start(tmp_path / "kafka") as running:
        yield running
        # Clients the test dropped can sit in reference cycles (their admin
        # futures); collected now, they end while the broker is up, instead
        # of reconnecting to its closed port once a second for the rest of
        # the suite.
        gc.collect()


def _code(error: KafkaException) -> int:
    return error.args[0].code()


def create(admin: AdminClient) -> None:
    """Create TOPIC, retrying while the deletion of the same name is still being completed."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            admin.create_topics([NewTopic(TOPIC, num_partitions=PARTITIONS, replication_factor=1)])[TOPIC].result(10)
            return
        except KafkaException as error:
            if _code(error) != KafkaError.TOPIC_ALREADY_EXISTS or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def describe(admin: AdminClient):
    """TOPIC's description once the broker's metadata has it, or None once the broker says it is gone."""
    try:
        return admin.describe_topics(TopicCollection([TOPIC]))[TOPIC].result(10)
    except KafkaException as error:
        if _code(error) == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        raise


def wait_for(check, what: str):
    deadline = time.monotonic() + WAIT
    while (value := check()) is None:
        assert time.monotonic() < deadline, f"not within {WAIT} s: {what}"
        time.sleep(0.1)
    return value


def end_offsets(admin: AdminClient) -> int:
    """The sum of TOPIC's partition end offsets (admin requests never auto-create a topic).

    Partition leadership reaches the broker just after the topic does: until
    then it answers "not leader", or, for a topic just re-created under the
    same name, "leader epoch is newer than broker epoch" (the new
    incarnation's epoch is ahead of the broker's metadata; seen on CI,
    2026-12-03). Both are retried, as Kafka's own clients retry them.
    """
    request = {TopicPartition(TOPIC, p): OffsetSpec.latest() for p in range(PARTITIONS)}

    def attempt() -> int | None:
        try:
            return sum(f.result(10).offset for f in admin.list_offsets(request).values())
        except KafkaException as error:
            if _code(error) in (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_LEADER_EPOCH):
                return None
            raise

    return wait_for(attempt, "the partitions' end offsets")


def assert_kafka_wrote(broker: KafkaBroker, librdkafka_id: str) -> None:
    """Partition 0's ``partition.metadata`` (Kafka's own text form) comes to hold this id.

    Waited for: the broker writes the file, and moves the deleted
    incarnation's folder away, just after its metadata changes.
    """
    expected = librdkafka_id.translate(TO_KAFKA_ALPHABET)
    path = broker.log_dir / f"{TOPIC}-0" / "partition.metadata"

    def written() -> str | None:
        try:
            found = re.search(r"^topic_id: (\S+)$", path.read_text(), re.M)
        except FileNotFoundError:
            return None
        return found.group(1) if found else None

    wait_for(lambda: True if written() == expected else None, f"{path} holds topic_id {expected}")


def test_recreated_topic_gets_a_new_topic_id(broker):
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    create(admin)
    first = wait_for(lambda: describe(admin), "the broker sees the new topic")
    old_id = str(first.topic_id)
    assert LIBRDKAFKA_UUID.match(old_id) and old_id != ZERO_UUID, old_id
    assert len(first.partitions) == PARTITIONS
    # The same id as Kafka's own, in the other base64 alphabet.
    assert_kafka_wrote(broker, old_id)

    delivered = []
    producer = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True})
    for i in range(5):
        producer.produce(TOPIC, key=b"%d" % i, value=b"v%d" % i, on_delivery=lambda e, m: delivered.append((e, m)))
    assert producer.flush(WAIT) == 0
    assert [e for e, _ in delivered] == [None] * 5
    # Gone before the delete: a live producer refreshing its metadata could
    # create the topic again (auto.create.topics.enable=true).
    del producer
    assert end_offsets(admin) == 5

    admin.delete_topics([TOPIC])[TOPIC].result(10)
    wait_for(lambda: True if describe(admin) is None else None, "the broker drops the deleted topic")
    create(admin)
    second = wait_for(lambda: describe(admin), "the broker sees the re-created topic")
    new_id = str(second.topic_id)

    assert LIBRDKAFKA_UUID.match(new_id) and new_id != ZERO_UUID, new_id
    assert new_id != old_id
    assert len(second.partitions) == PARTITIONS
    assert end_offsets(admin) == 0  # a new log under the old name, not the old one
    assert_kafka_wrote(broker, new_id)
