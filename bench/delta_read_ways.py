"""Two ways to read a Delta source's batch, on the same upstream, in one run.

A chained pipeline reads a range of its upstream's versions as the change
feed. Today the driver reads it with delta-rs (`engine/delta_read.py`:
`load_cdf`, the net-change filter, Arrow handed to Spark). delta-spark can
read the same range on the executors (`readChangeFeed` with
`startingVersion`/`endingVersion`). This measures both on one upstream, in
one session with delta-spark loaded (`default_session(delta=True)`), alternately, and checks that they give the same
transform result:

* driver: `read_versions(manifest)` -> `createDataFrame` -> transform -> Arrow;
* Spark: `readChangeFeed` -> the same net-change filter as a window in
  Spark -> transform -> Arrow;

for ranges of growing size, and once, the first Delta read of a fresh JVM
(Delta builds its snapshot with a Spark job of generated code).

Both in local mode and on a standalone cluster on loopback (a master and a
worker running two one-core executors, `tests/spark_servers.py`): there the
driver's read ships its Arrow rows to the executors over the network, and
Spark's read spreads the files over two executor processes, as on a real
cluster, though on the same two cores.

The upstream (delta-rs, change feed on): `--versions` appends of
`--rows` rows each over 200,000 users, then updates of a tenth of the users
by MERGE (which writes change data files). Results go to docs/benchmarks.md,
section "Reading a Delta source".

    .venv/bin/python bench/delta_read_ways.py [--versions 20] [--rows 100000] [--repeat 3] [--no-cluster] [--master URL]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Reading a Delta source"
USERS = 200_000
TRANSFORM = """
SELECT user_id,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN events ELSE -events END) AS events,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN amount ELSE -amount END) AS amount
FROM batch GROUP BY user_id
"""


def build_upstream(uri: str, versions: int, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    schema = pa.schema([("user_id", pa.string()), ("events", pa.int64()), ("amount", pa.float64())])
    DeltaTable.create(uri, schema, configuration={"delta.enableChangeDataFeed": "true"})
    rng = np.random.default_rng(7)
    for v in range(versions):
        users = rng.integers(0, USERS, rows)
        data = pa.table({"user_id": [f"u{u}" for u in users], "events": rng.integers(1, 5, rows), "amount": rng.random(rows)}, schema=schema)
        write_deltalake(uri, data, mode="append")
        if v % 5 == 4:  # an update of a tenth of the users: change data files with pre and post images
            table = DeltaTable(uri)
            picked = pa.table({"user_id": [f"u{u}" for u in range(v, USERS, 10)]})
            table.merge(picked, "t.user_id = s.user_id", source_alias="s", target_alias="t").when_matched_update(
                {"events": "t.events + 1"}
            ).execute()


def spark_net_changes(df):
    """`delta_read.net_changes` in Spark: within a version, a removal and an
    addition of an identical row cancel, pair by pair."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    values = [c for c in df.columns if c not in ("_change_type", "_commit_timestamp")]
    added = F.col("_change_type").isin("insert", "update_postimage")
    marked = df.withColumn("_added", added)
    per_value = Window.partitionBy(*values)
    paired = F.least(
        F.sum(F.col("_added").cast("int")).over(per_value), F.sum((~F.col("_added")).cast("int")).over(per_value)
    )
    rank = F.row_number().over(Window.partitionBy(*values, "_added").orderBy(F.lit(1)))
    return marked.withColumn("_rank", rank).withColumn("_paired", paired).where(F.col("_rank") > F.col("_paired")).drop(
        "_added", "_rank", "_paired"
    )


def by_driver(spark, uri: str, first: int, last: int):
    from spark_jobs.engine.delta_read import read_versions
    from spark_jobs.sources.delta import DeltaManifest

    rows = read_versions(DeltaManifest(uri, "changes", first, last, ()))
    spark.createDataFrame(rows).createOrReplaceTempView("batch")
    return spark.sql(TRANSFORM).toArrow(), rows.num_rows


def by_spark(spark, uri: str, first: int, last: int):
    feed = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", first)
        .option("endingVersion", last)
        .load(uri)
    )
    spark_net_changes(feed).createOrReplaceTempView("batch")
    return spark.sql(TRANSFORM).toArrow(), None


def canonical(table) -> list[tuple]:
    return sorted((r["user_id"], r["events"], round(r["amount"], 6)) for r in table.to_pylist())


def first_read_s(uri: str) -> float:
    """The first Delta read of a fresh long-lived session, in its own process."""
    import subprocess

    code = (
        "import time, sys; from spark_jobs.engine.session import default_session; "
        "s = default_session('local[*]', short_lived=False, delta=True); t = time.perf_counter(); "
        f"s.read.format('delta').option('readChangeFeed', 'true').option('startingVersion', 1).option('endingVersion', 1).load({uri!r}).count(); "
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-cluster", action="store_true", help="no loopback cluster")
    parser.add_argument("--master", help="also measure on this cluster (spark://host:port)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="microbatch-delta-read-"))
    cluster = None
    try:
        uri = str(work / "upstream")
        started = time.perf_counter()
        build_upstream(uri, args.versions, args.rows)
        print(f"upstream: {args.versions} appends of {args.rows:,} rows and their updates in {time.perf_counter() - started:.0f} s", flush=True)
        cold = first_read_s(uri)
        print(f"first Delta read of a fresh session: {cold:.1f} s", flush=True)
        spans = sorted({1, max(1, args.versions // 4), args.versions})
        engines = {}
        if not args.no_cluster:
            from tests.spark_servers import start_cluster

            cluster, engines["cluster"] = start_cluster(work / "cluster", cores=2)
            # Two one-core executors on the worker. Given at the driver JVM's
            # launch, which the local session after it reuses (it ignores the setting).
            os.environ["PYSPARK_SUBMIT_ARGS"] = "--conf spark.executor.cores=1 pyspark-shell"
        engines["local"] = "local[*]"
        if args.master:
            engines["given"] = args.master
        figures: dict[tuple[str, int], dict[str, list[float]]] = {}
        rows_in: dict[int, int] = {}
        for engine, master in engines.items():
            measure(engine, master, uri, spans, args.repeat, figures, rows_in)
        write_doc(args, engines, spans, figures, rows_in, cold)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def measure(engine: str, master: str, uri: str, spans: list[int], repeat: int, figures: dict, rows_in: dict) -> None:
    """Both reads over each span, alternately, in one session on `master`."""
    from spark_jobs.engine.session import default_session

    spark = default_session(master, app_name="delta-read-ways", short_lived=False, delta=True)
    try:
        by_spark(spark, uri, 1, 1)  # warm both paths once
        by_driver(spark, uri, 1, 1)
        for span in spans:
            last = 1 + span - 1 + (span // 5)  # the updates' versions come in between
            times = figures[engine, span] = {"driver": [], "spark": []}
            for _ in range(repeat):
                for way, read in (("driver", by_driver), ("spark", by_spark)):
                    t = time.perf_counter()
                    result, n = read(spark, uri, 1, last)
                    times[way].append(time.perf_counter() - t)
                    if n is not None:
                        rows_in[span] = n
                        expected = canonical(result)
                    else:
                        assert canonical(result) == expected, f"the two reads differ over versions 1..{last} ({engine})"
            print(engine, span, {k: [f"{x:.2f}" for x in v] for k, v in times.items()}, flush=True)
    finally:
        spark.stop()


def write_doc(args, engines: dict[str, str], spans, figures, rows_in, cold: float) -> None:
    where = {"local": "local mode", "cluster": "standalone cluster, 2 executors of 1 core", "given": args.master}
    lines = [
        SECTION,
        "",
        f"Measured by `bench/delta_read_ways.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}. An upstream written by delta-rs with its change "
        f"feed on: {args.versions} appends of {args.rows:,} rows over {USERS:,} users, and after every fifth a MERGE "
        "updating a tenth of the users. Per engine, one long-lived session that loads delta-spark "
        f"(`default_session(delta=True)`), the two reads in turn, medians of {args.repeat}; both gave the same "
        "transform result (checked). The cluster runs on loopback on the same two cores (`tests/spark_servers.py`).",
        "",
        "| engine | appends in the range | change-feed rows | driver (delta-rs, Arrow to Spark) | Spark (`readChangeFeed` on the executors) | Spark / driver |",
        "|---|---|---|---|---|---|",
    ]
    ratio: dict[tuple[str, int], float] = {}
    for engine in sorted(engines, key=list(where).index):
        for span in spans:
            d, s = statistics.median(figures[engine, span]["driver"]), statistics.median(figures[engine, span]["spark"])
            ratio[engine, span] = s / d
            lines.append(f"| {where[engine]} | {span} | {rows_in.get(span, 0):,} | {d:.2f} s | {s:.2f} s | {s / d:.2f} |")
    small, large = spans[0], spans[-1]
    at_small = [ratio[e, small] for e in engines]
    at_large = [ratio[e, large] for e in engines]
    lines += [
        "",
        f"The first Delta read of a fresh JVM took {cold:.1f} s (Delta reconstructs the table's snapshot with a Spark "
        "job of generated code); the driver's read needs no JVM warm-up of its own.",
        "",
        f"Which is used when: the driver's read (delta-rs), for every batch. At {rows_in.get(small, 0):,} change rows "
        f"Spark's read took {min(at_small):.2f} to {max(at_small):.2f} times as long; at {rows_in.get(large, 0):,} it "
        f"took {min(at_large):.2f} to {max(at_large):.2f} times as long, its best on the cluster, where it spreads "
        "the files over the executors. It also needs delta-spark in the job's own sessions, which made every "
        "one-batch start and catch-up batch slower (\"Figures behind the code's choices\"), and the first read's "
        "snapshot job above. So the driver's read serves the batches chained pipelines make (an upstream's few "
        "commits; `batch.max_versions` bounds them, and the driver's memory with them). Batches of millions of "
        "change rows on a cluster are where a Spark read would pay; the job has no such read yet (the script's "
        "`by_spark` is the measured prototype). `--master spark://...` adds a real cluster to this comparison.",
        "",
    ]
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
