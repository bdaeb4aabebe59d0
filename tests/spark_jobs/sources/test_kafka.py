"""A Kafka topic as a source (issue 12), against librdkafka's mock cluster.

The mock cluster (tests/kafka_cluster.py) is a real Kafka protocol server on
loopback: metadata, produce, fetch and list-offsets requests, idempotent and
transactional producers, transaction markers taking offsets. What it does
not do, and what is tested instead:

* **read_committed.** Its fetch answers list no aborted transactions and its
  last stable offset is the high watermark (librdkafka's
  ``rd_kafka_mock_handle_Fetch``), so records a producer had *sent* before
  aborting are visible to every client. Tested: transactions aborted before
  their records left the producer are never counted, committed
  transactions' markers leave offset gaps that ranges complete across, and
  the consumers ask for ``read_committed`` (which real brokers enforce).
* **Timestamp lookups** (``offsets_for_times`` answers -1) and **deleting
  records** (DeleteRecords is unsupported) and **adding partitions**
  (CreatePartitions times out): the tests wrap the real consumer so that
  those answers come from the records themselves (a broker's time index), a
  raised low watermark, or partitions hidden until "added". The planning
  code under test is unchanged; only the broker's answer is stood in for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition
from deltalake import DeltaTable

from spark_jobs.core.delta_io import read_all
from spark_jobs.core.faults import POINTS
from spark_jobs.core.ledger import OffsetLedger
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.errors import DataLossError, SourceChangedError, SourceError, SpecError, exit_code
from spark_jobs.sources import kafka as kafka_source
from spark_jobs.sources import make_source
from spark_jobs.sources.base import Caps
from spark_jobs.sources.kafka import fair_shares
from tests.conftest import ROOT, BatchesLineage, crash_at, reach, run_cli

TRANSFORM = (
    "SELECT user_id, count(*) AS events, sum(amount_cents) AS cents, max(_kafka_offset) AS last_offset "
    "FROM batch GROUP BY user_id"
)


def start_cluster() -> tuple[subprocess.Popen[str], str]:
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.kafka_cluster"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    line = server.stdout.readline()
    assert line.startswith("BOOTSTRAP "), f"mock cluster did not start: {line!r}"
    return server, line.split()[1]


def stop_cluster(server: subprocess.Popen[str]) -> None:
    server.stdin.close()
    server.wait(30)


@pytest.fixture(scope="module")
def kafka():
    """Bootstrap servers of a mock cluster shared by this module's tests (each uses its own topic)."""
    server, servers = start_cluster()
    yield servers
    stop_cluster(server)


@pytest.fixture
def topic(request) -> str:
    return "t-" + request.node.name.replace("[", "-").replace("]", "")[:80]


def produce(servers: str, topic: str, values: list[str], *, partition_of=lambda i: i % 4, transactional: str | None = None) -> None:
    settings = {"bootstrap.servers": servers, "enable.idempotence": True, "log_level": 2}
    if transactional:
        settings["transactional.id"] = transactional
    producer = Producer(settings)
    if transactional:
        producer.init_transactions(10)
        producer.begin_transaction()
    for i, value in enumerate(values):
        producer.produce(topic, value=value.encode(), key=f"k{i}".encode(), partition=partition_of(i))
    if transactional:
        producer.commit_transaction(10)
    producer.flush(10)


def abort_a_transaction(servers: str, topic: str, transactional_id: str) -> None:
    """Five records in a transaction aborted before they left the producer:
    never visible (a valid record for u0 worth 1,000,000 cents, so that
    counting one shows)."""
    producer = Producer({"bootstrap.servers": servers, "transactional.id": transactional_id, "log_level": 2})
    producer.init_transactions(10)
    producer.begin_transaction()
    for i in range(5):
        producer.produce(topic, value=b'{"event_id": "aborted", "user_id": "u0", "amount_cents": 1000000}', partition=i % 4)
    producer.abort_transaction(10)


def events(start: int, count: int, *, users: int = 7, bad_every: int | None = None) -> list[str]:
    return [
        "{not json" if bad_every and i % bad_every == 0 else json.dumps({"event_id": f"e{i}", "user_id": f"u{i % users}", "amount_cents": i})
        for i in range(start, start + count)
    ]


def spec_file(folder: Path, servers: str, topic: str, **source) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "name": "kclicks",
        "source": {
            "type": "kafka",
            "bootstrap_servers": servers,
            "topic": topic,
            "format": "json",
            "schema": "event_id STRING, user_id STRING, amount_cents BIGINT",
            **source,
        },
        "transform": TRANSFORM,
        "state": {"path": "state", "keys": ["user_id"], "merge": {"events": "sum", "cents": "sum", "last_offset": "max"}},
        "checkpoint": "checkpoint",
        "batch": {"max_records": 90},
    }
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def oracle(values: list[str]) -> dict[str, tuple[int, int]]:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for value in values:
        try:
            record = json.loads(value)
        except json.JSONDecodeError:
            continue
        totals[record["user_id"]][0] += 1
        totals[record["user_id"]][1] += record["amount_cents"]
    return {user: (n, cents) for user, (n, cents) in totals.items()}


def assert_exact(path: Path, values: list[str]) -> list:
    """Contiguous batches whose ranges join end to end, state equal to the
    records' fold, and every malformed record quarantined once."""
    spec = load_spec(path)
    lineage = OffsetLedger(spec.ledger_path, spec.name).load().lineage()
    assert [r.batch_id for r in lineage] == list(range(1, len(lineage) + 1)), "batch ids not contiguous"
    for previous, row in zip(lineage, lineage[1:]):
        assert row.start_offsets == previous.end_offsets, f"gap or overlap before batch {row.batch_id}"
    covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for row in lineage:
        for p, s, e in row.manifest["ranges"]:
            covered[p].append((s, e))
    for p, spans in covered.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"partition {p} read twice"
    state = read_all(DeltaTable(spec.state_path))
    got = {u: (n, c) for u, n, c in zip(*(state.column(k).to_pylist() for k in ("user_id", "events", "cents")))}
    assert got == oracle(values), "state differs from the records' fold"
    quarantined = read_all(DeltaTable(spec.quarantine_path))
    bad = sum(1 for v in values if v.startswith("{not"))
    places = list(zip(quarantined.column("file").to_pylist(), quarantined.column("line").to_pylist()))
    assert len(places) == len(set(places)) == bad, "malformed records quarantined exactly once"
    return lineage


def run(path: Path, compute, **options) -> str:
    return run_batch(load_spec(path), RunOptions(run_id="test", **options), compute_factory=compute).status


# -- planning (no JVM) -------------------------------------------------------------


class EndsAt:
    """A lineage ending at given offsets (ones no plan of the test made)."""

    def __init__(self, end: dict) -> None:
        self.end = end

    def consumed(self, keys) -> dict:
        return {}


def test_fair_shares_never_exceed_the_cap_and_never_starve():
    assert fair_shares({0: 100, 1: 5, 2: 100}, 60) == {0: 28, 1: 5, 2: 27}
    assert sum(fair_shares({0: 3, 1: 3, 2: 3, 3: 3}, 2).values()) == 2
    assert fair_shares({0: 1, 1: 9}, 1) == {0: 0, 1: 1}, "the remainder goes to the partition furthest behind"
    assert fair_shares({0: 0, 1: 0}, 5) == {0: 0, 1: 0}
    assert fair_shares({0: 4, 1: 2}, 100) == {0: 4, 1: 2}


def test_batches_are_per_partition_ranges_under_the_cap(kafka, topic, tmp_path):
    produce(kafka, topic, events(0, 100), partition_of=lambda i: 0 if i < 70 else 1 + i % 3)
    source = make_source(load_spec(spec_file(tmp_path, kafka, topic)))
    batches: list = []
    while (batch := source.plan(BatchesLineage(*batches))) is not None:
        batches.append(batch)
        assert sum(e - s for _, s, e in batch.manifest.ranges) <= 90
    first = batches[0].manifest.ranges
    assert first == ((0, 0, 70), (1, 0, 10), (2, 0, 10), (3, 0, 10)) or sum(e - s for _, s, e in first) == 90
    ends = batches[-1].end.to_dict()[topic]
    assert ends == {"0": 70, "1": 10, "2": 10, "3": 10}
    assert len(batches) == 2 and batches[1].start == batches[0].end
    assert source.lag(BatchesLineage(*batches)).count == 0
    lag = source.lag(BatchesLineage(batches[0]))
    assert lag.count == 10 and lag.unit == "records" and lag.detail, "lag per partition"


def test_latest_pins_the_offsets_once_then_reads_what_came_after(kafka, topic, tmp_path):
    produce(kafka, topic, events(0, 20))
    source = make_source(load_spec(spec_file(tmp_path, kafka, topic, starting_offsets="latest")))
    assert source.lag(BatchesLineage()).count == 1, "a sensor must let the pinning run through"
    pin = source.plan(BatchesLineage())
    assert pin.manifest.ranges == () and pin.end.to_dict()[topic] == {"0": 5, "1": 5, "2": 5, "3": 5}
    assert source.lag(BatchesLineage(pin)).count == 0
    assert source.plan(BatchesLineage(pin)) is None, "a batch that moves no offset is never planned"
    produce(kafka, topic, events(20, 4))
    after = source.plan(BatchesLineage(pin))
    assert after.manifest.ranges == ((0, 5, 6), (1, 5, 6), (2, 5, 6), (3, 5, 6))


def test_a_topic_not_created_yet_waits_and_a_recreated_topic_is_refused(kafka, topic, tmp_path):
    source = make_source(load_spec(spec_file(tmp_path, kafka, topic)))
    assert source.plan(BatchesLineage()) is None
    produce(kafka, topic, events(0, 40))
    consumed = source.plan(BatchesLineage())
    assert consumed.end.to_dict()["@cluster"], "offsets name the cluster they count in"
    # The "same" topic on a new cluster: its offsets mean nothing to this ledger.
    server, other = start_cluster()
    try:
        produce(other, topic, events(0, 80))
        again = make_source(load_spec(spec_file(tmp_path / "again", other, topic)))
        with pytest.raises(SourceChangedError, match="offsets mean nothing there") as caught:
            again.plan(BatchesLineage(consumed))
        assert exit_code(caught.value) == 2
        # Recreated on the same cluster with fewer records: offsets beyond its end.
        with pytest.raises(SourceChangedError, match="ends at offset 20, but this pipeline has read it up to 90"):
            again.plan(EndsAt({topic: {"0": 90, "1": 10, "2": 10, "3": 10}}))
    finally:
        stop_cluster(server)


def test_an_unreachable_broker_is_retryable_and_writes_nothing(tmp_path, topic):
    path = spec_file(tmp_path, "127.0.0.1:1", topic)
    result = run_cli("run", str(path))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "cannot reach Kafka at 127.0.0.1:1" in result.stderr
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "state").exists(), "nothing written"


class StandInBroker:
    """The real consumer, with the answers the mock cluster cannot give
    stood in for (see the module docstring): timestamps looked up from the
    records, a low watermark raised as retention would, partitions hidden."""

    def __init__(self, consumer: Consumer, *, low: dict[int, int] | None = None, hidden: set[int] | None = None) -> None:
        self.consumer, self.low, self.hidden = consumer, low or {}, hidden or set()

    def __getattr__(self, name):
        return getattr(self.consumer, name)

    def list_topics(self, topic, timeout):
        metadata = self.consumer.list_topics(topic, timeout=timeout)
        for p in self.hidden:
            metadata.topics[topic].partitions.pop(p, None)
        return metadata

    def get_watermark_offsets(self, tp, timeout):
        low, high = self.consumer.get_watermark_offsets(tp, timeout=timeout)
        return max(low, self.low.get(tp.partition, low)), high

    def offsets_for_times(self, tps, timeout):
        answers = []
        for tp in tps:
            reader = Consumer({"bootstrap.servers": self.consumer_servers, "group.id": "t", "enable.partition.eof": True})
            reader.assign([TopicPartition(tp.topic, tp.partition, 0)])
            found = -1
            while (message := reader.poll(5)) is not None and not message.error():
                if message.timestamp()[1] >= tp.offset:
                    found = message.offset()
                    break
            reader.close()
            answers.append(TopicPartition(tp.topic, tp.partition, found))
        return answers


def stand_in(monkeypatch, servers: str, **kwargs) -> None:
    real = kafka_source.KafkaClient.consumer

    def consumer(self):
        broker = StandInBroker(real(self), **kwargs)
        broker.consumer_servers = servers
        return broker

    monkeypatch.setattr(kafka_source.KafkaClient, "consumer", consumer)


def test_a_data_interval_bounds_each_partition_by_record_time(kafka, topic, tmp_path, monkeypatch):
    stand_in(monkeypatch, kafka)
    produce(kafka, topic, events(0, 8))
    import time

    time.sleep(0.05)
    cut = datetime.now(timezone.utc)
    time.sleep(0.05)
    produce(kafka, topic, events(8, 4))
    source = make_source(load_spec(spec_file(tmp_path, kafka, topic)))
    bounded = source.plan(BatchesLineage(), until=cut)
    assert bounded.manifest.ranges == ((0, 0, 2), (1, 0, 2), (2, 0, 2), (3, 0, 2)), "records timestamped before the end"
    assert source.plan(BatchesLineage(bounded), until=cut) is None, "a re-run of the interval finds it consumed"
    assert source.plan(BatchesLineage(bounded), until=cut + timedelta(hours=1)).manifest.ranges == (
        (0, 2, 3), (1, 2, 3), (2, 2, 3), (3, 2, 3),
    )


def test_records_deleted_by_retention_fail_or_are_recorded_as_skipped(kafka, topic, tmp_path, monkeypatch):
    produce(kafka, topic, events(0, 40))
    path = spec_file(tmp_path, kafka, topic)
    first = make_source(load_spec(path)).plan(BatchesLineage(), caps=Caps(max_records=8))
    assert first.end.to_dict()[topic] == {"0": 2, "1": 2, "2": 2, "3": 2}
    stand_in(monkeypatch, kafka, low={1: 6})
    with pytest.raises(DataLossError, match="partition 1 offsets 2..5") as caught:
        make_source(load_spec(path)).plan(BatchesLineage(first))
    assert exit_code(caught.value) == 2
    skipping = make_source(load_spec(spec_file(tmp_path, kafka, topic, on_data_loss="skip")))
    after = skipping.plan(BatchesLineage(first))
    assert after.manifest.skipped == ((1, 2, 6),) and after.manifest.to_dict()["skipped"] == [[1, 2, 6]]
    assert (1, 6, 10) in after.manifest.ranges
    with pytest.raises(SourceChangedError, match="rewind"):
        make_source(load_spec(path)).verify(first)  # planned earlier, deleted before its replay


def test_partitions_added_later_are_read_from_their_start(kafka, topic, tmp_path, monkeypatch):
    produce(kafka, topic, events(0, 40))
    path = spec_file(tmp_path, kafka, topic, starting_offsets="latest")
    stand_in(monkeypatch, kafka, hidden={2, 3})
    pin = make_source(load_spec(path)).plan(BatchesLineage())
    assert pin.end.to_dict()[topic] == {"0": 10, "1": 10}
    monkeypatch.undo()
    after = make_source(load_spec(path)).plan(BatchesLineage(pin))
    assert after.manifest.ranges == ((2, 0, 10), (3, 0, 10)), "new partitions from their start, known ones from the ledger"
    # A partition added while retention already deleted some of its records: those are lost records.
    stand_in(monkeypatch, kafka, low={3: 4})
    with pytest.raises(DataLossError, match="partition 3 offsets 0..3"):
        make_source(load_spec(path)).plan(BatchesLineage(pin))


def test_secrets_from_the_environment_reach_librdkafka_and_nothing_else(kafka, topic, tmp_path, compute, monkeypatch):
    secret = "kafka-secret-5be0c1d2"  # noqa: S105 - a marker to search for
    monkeypatch.setenv("MICROBATCH_KAFKA_SASL_PASSWORD", secret)
    monkeypatch.setenv("MICROBATCH_KAFKA_CLIENT_ID", "from-the-environment")
    produce(kafka, topic, events(0, 20, bad_every=9))
    path = spec_file(tmp_path, kafka, topic)
    source = make_source(load_spec(path))
    assert source.client.settings["client.id"] == "from-the-environment"
    assert source.client.settings["sasl.password"] == secret and secret not in repr(source.client)
    result = run_cli("run", str(path), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert secret not in result.stdout + result.stderr
    for table in (tmp_path / "checkpoint").iterdir():
        for f in table.rglob("*"):
            assert not f.is_file() or secret.encode() not in f.read_bytes(), f"secret in {f}"
    for f in (tmp_path / "state").rglob("*"):
        assert not f.is_file() or secret.encode() not in f.read_bytes(), f"secret in {f}"


def test_settings_precedence_callbacks_and_the_jobs_own(kafka, topic, tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_KAFKA_CLIENT_ID", "from-env")
    monkeypatch.setenv("MICROBATCH_KAFKA_AUTO_OFFSET_RESET", "earliest")
    spec = load_spec(spec_file(tmp_path, kafka, topic, options={"client.id": "from-spec", "group.id": "acl-group"}))
    with kafka_source.connection_settings({"client.id": "from-connection", "error_cb": "my.module.cb"}):
        settings = make_source(spec).client.settings
    assert settings["client.id"] == "from-connection", "a named connection wins over the environment"
    assert settings["group.id"] == "acl-group" and "error_cb" not in settings
    assert settings["auto.offset.reset"] == "error" and settings["isolation.level"] == "read_committed"
    assert make_source(spec).client.settings["client.id"] == "from-env"


def test_a_fetch_whose_offsets_are_gone_fails_instead_of_jumping(kafka, topic):
    """`auto.offset.reset=error`: asked for offsets the partition does not
    have (what retention deleting them mid-fetch looks like), the fetch fails;
    librdkafka's default would jump to the end and finish the range empty."""
    from spark_jobs.engine.kafka_read import _read_range

    produce(kafka, topic, events(0, 8))
    settings = {"bootstrap.servers": kafka, "group.id": "t", "auto.offset.reset": "error", "enable.partition.eof": True}
    consumer = kafka_source.KafkaClient(settings).consumer()
    try:
        assert list(_read_range(consumer, topic, 0, 0, 2, stall_s=30))[0].num_rows == 2
        with pytest.raises(OSError, match="retention deleted them"):
            list(_read_range(consumer, topic, 0, 50, 60, stall_s=30))
    finally:
        consumer.close()


def test_a_run_with_nothing_new_starts_no_jvm(kafka, topic, tmp_path):
    produce(kafka, topic, events(0, 4))
    path = spec_file(tmp_path, kafka, topic, starting_offsets="latest")
    spec = load_spec(path)
    pinned = run_cli("run", str(path), "--json")  # the pin batch creates the tables
    assert json.loads(pinned.stdout)["status"] == "committed", pinned.stderr[-2000:]

    def no_engine():
        raise AssertionError("Spark started for a run with nothing new")

    assert run_batch(spec, RunOptions(run_id="test"), compute_factory=no_engine).status == "no_new_data"


# -- with Spark -------------------------------------------------------------------


def test_transactions_idempotence_and_bad_records_exact_through_a_crash_at_every_point(kafka, topic, tmp_path, compute):
    values: list[str] = []

    def send(count: int, *, tx: str | None = None, bad_every: int | None = 11) -> None:
        new = events(len(values), count, bad_every=bad_every)
        produce(kafka, topic, new, transactional=tx)
        values.extend(new)

    abort_a_transaction(kafka, topic, f"{topic}-aborting")
    for i, point in enumerate(POINTS):
        send(60, tx=f"{topic}-tx" if i % 2 else None)
        path = spec_file(tmp_path, kafka, topic)
        reach(point, path)
        with crash_at(point):
            run(path, compute)
        # The next run redoes the batch, or (a crash after the state commit) completes it.
        assert run(path, compute) in ("committed", "no_new_data")
    while run(path, compute) != "no_new_data":
        pass
    lineage = assert_exact(path, values)
    markers = sum(e - s for r in lineage for _, s, e in r.manifest["ranges"]) - len(values)
    assert markers >= 4, "committed transactions' markers took offsets the ranges spanned"
    assert sum(r.records_in for r in lineage) == len(values)


def test_kafka_chained_to_a_delta_source_is_exact_after_kills_at_both_stages(kafka, topic, tmp_path, compute):
    values = events(0, 150, users=9, bad_every=13)
    produce(kafka, topic, values[:100])
    upstream = spec_file(tmp_path, kafka, topic)
    spec = yaml.safe_load(upstream.read_text())
    spec["state"]["change_feed"] = True
    upstream.write_text(yaml.safe_dump(spec))
    downstream = tmp_path / "downstream.yaml"
    downstream.write_text(
        yaml.safe_dump(
            {
                "name": "kbuckets",
                "source": {"type": "delta", "path": "state", "read": "changes"},
                "transform": (
                    "SELECT substr(user_id, -1, 1) AS bucket, sum(CASE WHEN _change_type IN ('insert', "
                    "'update_postimage') THEN cents WHEN _change_type IN ('delete', 'update_preimage') THEN -cents "
                    "ELSE 0 END) AS cents FROM batch GROUP BY substr(user_id, -1, 1)"
                ),
                "state": {"path": "buckets", "keys": ["bucket"], "merge": {"cents": "sum"}},
                "checkpoint": "checkpoint_buckets",
            }
        )
    )
    assert run(upstream, compute) == "committed"
    assert run(downstream, compute) == "committed"
    with crash_at("after_state_commit"):
        run(upstream, compute)
    produce(kafka, topic, values[100:])
    with crash_at("mid_state_merge"):
        run(downstream, compute)
    while run(upstream, compute) != "no_new_data":
        pass
    with crash_at("after_plan"):
        run(downstream, compute)
    while run(downstream, compute) != "no_new_data":
        pass
    assert_exact(upstream, values)
    buckets = read_all(DeltaTable(str(tmp_path / "buckets")))
    expected: dict[str, int] = defaultdict(int)
    for user, (_, cents) in oracle(values).items():
        expected[user[-1]] += cents
    assert dict(zip(buckets.column("bucket").to_pylist(), buckets.column("cents").to_pylist())) == expected


@pytest.mark.slow  # the main suite's chaos test starts overlapping runs too (tests/spark_jobs/test_kafka_chaos.py)
def test_concurrent_runs_commit_each_record_once(kafka, topic, tmp_path):
    values = events(0, 300, bad_every=17)
    produce(kafka, topic, values)
    path = spec_file(tmp_path, kafka, topic)
    env = {**os.environ}
    runs = [
        subprocess.Popen([sys.executable, "-m", "spark_jobs", "run", str(path), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        for _ in range(3)
    ]
    for proc in runs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    while json.loads(run_cli("run", str(path), "--json").stdout)["status"] != "no_new_data":
        pass
    assert_exact(path, values)


def test_text_format_and_null_values(kafka, topic, tmp_path, compute):
    produce(kafka, topic, ["plain line", "another"], partition_of=lambda i: 0)
    producer = Producer({"bootstrap.servers": kafka, "log_level": 2})
    producer.produce(topic, value=None, key=b"gone", partition=0)
    producer.produce(topic, value=b"\xff\xfe not utf-8", partition=0)
    producer.flush(10)
    path = tmp_path / "text.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "klines",
                "source": {"type": "kafka", "bootstrap_servers": kafka, "topic": topic, "format": "text"},
                "transform": "SELECT value AS line, count(*) AS seen, max(_kafka_key) AS key FROM batch GROUP BY value",
                "state": {"path": "lines", "keys": ["line"], "merge": {"seen": "sum", "key": "last"}},
                "checkpoint": "checkpoint_lines",
            }
        )
    )
    assert run(path, compute) == "committed"
    lines = read_all(DeltaTable(str(tmp_path / "lines")))
    assert sorted(lines.column("line").to_pylist()) == ["another", "plain line"]
    quarantine = read_all(DeltaTable(str(tmp_path / "checkpoint_lines" / "quarantine")))
    reasons = dict(zip(quarantine.column("line").to_pylist(), quarantine.column("reason").to_pylist()))
    assert set(quarantine.column("file").to_pylist()) == {f"kafka://{topic}/0"}
    assert "no value" in reasons[2] and "not valid UTF-8" in reasons[3]


def test_event_time_judges_kafka_records_by_the_watermark_before_them(kafka, topic, tmp_path, compute):
    """Event time over Kafka (records numbered by partition and offset): a
    record older than the watermark the batch before left goes to the
    quarantine, named by its partition and offset. Of the columns Kafka adds,
    only `_kafka_timestamp` can be an event time: `_kafka_key` is refused."""
    start = datetime(2026, 12, 1, 10, 0, tzinfo=timezone.utc)

    def at(minutes: list[int]) -> list[str]:
        return [json.dumps({"event_id": f"m{m}", "user_id": "u0", "amount_cents": m, "ts": (start + timedelta(minutes=m)).isoformat()}) for m in minutes]

    path = spec_file(tmp_path, kafka, topic, schema="event_id STRING, user_id STRING, amount_cents BIGINT, ts TIMESTAMP")
    spec = yaml.safe_load(path.read_text())
    spec["event_time"] = {"column": "ts", "delay": "10 minutes"}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    produce(kafka, topic, at([30, 0, 25]), partition_of=lambda i: 0)
    assert run(path, compute) == "committed"  # watermark 10:20
    produce(kafka, topic, at([15, 40]), partition_of=lambda i: 0)  # 15 is late
    assert run(path, compute) == "committed"  # watermark 10:30
    rows = sorted((r for r in OffsetLedger(str(tmp_path / "checkpoint" / "offsets"), "kclicks").load().rows if r.status == "committed"), key=lambda r: r.batch_id)
    assert [(r.records_late, r.watermark) for r in rows] == [(0, start + timedelta(minutes=20)), (1, start + timedelta(minutes=30))]
    (late,) = read_all(DeltaTable(str(tmp_path / "checkpoint" / "quarantine"))).to_pylist()
    assert (late["file"], late["line"]) == (f"kafka://{topic}/0", 3)
    assert late["reason"] == "late: event time 2026-12-01T10:15:00Z is before the watermark 2026-12-01T10:20:00Z"
    state = read_all(DeltaTable(str(tmp_path / "state"))).to_pylist()
    assert [(r["events"], r["cents"]) for r in state] == [(4, 30 + 0 + 25 + 40)]
    spec["event_time"] = {"column": "_kafka_key", "delay": "1 hour"}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SpecError, match="field `event_time.column`: '_kafka_key' is STRING"):
        load_spec(path)


def test_dedup_counts_a_producer_s_retry_once_across_partitions_and_batches(kafka, topic, tmp_path, compute):
    """`dedup` over Kafka: a record sent again (its `event_id` again, in
    another partition, in the same batch or a later one) counts once, and
    each batch counts the ones it dropped. A Kafka column can be a key too."""
    path = spec_file(tmp_path, kafka, topic)
    spec = yaml.safe_load(path.read_text())
    spec["dedup"] = {"key": ["event_id"]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    sent = events(0, 40)
    produce(kafka, topic, sent[:30] + sent[:5])  # the retries land in other partitions (index mod 4)
    assert run(path, compute) == "committed"
    produce(kafka, topic, sent[5:10] + sent[30:])  # five retries of the first batch's, ten new
    assert run(path, compute) == "committed"
    rows = sorted((r for r in OffsetLedger(str(tmp_path / "checkpoint" / "offsets"), "kclicks").load().rows if r.status == "committed"), key=lambda r: r.batch_id)
    assert [(r.records_in, r.records_duplicate) for r in rows] == [(35, 5), (15, 5)]
    state = read_all(DeltaTable(str(tmp_path / "state"))).to_pylist()
    assert sum(r["events"] for r in state) == 40 and sum(r["cents"] for r in state) == sum(range(40))
    spec["dedup"] = {"key": ["_kafka_key"]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert load_spec(path).dedup is not None


def test_a_broker_down_mid_life_fails_retryably_with_nothing_written(tmp_path, topic, compute):
    server, servers = start_cluster()
    produce(servers, topic, events(0, 20))
    path = spec_file(tmp_path, servers, topic)
    assert run(path, compute) == "committed"
    produce(servers, topic, events(20, 20))
    stop_cluster(server)
    before = OffsetLedger(load_spec(path).ledger_path, "kclicks").load().position
    failed = run_cli("run", str(path))
    assert failed.returncode == 1 and "cannot reach Kafka" in failed.stderr, failed.stderr[-2000:]
    assert OffsetLedger(load_spec(path).ledger_path, "kclicks").load().position == before
    with pytest.raises(SourceError):
        make_source(load_spec(path)).plan(BatchesLineage())


def test_the_example_spec_runs_on_a_cluster_named_by_the_environment(kafka, tmp_path, compute, monkeypatch):
    """dags/pipelines/kafka_clicks.yaml as shipped, its brokers from MICROBATCH_KAFKA_BOOTSTRAP_SERVERS."""
    import shutil

    example = tmp_path / "kafka_clicks.yaml"
    shutil.copy(ROOT / "dags" / "pipelines" / "kafka_clicks.yaml", example)
    values = [json.dumps({"event_id": f"e{i}", "user_id": f"u{i % 3}", "amount_cents": i, "ts": "2026-11-23T10:00:00Z"}) for i in range(30)]
    produce(kafka, "clicks", values)
    monkeypatch.setenv("MICROBATCH_KAFKA_BOOTSTRAP_SERVERS", kafka)
    assert run(example, compute) == "committed"
    state = read_all(DeltaTable(str(tmp_path / "lakehouse" / "kafka_clicks")))
    assert sum(state.column("events").to_pylist()) == 30 and sum(state.column("cents").to_pylist()) == sum(range(30))


def test_history_and_status_show_offsets_and_lag_per_partition(kafka, tmp_path, compute):
    produce(kafka, "hist", events(0, 12))
    path = spec_file(tmp_path, kafka, "hist")
    assert run(path, compute, max_records=8) == "committed"
    history = run_cli("history", str(path))
    assert "hist 0:2 1:2 2:2 3:2" in history.stdout, history.stdout
    status = json.loads(run_cli("status", str(path), "--json").stdout)
    lag = status["lag"]
    assert {k: lag[k] for k in ("count", "unit", "future", "parts")} == {
        "count": 4, "unit": "records", "future": 0, "parts": {"hist/0": 1, "hist/1": 1, "hist/2": 1, "hist/3": 1}
    }
    # `status` dates what waits by the first waiting record's timestamp (produced moments ago).
    assert lag["oldest_at"] is not None and 0 <= lag["oldest_age_s"] < 600
