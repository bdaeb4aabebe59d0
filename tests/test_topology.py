"""The docker stack, run natively on loopback (tests/topology.py), end to end.

Its example pipelines run through Airflow as a user of the stack would run
them: clicks landed on S3 into a state on S3 on the Spark Connect server,
the chained pipeline on its state's changes, and clicks from the Kafka topic
on the standalone cluster. delta-spark, on the Connect server, then reads
every state from `s3://`, and each equals what the input says it must.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from spark_jobs.demo.clickstream import write_wave
from tests.topology import BUCKET, Topology

# In `make soak`: a cluster, a Connect server, a Kafka broker and an
# Airflow stack at once (4 CPU-minutes), each of which `make test` runs on
# its own (engine/test_engines.py, sources/test_kafka_broker.py,
# plugins/test_airflow_live.py); docker/ itself is checked statically there
# (tests/docker/test_docker.py).
pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]

TOPIC = "clicks"
DAGS = ("clicks_per_user_s3", "clicks_per_domain", "kafka_clicks_s3")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    topology = Topology(tmp_path_factory.mktemp("topology"))
    topology.start()
    try:
        yield topology
    finally:
        topology.stop()


def _land_clicks(stack: Topology, folder: Path) -> list[dict]:
    """Clicks as the docker README lands them: JSON-lines files under s3://microbatch/landing/clicks/."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint)
    records = []
    for path in write_wave(folder, 0, files=3, records_per_file=400, users=60):
        s3.upload_file(str(path), BUCKET, f"landing/clicks/{path.name}")
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def _produce_clicks(stack: Topology, count: int) -> list[dict]:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": stack.broker.bootstrap})
    admin.create_topics([NewTopic(TOPIC, num_partitions=2, replication_factor=1)])[TOPIC].result(60)
    producer = Producer({"bootstrap.servers": stack.broker.bootstrap, "log_level": 2})
    records = [
        {"event_id": f"k{i}", "user_id": f"u{i % 23}", "amount_cents": 100 + i % 7, "ts": f"2026-01-01T00:{i % 60:02d}:00Z"}
        for i in range(count)
    ]
    for i, record in enumerate(records):
        producer.produce(TOPIC, value=json.dumps(record).encode(), partition=i % 2)
    assert producer.flush(60) == 0, "records left unsent"
    return records


def _totals(records: list[dict], key, fields: dict[str, str]) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"events": 0, **{f: 0 for f in fields}})
    for record in records:
        row = totals[key(record)]
        row["events"] += record.get("events", 1)
        for name, source in fields.items():
            row[name] += record[source]
    return {k: {f: round(v, 6) for f, v in row.items()} for k, row in totals.items()}


def _read(spark, path: str, key: str, fields: list[str]) -> dict[str, dict[str, float]]:
    rows = spark.read.format("delta").load(path).collect()
    return {row[key]: {f: round(float(row[f]), 6) for f in ["events", *fields]} for row in rows}


def test_the_docker_pipelines_run_through_airflow_on_the_native_stack(stack, tmp_path):
    # The Connect client's own class: pyspark's common builder refuses a
    # remote session in a process that has a local one (the suite's `spark`).
    from pyspark.sql.connect.session import SparkSession

    airflow = stack.airflow
    clicks = _land_clicks(stack, tmp_path / "landing")
    kafka_records = _produce_clicks(stack, 900)
    for dag_id in DAGS:
        airflow.wait_for_dag(dag_id)
        airflow.unpause(dag_id)  # paused at creation, as the compose file sets it
    airflow.trigger("clicks_per_user_s3", {})
    airflow.trigger("kafka_clicks_s3", {})
    failures = []
    for dag_id in ("clicks_per_user_s3", "kafka_clicks_s3"):
        runs = airflow.wait_for_runs(dag_id, 1, timeout=600)
        failures += [f"{dag_id}: {r['dag_run_id']} {r['state']}" for r in runs if r["state"] != "success"]
    assert not failures, f"{failures}\n{airflow.logs()}\n{stack.tail()}"
    # The chained pipeline runs when its upstream commits (an asset event).
    downstream = airflow.wait_for_runs("clicks_per_domain", 1, timeout=600)
    assert all(r["state"] == "success" for r in downstream), airflow.logs("clicks_per_domain")

    spark = SparkSession.builder.remote(stack.connect_url).getOrCreate()
    # Tables of a few commits: Delta's log replay in 50 tasks (its default)
    # and 200 shuffle partitions would be most of this test's reading time.
    spark.conf.set("spark.databricks.delta.snapshotPartitions", "2")
    spark.conf.set("spark.sql.shuffle.partitions", "2")
    try:
        per_user = _totals(clicks, lambda r: r["user_id"], {"amount": "amount"})
        assert _read(spark, f"s3://{BUCKET}/lake/clicks_per_user", "user_id", ["amount"]) == per_user
        kafka_users = _totals(kafka_records, lambda r: r["user_id"], {"cents": "amount_cents"})
        assert _read(spark, f"s3://{BUCKET}/lake/kafka_clicks", "user_id", ["cents"]) == kafka_users
        # The chain: every change of the upstream's state read once, however
        # many runs the upstream's commits (asset events) triggered.
        per_domain = _totals(
            [{"user_id": u, **t} for u, t in per_user.items()], lambda r: r["user_id"][-1], {"amount": "amount"}
        )
        domain_path = f"s3://{BUCKET}/lake/clicks_per_domain"
        airflow.wait(
            lambda: _settled(airflow, "clicks_per_domain") and _read(spark, domain_path, "domain", ["amount"]) == per_domain,
            300,
            "the chained pipeline to reach its upstream's totals",
        )
        assert all(r["state"] == "success" for r in airflow.runs("clicks_per_domain")), airflow.logs("clicks_per_domain")
        ledger = spark.read.format("delta").load(f"s3://{BUCKET}/lake/_checkpoints/kafka_clicks/offsets")
        assert ledger.filter("status = 'committed'").count() >= 1, "the Kafka pipeline's ledger, read by delta-spark"
    finally:
        spark.stop()


def _settled(airflow, dag_id: str) -> bool:
    return all(r["state"] in ("success", "failed") for r in airflow.runs(dag_id))
