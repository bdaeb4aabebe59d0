"""Structured Streaming anchor: the benchmark's aggregation as Spark's own streaming job.

Run with the project's env (`.venv/bin/python`), in a new process per run,
as a scheduler would run it: `Trigger.AvailableNow` over the landing folder's
JSON files (`maxFilesPerTrigger`), `groupBy(user_id).agg(count, sum, max)`
with RocksDB state, update mode. The sink is `noop`: the state lives in the
state store (Spark 4 reads it with the `statestore` source), and writing
nothing favours the anchor, since the project writes a queryable Delta
table every batch. Shuffle partitions (the state's partitions) are 8, as in
the project's sessions; a new checkpoint's setting sticks for its life.

`--seed DIR` adds a second stream, the Parquet files in DIR (same columns),
unioned with the landing folder's: a first run over it puts N users into
the state store, and later runs' batches over the landing folder meet them
(bench/state_vs_ss.py, users coming back to a large state).

`--kafka SERVERS --topic T` reads a Kafka topic instead of the folder:
Spark's own Kafka source (spark-sql-kafka, from the JARs set-up fetched,
`jars/spark/pom.xml`), from the earliest offsets, `read_committed`, the
values parsed with `from_json` under the same schema, in one AvailableNow
batch.

Prints one JSON object: seconds from process start to the session, to the
query's end, and each batch's progress (`durationMs`, rows). `--remote`
runs the query on a Spark Connect server instead (a warm JVM shared by the
runs, as the project can use one).

    .venv/bin/python bench/anchors/structured_streaming.py --landing L --checkpoint C [--max-files 2]
    .venv/bin/python bench/anchors/structured_streaming.py --kafka HOST:PORT --topic T --checkpoint C
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

SCHEMA = "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SESSION_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--landing")
    parser.add_argument("--kafka", help="bootstrap servers: read --topic with Spark's Kafka source instead of --landing")
    parser.add_argument("--topic")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--max-files", type=int, default=2)
    parser.add_argument("--seed", help="a folder of Parquet files unioned with --landing's (to seed the state)")
    parser.add_argument("--driver-java-options", default="", help="extra JVM flags for the driver (default: none)")
    parser.add_argument("--remote", help="a Spark Connect server (sc://host:port) to run the query on, instead of a JVM of its own")
    parser.add_argument("--master", default="local[*]", help="the driver's master: local[*] or a standalone cluster's spark://host:port")
    args = parser.parse_args()

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if args.remote:
        spark = SparkSession.builder.remote(args.remote).getOrCreate()
        for key, value in SESSION_CONF.items():
            spark.conf.set(key, value)
    else:
        builder = SparkSession.builder.master(args.master).appName("structured-streaming-anchor")
        for key, value in {**SESSION_CONF, "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                           "spark.driver.memory": "2g"}.items():
            builder = builder.config(key, value)
        if args.driver_java_options:
            builder = builder.config("spark.driver.extraJavaOptions", args.driver_java_options)
        if args.kafka:
            from spark_jobs.engine.session import extra_jars

            builder = builder.config("spark.jars", ",".join(extra_jars()))
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
    session_ready = time.time()
    if args.kafka:
        raw = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", args.kafka)
            .option("subscribe", args.topic)
            .option("startingOffsets", "earliest")
            .option("kafka.isolation.level", "read_committed")
            .load()
        )
        clicks = raw.select(F.from_json(F.col("value").cast("string"), SCHEMA).alias("r")).select("r.*")
    else:
        clicks = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", args.max_files).json(args.landing)
        if args.seed:
            clicks = clicks.unionByName(spark.readStream.schema(SCHEMA).parquet(args.seed))
    totals = clicks.groupBy("user_id").agg(
        F.count("*").alias("events"), F.sum("amount").alias("amount"), F.max("ts").alias("last_seen")
    )
    query = (
        totals.writeStream.outputMode("update")
        .format("noop")
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    done = time.time()
    batches = [
        {"batch_id": _field(p, "batchId"), "rows": _field(p, "numInputRows"), "duration_ms": _field(p, "durationMs")}
        for p in query.recentProgress
        if _field(p, "numInputRows") > 0
    ]
    if not args.remote:
        spark.stop()
    print(
        json.dumps(
            {
                "session_s": session_ready - PROCESS_START,
                "query_s": done - session_ready,
                "total_s": done - PROCESS_START,
                "batches": batches,
            }
        )
    )


def _field(progress, name: str):
    """A progress field: classic PySpark's progress reads as a dict, Spark
    Connect's `StreamingQueryProgress` as attributes (its `[name]` is None)."""
    value = getattr(progress, name, None)
    return progress[name] if value is None else value


if __name__ == "__main__":
    main()
