"""Structured Streaming anchor of bench/fleet.py: one query per pipeline, all in one driver.

Each subfolder of `--landings` is a pipeline's landing folder, read by a
query of its own: the benchmark's aggregation (`groupBy(user_id)` with
count, sum and max, RocksDB state, update mode) on a `ProcessingTime`
trigger of `--interval` seconds, as a team would run a fleet of streams in
one long-lived application. The sink is `foreachBatch`, which only looks
for the probe users in the batch's updated rows (bench/fleet.py ends each
landed file with a probe record, `probe-<wave>`): it writes nothing, which
favours the anchor, since the project writes a queryable Delta table every
batch. Shuffle partitions are `--partitions` (2: with one RocksDB instance
per partition and query, Spark's default of 200 would not fit a fleet).

Prints JSON lines: `{"ready": t}` once every query runs, then one
`{"query": name, "probe": "probe-00003", "at": t}` per probe seen, as the
batch that holds it ends. Stops when `--stop-file` exists.

    .venv/bin/python bench/anchors/structured_streaming_fleet.py --landings L --checkpoints C --interval 10 --stop-file F
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from structured_streaming import ROCKSDB, SCHEMA

_PRINT = threading.Lock()


def say(record: dict) -> None:
    with _PRINT:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landings", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--interval", type=float, default=10)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--stop-file", required=True)
    args = parser.parse_args()

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.master("local[*]").appName("structured-streaming-fleet")
    conf = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": str(args.partitions),
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": "4g",
        # Many queries share the driver's scheduler: FAIR keeps one query's
        # batch from waiting behind another's.
        "spark.scheduler.mode": "FAIR",
    }
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")

    def sink(name: str):
        def found(batch, batch_id: int) -> None:
            probes = [r.user_id for r in batch.filter(F.col("user_id").startswith("probe-")).select("user_id").collect()]
            at = time.time()
            for probe in probes:
                say({"query": name, "probe": probe, "at": at})

        return found

    queries = []
    for name in sorted(os.listdir(args.landings)):
        clicks = spark.readStream.schema(SCHEMA).json(os.path.join(args.landings, name))
        totals = clicks.groupBy("user_id").agg(F.count("*").alias("events"), F.sum("amount").alias("amount"), F.max("ts").alias("last_seen"))
        queries.append(
            totals.writeStream.outputMode("update")
            .foreachBatch(sink(name))
            .option("checkpointLocation", os.path.join(args.checkpoints, name))
            .trigger(processingTime=f"{args.interval} seconds")
            .queryName(name)
            .start()
        )
    say({"ready": time.time(), "queries": len(queries)})
    while not os.path.exists(args.stop_file):
        time.sleep(2)
        failed = [q.name for q in queries if not q.isActive]
        if failed:
            say({"failed": failed, "error": str(next(q for q in queries if not q.isActive).exception())})
            break
    for query in queries:
        query.stop()
    spark.stop()


if __name__ == "__main__":
    main()
