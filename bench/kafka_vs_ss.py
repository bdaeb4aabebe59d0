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
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from doc_sections import replace_section  # noqa: E402
from spark_jobs.demo.clickstream import write_wave  # noqa: E402
from run import timed  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Kafka side by side"
TOPIC = "bench_clicks"
PARTITIONS = 4
SCHEMA = "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"
TRANSFORM = "SELECT user_id, count(*) AS events, sum(amount) AS amount, max(ts) AS last_seen FROM batch GROUP BY user_id"
STATE = {"keys": ["user_id"], "merge": {"events": "sum", "amount": "sum", "last_seen": "max"}}


def spec(folder: Path, name: str, source: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    body = {
        "name": name,
        "source": source,
        "transform": TRANSFORM,
        "state": {"path": f"{name}_state", **STATE},
        "checkpoint": f"{name}_checkpoint",
        "batch": {"max_files": 1000} if source["type"] == "files" else {"max_records": 1_000_000},
    }
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def fresh(path: Path) -> None:
    """Forget everything the pipeline committed (its state and checkpoint)."""
    body = yaml.safe_load(path.read_text())
    for location in (body["state"]["path"], body["checkpoint"]):
        shutil.rmtree(path.parent / location, ignore_errors=True)


def click_lines(landing: Path, records: int) -> list[str]:
    """`records` click events as 4 JSON-lines files in `landing`, and their lines."""
    write_wave(landing, 0, files=4, records_per_file=records // 4, users=100_000, seed=11)
    return [line for f in sorted(landing.rglob("*.json")) for line in f.read_text().splitlines() if line.strip()]


def produce_lines(servers: str, topic: str, lines: list[str], *, partitions: int) -> float:
    """Each line as one record, round-robin over the partitions; seconds taken."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": servers, "linger.ms": 20, "batch.num.messages": 10_000, "log_level": 2})
    started = time.perf_counter()
    for i, line in enumerate(lines):
        while True:
            try:
                producer.produce(topic, value=line.encode(), partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0, "records left unsent"
    return time.perf_counter() - started


def create_topic(servers: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": servers})  # held: a collected client cancels its requests
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result(30)
    deadline = time.monotonic() + 30  # the broker's metadata follows the controller's answer
    while len(getattr(admin.list_topics(TOPIC, timeout=10).topics.get(TOPIC), "partitions", {})) < PARTITIONS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {TOPIC} did not appear")
        time.sleep(0.2)


def project(path: Path) -> tuple[float, int]:
    fresh(path)
    took, stdout = timed([sys.executable, "-m", "spark_jobs", "-q", "run", str(path), "--json"])
    return took, json.loads(stdout)["records_in"]


def anchor(servers: str, checkpoint: Path) -> tuple[float, int]:
    shutil.rmtree(checkpoint, ignore_errors=True)
    took, stdout = timed([sys.executable, str(ROOT / "bench/anchors/structured_streaming.py"), "--kafka", servers,
                          "--topic", TOPIC, "--checkpoint", str(checkpoint)])
    report = json.loads(stdout.strip().splitlines()[-1])
    return took, sum(b["rows"] for b in report["batches"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()

    from tests.kafka_broker import KafkaBroker

    work = Path(tempfile.mkdtemp(prefix="microbatch-kafka-ss-"))
    try:
        with KafkaBroker.start(work / "kafka") as broker:
            lines = click_lines(work / "landing", args.records)
            create_topic(broker.bootstrap)
            produce_s = produce_lines(broker.bootstrap, TOPIC, lines, partitions=PARTITIONS)
            print(f"{len(lines):,} records produced to {PARTITIONS} partitions in {produce_s:.1f} s", flush=True)
            path = spec(work, "from_kafka", {"type": "kafka", "bootstrap_servers": broker.bootstrap, "topic": TOPIC,
                                             "format": "json", "schema": SCHEMA})
            ours: list[float] = []
            theirs: list[float] = []
            for round_ in range(args.rounds + 1):  # round 0 warms both (file caches, class archives)
                took_p, read_p = project(path)
                took_s, read_s = anchor(broker.bootstrap, work / "ss_checkpoint")
                assert read_p == read_s == len(lines), (read_p, read_s, len(lines))
                print(f"round {round_}: project {took_p:.2f} s, Structured Streaming {took_s:.2f} s", flush=True)
                if round_:
                    ours.append(took_p)
                    theirs.append(took_s)
            write_doc(len(lines), produce_s, ours, theirs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_doc(records: int, produce_s: float, ours: list[float], theirs: list[float]) -> None:
    ratios = [p / s for p, s in zip(ours, theirs)]
    lines = [
        SECTION,
        "",
        f"Measured by `bench/kafka_vs_ss.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}. {records:,} click events (JSON) in one topic of "
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
        "nothing. All figures: project " + ", ".join(f"{x:.2f}" for x in ours) + " s; Structured Streaming "
        + ", ".join(f"{x:.2f}" for x in theirs) + " s.",
        "",
    ]
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
