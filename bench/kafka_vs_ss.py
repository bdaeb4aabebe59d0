"""Kafka side by side: Structured Streaming's Kafka source against this project, in one run.

A real Apache Kafka 4.4.0 broker (KRaft, one node on loopback; the JARs
`make jars` fetched, `jars/kafka/pom.xml`) holds one topic of 4 partitions
with 100,000 click events (JSON values). In turn, each from a fresh
checkpoint and in a new process, as a scheduler runs them:

* this project: `microbatch run` of a Kafka pipeline, one batch of all the
  records (planning, Spark's start, the fetch on the executors, parsing,
  the Delta state's merge and commit);
* the anchor: Spark's own Kafka source (spark-sql-kafka, `jars/spark`),
  `Trigger.AvailableNow`, the same aggregation with RocksDB state
  (`bench/anchors/structured_streaming.py --kafka`). Its sink is `noop`,
  which favours it: the project writes a queryable Delta table.

Both must count every record (checked: the project's `records_in`, the
anchor's `numInputRows`). The ratio is taken pair by pair. Results go to
docs/benchmarks.md, section "Kafka side by side".

    .venv/bin/python bench/kafka_vs_ss.py [--rounds 5] [--records 100000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from harness import SCHEMA, measured_by, microbatch, scratch, ss_anchor, write_section, write_spec
from spark_jobs.demo.clickstream import write_wave

TOPIC = "bench_clicks"
PARTITIONS = 4


def click_lines(landing: Path, records: int) -> list[str]:
    """`records` click events as 4 JSON-lines files in `landing`, and their lines."""
    write_wave(landing, 0, files=4, records_per_file=records // 4, users=100_000, seed=11)
    return [line for f in sorted(landing.rglob("*.json")) for line in f.read_text().splitlines() if line.strip()]


def produce(servers: str, lines: list[str]) -> float:
    """The topic, made; each line one record of it, round-robin over the partitions; seconds taken to produce."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": servers})  # held: a collected client cancels its requests
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result(30)
    deadline = time.monotonic() + 30  # the broker's metadata follows the controller's answer
    while len(getattr(admin.list_topics(TOPIC, timeout=10).topics.get(TOPIC), "partitions", {})) < PARTITIONS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {TOPIC} did not appear")
        time.sleep(0.2)
    producer = Producer({"bootstrap.servers": servers, "linger.ms": 20, "batch.num.messages": 10_000, "log_level": 2})
    started = time.perf_counter()
    for i, line in enumerate(lines):
        while True:
            try:
                producer.produce(TOPIC, value=line.encode(), partition=i % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0, "records left unsent"
    return time.perf_counter() - started


def project(spec: Path) -> tuple[float, int]:
    """One batch of every record, from a fresh state and checkpoint: seconds, records read."""
    shutil.rmtree(spec.parent / "lake", ignore_errors=True)
    took, stdout = microbatch(spec)
    return took, json.loads(stdout)["records_in"]


def anchor(servers: str, checkpoint: Path) -> tuple[float, int]:
    shutil.rmtree(checkpoint, ignore_errors=True)
    took, report = ss_anchor("--kafka", servers, "--topic", TOPIC, "--checkpoint", checkpoint)
    return took, sum(b["rows"] for b in report["batches"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()

    from tests.kafka_broker import KafkaBroker

    with scratch("kafka-ss") as work, KafkaBroker.start(work / "kafka") as broker:
        lines = click_lines(work / "landing", args.records)
        produce_s = produce(broker.bootstrap, lines)
        print(f"{len(lines):,} records produced to {PARTITIONS} partitions in {produce_s:.1f} s", flush=True)
        source = {
            "type": "kafka",
            "bootstrap_servers": broker.bootstrap,
            "topic": TOPIC,
            "format": "json",
            "schema": SCHEMA,
        }
        spec = write_spec(work / "project", "from_kafka", source=source, batch={"max_records": 1_000_000})
        ours: list[float] = []
        theirs: list[float] = []
        for round_ in range(args.rounds + 1):  # round 0 warms both (file caches, class archives)
            took_p, read_p = project(spec)
            took_s, read_s = anchor(broker.bootstrap, work / "ss_checkpoint")
            assert read_p == read_s == len(lines), (read_p, read_s, len(lines))
            print(f"round {round_}: project {took_p:.2f} s, Structured Streaming {took_s:.2f} s", flush=True)
            if round_:
                ours.append(took_p)
                theirs.append(took_s)
    ratios = [p / s for p, s in zip(ours, theirs)]
    write_section(
        "benchmarks.md",
        [
            "## Kafka side by side",
            "",
            f"{measured_by('`bench/kafka_vs_ss.py`')}. {len(lines):,} click events (JSON) in one topic of "
            f"{PARTITIONS} partitions on a real Kafka 4.4.0 broker (KRaft, loopback; produced in {produce_s:.1f} s). "
            "Each run: one batch of every record, in a new process, from a fresh checkpoint; the two in turn, "
            f"{len(ours)} rounds after one warm-up round. Both counted every record.",
            "",
            "| one batch of all the records, new process | this project | Structured Streaming (Kafka source, AvailableNow, RocksDB, noop sink) | project / SS |",
            "|---|---|---|---|",
            f"| median wall | {statistics.median(ours):.2f} s | {statistics.median(theirs):.2f} s | "
            f"{statistics.median(ratios):.2f} (pairs {min(ratios):.2f} to {max(ratios):.2f}) |",
            "",
            "The project fetches with confluent-kafka consumers on the executors (one task per partition range) and "
            "commits a Delta state and its ledger; Spark's Kafka source fetches with the Java client and writes "
            "nothing. All figures: project "
            + ", ".join(f"{x:.2f}" for x in ours)
            + " s; Structured Streaming "
            + ", ".join(f"{x:.2f}" for x in theirs)
            + " s.",
            "",
        ],
    )


if __name__ == "__main__":
    main()
