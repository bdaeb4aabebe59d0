"""A 100k-record batch from a Kafka topic against the same records from files.

One run, one machine, the same records: click events are written as JSON
files (4 files of 25k lines), and each line is produced as one Kafka record
(4 partitions) to librdkafka's mock cluster on loopback. Two pipelines with
the same transform and state then read them, alternately, each from a fresh
checkpoint and state:

* one batch in a new process (the `microbatch run` CLI: Python, Spark's
  start, planning, reading, parsing, merging, committing);
* one batch in a warm process (one Spark session shared by the runs: what
  the source's read costs once Spark runs);
* a run with nothing new (planning only, no Spark session).

The two states must come out equal (checked), so both read the same
records. Results go to docs/benchmarks.md, section "Kafka against files".

    .venv/bin/python bench/kafka_vs_files.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
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

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Kafka against files"
SCHEMA = "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"
TRANSFORM = "SELECT user_id, count(*) AS events, sum(amount) AS amount, max(ts) AS last_seen FROM batch GROUP BY user_id"
STATE = {"keys": ["user_id"], "merge": {"events": "sum", "amount": "sum", "last_seen": "max"}}
TOPIC = "bench_clicks"


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


def cli(path: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "spark_jobs", "-q", "run", str(path), "--json"], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"run of {path.name} failed:\n{result.stderr[-3000:]}")
    return elapsed


def state(path: Path) -> dict:
    from deltalake import DeltaTable

    from spark_jobs.core.delta_io import read_all

    body = yaml.safe_load(path.read_text())
    rows = read_all(DeltaTable(str(path.parent / body["state"]["path"]))).to_pylist()
    return {r["user_id"]: (r["events"], round(r["amount"], 6), r["last_seen"]) for r in rows}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()

    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.session import default_session
    from spark_jobs.engine.spark_compute import SparkCompute
    from tests.spark_jobs.sources.test_kafka import start_cluster, stop_cluster

    work = Path(tempfile.mkdtemp(prefix="microbatch-kafka-bench-"))
    server, servers = start_cluster()
    try:
        lines = click_lines(work / "landing", args.records)
        produce_s = produce_lines(servers, TOPIC, lines, partitions=4)
        print(f"{len(lines):,} records: 4 files; produced to 4 partitions in {produce_s:.1f} s")

        files = spec(work, "from_files", {"type": "files", "path": "landing", "format": "json", "schema": SCHEMA})
        kafka = spec(work, "from_kafka", {"type": "kafka", "bootstrap_servers": servers, "topic": TOPIC, "format": "json", "schema": SCHEMA})
        env = {**os.environ}
        cold: dict[str, list[float]] = {"files": [], "kafka": []}
        noop: dict[str, list[float]] = {"files": [], "kafka": []}
        warm: dict[str, list[float]] = {"files": [], "kafka": []}
        for round_ in range(args.repeat):
            for name, path in (("files", files), ("kafka", kafka)):
                fresh(path)
                cold[name].append(cli(path, env))
                noop[name].append(cli(path, env))
                print(f"round {round_ + 1}: {name}: new process {cold[name][-1]:.2f} s, nothing new {noop[name][-1]:.2f} s", flush=True)
        assert state(files) == state(kafka), "the two pipelines read different records"
        session = default_session("local[*]", app_name="kafka-vs-files", short_lived=False)
        try:
            for round_ in range(args.repeat + 1):
                for name, path in (("files", files), ("kafka", kafka)):
                    fresh(path)
                    started = time.perf_counter()
                    outcome = run_batch(load_spec(path), RunOptions(run_id="bench"), compute_factory=lambda: SparkCompute(session=session))
                    elapsed = time.perf_counter() - started
                    assert outcome.records_in == len(lines), outcome
                    if round_:  # the first round warms the session's code paths for both
                        warm[name].append(elapsed)
                    print(f"warm round {round_}: {name}: {elapsed:.2f} s", flush=True)
        finally:
            session.stop()
        write_doc(len(lines), produce_s, cold, noop, warm, args)
    finally:
        stop_cluster(server)
        shutil.rmtree(work, ignore_errors=True)


def write_doc(records: int, produce_s: float, cold: dict, noop: dict, warm: dict, args: argparse.Namespace) -> None:
    def row(label: str, figures: dict) -> str:
        f, k = statistics.median(figures["files"]), statistics.median(figures["kafka"])
        return f"| {label} | {f:.2f} s | {k:.2f} s | {k / f:.2f}x |"

    lines = [
        SECTION,
        "",
        f"Measured by `bench/kafka_vs_files.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}. The same {records:,} click events (JSON), as 4 "
        "files and as 4 Kafka partitions on librdkafka's mock cluster (loopback; produced in "
        f"{produce_s:.1f} s), read by two pipelines with the same transform and state, alternately, each batch "
        f"from a fresh checkpoint and state; medians of {args.repeat}. Both states came out equal.",
        "",
        "| one batch of all the records | files | Kafka | Kafka / files |",
        "|---|---|---|---|",
        row("new process (`microbatch run`)", cold),
        row("warm process (Spark session running)", warm),
        row("run with nothing new (no Spark session)", noop),
        "",
        "Kafka records are fetched by Python consumers on the executors (one task per partition range; "
        "confluent-kafka) and reach Spark as Arrow batches; files are read by Spark's own text reader. All "
        "figures: " + "; ".join(f"{k} {n}: " + ", ".join(f"{x:.2f}" for x in v[n]) for k, v in (("new process", cold), ("warm", warm), ("nothing new", noop)) for n in ("files", "kafka")) + " s.",
        "",
    ]
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
