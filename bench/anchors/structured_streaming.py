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

`--windowed SIZE [--delay D]` runs bench/windows_vs_ss.py's query instead:
`withWatermark("ts", D)`, per user and `window(ts, SIZE)` count and sum, in
append mode (each window's row once, when the watermark passes its end);
with `--dedup`, after `dropDuplicatesWithinWatermark(["event_id"])` (a
click's id is remembered until the watermark passes its time plus D).

`--landings DIR --stop-file F` is bench/fleet.py's anchor instead: each
subfolder of DIR a pipeline's landing folder, read by a query of its own,
all in one driver, as a team would run a fleet of streams in one long-lived
application: a `ProcessingTime` trigger of `--interval` seconds, and a
`foreachBatch` sink that only looks for the probe users in the batch's
updated rows (bench/fleet.py ends each landed file with a probe record,
`probe-<wave>`), writing nothing. Shuffle partitions are 2 (with one RocksDB
instance per partition and query, Spark's default of 200 would not fit a
fleet). It prints JSON lines: `{"ready": t}` once every query runs, then
one `{"query": name, "probe": "probe-00003", "at": t}` per probe seen, as
the batch that holds it ends; it stops when F exists.

    .venv/bin/python bench/anchors/structured_streaming.py --landing L --checkpoint C [--max-files 2]
    .venv/bin/python bench/anchors/structured_streaming.py --kafka HOST:PORT --topic T --checkpoint C
    .venv/bin/python bench/anchors/structured_streaming.py --landings L --checkpoint C --interval 10 --stop-file F
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

SCHEMA = "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"
SESSION_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.streaming.stateStore.providerClass": "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
}
LOCAL_CONF = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"}
_PRINT = threading.Lock()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--landing")
    parser.add_argument("--kafka", help="bootstrap servers: read --topic with Spark's Kafka source")
    parser.add_argument("--topic")
    parser.add_argument("--landings", help="a folder of landing folders: a query each, in one driver (bench/fleet.py)")
    parser.add_argument("--checkpoint", required=True, help="with --landings, a folder of checkpoints")
    parser.add_argument("--max-files", type=int, default=2)
    parser.add_argument("--seed", help="a folder of Parquet files unioned with --landing's (to seed the state)")
    parser.add_argument("--remote", help="a Spark Connect server (sc://host:port) to run the query on")
    parser.add_argument("--interval", type=float, default=10, help="--landings: the queries' trigger, seconds")
    parser.add_argument("--stop-file", help="--landings: stop once this file exists")
    parser.add_argument("--windowed", help="a window size (`1 hour`): bench/windows_vs_ss.py's query instead")
    parser.add_argument("--delay", default="10 minutes", help="--windowed: the watermark's delay")
    parser.add_argument("--dedup", action="store_true", help="--windowed: drop duplicate event ids within the watermark first")
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    conf = {**SESSION_CONF, "spark.sql.shuffle.partitions": "8"}
    if args.landings:  # many queries share the driver: FAIR keeps one's batch from waiting behind another's
        conf.update({"spark.sql.shuffle.partitions": "2", "spark.scheduler.mode": "FAIR"})
    if args.remote:
        spark = SparkSession.builder.remote(args.remote).getOrCreate()
        for key, value in conf.items():
            spark.conf.set(key, value)
    else:
        builder = SparkSession.builder.master("local[*]").appName("structured-streaming-anchor")
        memory = "4g" if args.landings else "2g"
        for key, value in {**conf, **LOCAL_CONF, "spark.driver.memory": memory}.items():
            builder = builder.config(key, value)
        if args.kafka:
            from spark_jobs.engine.session import extra_jars

            builder = builder.config("spark.jars", ",".join(extra_jars()))
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
    if args.landings:
        return fleet_queries(spark, args)
    session_ready = time.time()
    if args.kafka:
        from pyspark.sql import functions as F

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
    result, mode = (windowed(clicks, args.windowed, args.delay, args.dedup), "append") if args.windowed else (totals(clicks), "update")
    query = (
        result
        .writeStream.outputMode(mode)
        .format("noop")
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    done = time.time()
    batches = [
        {
            "batch_id": _field(p, "batchId"),
            "rows": _field(p, "numInputRows"),
            "duration_ms": _field(p, "durationMs"),
            "state_rows": [_field(o, "numRowsTotal") for o in _field(p, "stateOperators") or []],
        }
        for p in query.recentProgress
        if _field(p, "numInputRows") > 0
    ]
    if not args.remote:
        spark.stop()
    times = {
        "session_s": session_ready - PROCESS_START,
        "query_s": done - session_ready,
        "total_s": done - PROCESS_START,
    }
    print(json.dumps({**times, "batches": batches}))


def totals(clicks: Any) -> Any:
    """The benchmark's aggregation of a stream of clicks: per user count, sum and max."""
    from pyspark.sql import functions as F

    return clicks.groupBy("user_id").agg(
        F.count("*").alias("events"), F.sum("amount").alias("amount"), F.max("ts").alias("last_seen")
    )


def windowed(clicks: Any, size: str, delay: str, dedup: bool = False) -> Any:
    """bench/windows_vs_ss.py's aggregation: per user and event-time window,
    count and sum, behind a watermark (`withWatermark`): append mode emits a
    window's row once the watermark passes its end, and evicts its state.
    `dedup`: duplicate event ids dropped first, within the watermark."""
    from pyspark.sql import functions as F

    timed = clicks.withWatermark("ts", delay)
    if dedup:
        timed = timed.dropDuplicatesWithinWatermark(["event_id"])
    return (
        timed
        .groupBy("user_id", F.window("ts", size))
        .agg(F.count("*").alias("clicks"), F.sum("amount").alias("amount"))
    )


def fleet_queries(spark: Any, args: argparse.Namespace) -> None:
    """`--landings`: a query per landing folder, until the stop file exists."""
    from pyspark.sql import functions as F

    def say(record: dict) -> None:
        with _PRINT:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    def sink(name: str) -> Any:
        def found(batch: Any, batch_id: int) -> None:
            probes = batch.filter(F.col("user_id").startswith("probe-")).select("user_id").collect()
            at = time.time()
            for row in probes:
                say({"query": name, "probe": row.user_id, "at": at})

        return found

    queries = []
    for name in sorted(os.listdir(args.landings)):
        clicks = spark.readStream.schema(SCHEMA).json(os.path.join(args.landings, name))
        stream = totals(clicks).writeStream.outputMode("update").foreachBatch(sink(name)).queryName(name)
        stream = stream.option("checkpointLocation", os.path.join(args.checkpoint, name))
        queries.append(stream.trigger(processingTime=f"{args.interval} seconds").start())
    say({"ready": time.time(), "queries": len(queries)})
    while not os.path.exists(args.stop_file):
        time.sleep(2)
        failed = [q for q in queries if not q.isActive]
        if failed:
            say({"failed": [q.name for q in failed], "error": str(failed[0].exception())})
            break
    for query in queries:
        query.stop()
    spark.stop()


def _field(progress: Any, name: str) -> Any:
    """A progress field: classic PySpark's progress reads as a dict, Spark
    Connect's `StreamingQueryProgress` as attributes (its `[name]` is None)."""
    value = getattr(progress, name, None)
    return progress[name] if value is None else value


if __name__ == "__main__":
    main()
