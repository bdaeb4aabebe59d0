"""A Kafka topic as a source, against a real Apache Kafka broker (KRaft, one
node, on loopback; tests/kafka_broker.py): what librdkafka's mock cluster
cannot show. Its topics have ids (KIP-516) that change when a topic is
deleted and created again, and it answers timestamp lookups
(`offsets_for_times`) from its time index."""

from __future__ import annotations

import gc
import time
from datetime import datetime, timedelta, timezone

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic
from deltalake import DeltaTable

from spark_jobs.core.delta_io import read_all
from spark_jobs.core.fencing import Position
from spark_jobs.core.inspect import status
from spark_jobs.core.ledger import OffsetLedger
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.errors import EXIT_TERMINAL, DataLossError, SourceChangedError, SourceError, exit_code
from spark_jobs.sources import make_source
from tests.conftest import BatchesLineage
from tests.spark_jobs.sources.test_kafka import abort_a_transaction, assert_exact, events, oracle, produce, run, spec_file


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    from tests.kafka_broker import KafkaBroker, KafkaJarsMissing

    try:
        started = KafkaBroker.start(tmp_path_factory.mktemp("kafka"))
    except KafkaJarsMissing as exc:
        pytest.fail(str(exc))  # never skipped: set-up fetches the JARs
    yield started.bootstrap
    gc.collect()  # clients the tests dropped, before their broker goes (else they log reconnects)
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
    # A rewind to 0 would read the new topic in place of the old one's
    # records: refused (issue 46), unless the loss is accepted.
    from spark_jobs.errors import RewindError

    with pytest.raises(RewindError, match="recreated .deleted and created again since"):
        rewind(spec, 0, run_id="test-rewind")
    path = spec_file(tmp_path, broker, topic, on_data_loss="skip")
    spec = load_spec(path)
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


def test_aborted_transactions_are_never_read_and_committed_ones_once(broker, tmp_path, compute):
    """The broker writes aborted records and their markers into the log:
    offsets the read must step over (read_committed), not count."""
    topic = "transactions"
    _create(broker, topic, 4)
    path = spec_file(tmp_path, broker, topic)
    committed = events(0, 30, bad_every=13)
    produce(broker, topic, committed[:12], transactional="tx-a")
    abort_a_transaction(broker, topic, "tx-b")
    produce(broker, topic, committed[12:], transactional="tx-a")
    abort_a_transaction(broker, topic, "tx-b")
    while run(path, compute) == "committed":
        pass
    lineage = assert_exact(path, committed)
    ends = lineage[-1].end_offsets[topic]
    assert set(ends) == {"0", "1", "2", "3"}
    assert sum(int(v) for v in ends.values()) > len(committed), "the markers and aborted records hold offsets too"


def test_partitions_added_while_the_pipeline_runs_are_read_from_their_start(broker, tmp_path, compute):
    topic = "growing"
    _create(broker, topic, 2)
    path = spec_file(tmp_path, broker, topic)
    first = events(0, 20, bad_every=7)
    produce(broker, topic, first, partition_of=lambda i: i % 2)
    assert run(path, compute) == "committed"
    admin = AdminClient({"bootstrap.servers": broker})
    admin.create_partitions([NewPartitions(topic, 4)])[topic].result(30)
    deadline = time.monotonic() + 30
    while len(admin.list_topics(topic, timeout=10).topics[topic].partitions) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    second = events(20, 40)
    produce(broker, topic, second)  # into all four
    while run(path, compute) == "committed":
        pass
    lineage = assert_exact(path, first + second)
    assert lineage[-1].end_offsets[topic] == {"0": 20, "1": 20, "2": 10, "3": 10}


@pytest.mark.parametrize("on_data_loss", ["fail", "skip"])
def test_records_deleted_before_they_were_read_fail_or_are_recorded_as_skipped(broker, tmp_path, compute, on_data_loss):
    """`DeleteRecords` moves a partition's log start, exactly as retention
    does when it deletes a segment: offsets the ledger still needs are gone."""
    topic = f"retention-{on_data_loss}"
    _create(broker, topic, 2)
    path = spec_file(tmp_path, broker, topic, on_data_loss=on_data_loss)
    values = events(0, 40, bad_every=9)
    produce(broker, topic, values[:20], partition_of=lambda i: i % 2)
    assert run(path, compute) == "committed"
    produce(broker, topic, values[20:], partition_of=lambda i: i % 2)  # offsets 10..19 of each partition
    admin = AdminClient({"bootstrap.servers": broker})
    [done] = admin.delete_records([TopicPartition(topic, 1, 14)]).values()
    assert done.result(30).low_watermark == 14
    spec = load_spec(path)
    if on_data_loss == "fail":
        rows = len(OffsetLedger(spec.ledger_path, spec.name).load().rows)
        with pytest.raises(DataLossError, match="partition 1 offsets 10..13") as caught:
            run(path, compute)
        assert exit_code(caught.value) == EXIT_TERMINAL
        assert len(OffsetLedger(spec.ledger_path, spec.name).load().rows) == rows, "nothing was written"
        return
    while run(path, compute) == "committed":
        pass
    lost = {21, 23, 25, 27}  # partition 1's offsets 10..13: the odd records of the second 20
    lineage = assert_exact(path, [v for i, v in enumerate(values) if i not in lost])
    assert [(1, 10, 14)] == [tuple(s) for r in lineage for s in r.manifest.get("skipped", [])]


def test_the_broker_stopped_mid_batch_fails_retryably_and_the_next_run_is_exact(tmp_path, compute, monkeypatch):
    """Killed between the plan and the read: once the read's stall timeout
    passes (shortened here from 120 s), the run fails with a retryable error
    (exit 1) and commits nothing; once the broker is back, the next run reads
    the planned range, and the pipeline is exact."""
    from spark_jobs.core import faults
    from spark_jobs.engine.kafka_read import STALL_TIMEOUT_ENV
    from tests.kafka_broker import KafkaBroker

    monkeypatch.setenv(STALL_TIMEOUT_ENV, "8")

    with KafkaBroker.start(tmp_path / "kafka") as own:
        topic = "stopped"
        _create(own.bootstrap, topic, 4)
        path = spec_file(tmp_path / "pipeline", own.bootstrap, topic)
        values = events(0, 40, bad_every=17)
        produce(own.bootstrap, topic, values)
        spec = load_spec(path)

        def stop_broker(point: str) -> None:
            if point == "after_plan":
                own.stop()

        faults.set_hook(stop_broker)
        try:
            with pytest.raises(SourceError) as caught:
                run(path, compute)
        finally:
            faults.set_hook(None)
        assert exit_code(caught.value) == 1, caught.value
        assert not DeltaTable.is_deltatable(spec.state_path), "nothing was committed"
        planned = OffsetLedger(spec.ledger_path, spec.name).load().rows
        assert [r.status.value for r in planned] == ["planned"]
        own.restart()
        while run(path, compute) == "committed":
            pass
        lineage = assert_exact(path, values)
        assert lineage[0].end_offsets == planned[0].end_offsets, "the planned range was the one read"


@pytest.mark.parametrize("on_data_loss", ["fail", "skip"])
def test_a_rewind_past_records_retention_deleted_is_refused_unless_the_loss_is_accepted(broker, tmp_path, compute, on_data_loss):
    """Issue 46, item 3, for Kafka: a rewind to batch 0 reads again what
    batch 1 read; after `DeleteRecords` (retention) the topic no longer has
    it. With `on_data_loss: fail` the rewind is refused by name and nothing
    changes; with `skip` the loss was accepted, so it goes on and the replay
    records what it skipped."""
    from spark_jobs.errors import RewindError

    topic = f"rewind-retention-{on_data_loss}"
    _create(broker, topic, 1)
    path = spec_file(tmp_path, broker, topic, on_data_loss=on_data_loss)
    values = events(0, 20)
    produce(broker, topic, values, partition_of=lambda i: 0)
    assert run(path, compute) == "committed"
    admin = AdminClient({"bootstrap.servers": broker})
    [done] = admin.delete_records([TopicPartition(topic, 0, 5)]).values()
    assert done.result(30).low_watermark == 5
    spec = load_spec(path)
    if on_data_loss == "fail":
        with pytest.raises(RewindError, match=r"cannot rewind to batch 0: .*records rewind-retention-fail/0 \[0, 20\) \(now 5\.\.20\)"):
            rewind(spec, 0, run_id="test")
        assert status(spec).position == Position(0, 1)
        return
    assert rewind(spec, 0, run_id="test").status == "rewound"
    assert run(path, compute) == "committed"
    state = read_all(DeltaTable(spec.state_path))
    got = {u: (n, c) for u, n, c in zip(*(state.column(k).to_pylist() for k in ("user_id", "events", "cents")))}
    assert got == oracle(values[5:])
