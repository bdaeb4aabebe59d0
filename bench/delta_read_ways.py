"""The two readers of a Delta source's batch, on the same upstream, in one run.

A pipeline reading a Delta source (a chained pipeline's upstream state, or
any table) reads a planned range of its versions with one of two readers
(`engine/delta_read.py`, `source.reader`):

* driver (the default): `read_versions` (delta-rs: `load_cdf` and the
  net-change filter, or the files the versions added) -> `createDataFrame`
  -> transform -> Arrow;
* spark: `spark_versions` (delta-spark on the executors: `readChangeFeed`
  and the same filter as window functions, or the table as of the versions
  kept to the files they added) -> transform -> Arrow;

alternately, in one session with delta-spark loaded
(`default_session(delta=True)`), for ranges of growing size, checking that
both give the same transform result; and once, the first Delta read of a
fresh JVM (Delta builds its snapshot with a Spark job of generated code).

Both in local mode and on a standalone cluster on loopback (a master and a
worker running two one-core executors, `tests/spark_servers.py`): there the
driver's read ships its Arrow rows to the executors over the network, and
Spark's read spreads the files over two executor processes, as on a real
cluster, though on the same two cores.

Two upstreams (delta-rs): for `read: changes`, `--versions` appends of
`--rows` rows each over 200,000 users with the change feed on, and after
every fifth a MERGE updating a tenth of the users (change data files); for
`read: appends`, the same appends alone. Results go to docs/benchmarks.md,
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
TRANSFORMS = {
    "changes": """
SELECT user_id,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN events ELSE -events END) AS events,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN amount ELSE -amount END) AS amount
FROM batch GROUP BY user_id
""",
    "appends": "SELECT user_id, sum(events) AS events, sum(amount) AS amount FROM batch GROUP BY user_id",
}


def build_upstream(uri: str, versions: int, rows: int, *, updates: bool) -> None:
    import numpy as np
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    schema = pa.schema([("user_id", pa.string()), ("events", pa.int64()), ("amount", pa.float64())])
    DeltaTable.create(uri, schema, configuration={"delta.enableChangeDataFeed": "true"} if updates else None)
    rng = np.random.default_rng(7)
    for v in range(versions):
        users = rng.integers(0, USERS, rows)
        data = pa.table({"user_id": [f"u{u}" for u in users], "events": rng.integers(1, 5, rows), "amount": rng.random(rows)}, schema=schema)
        write_deltalake(uri, data, mode="append")
        if updates and v % 5 == 4:  # an update of a tenth of the users: change data files with pre and post images
            table = DeltaTable(uri)
            picked = pa.table({"user_id": [f"u{u}" for u in range(v, USERS, 10)]})
            table.merge(picked, "t.user_id = s.user_id", source_alias="s", target_alias="t").when_matched_update(
                {"events": "t.events + 1"}
            ).execute()


def by_driver(spark, uri: str, read: str, first: int, last: int):
    from spark_jobs.engine.delta_read import read_versions
    from spark_jobs.sources.delta import DeltaManifest

    rows = read_versions(DeltaManifest(uri, read, first, last, ()))
    spark.createDataFrame(rows).createOrReplaceTempView("batch")
    return spark.sql(TRANSFORMS[read]).toArrow(), rows.num_rows


def by_spark(spark, uri: str, read: str, first: int, last: int):
    from spark_jobs.engine.delta_read import spark_versions
    from spark_jobs.sources.delta import DeltaManifest

    spark_versions(spark, DeltaManifest(uri, read, first, last, ())).createOrReplaceTempView("batch")
    return spark.sql(TRANSFORMS[read]).toArrow(), None


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
        uris = {read: str(work / f"upstream-{read}") for read in ("changes", "appends")}
        started = time.perf_counter()
        for read, uri in uris.items():
            build_upstream(uri, args.versions, args.rows, updates=read == "changes")
        print(f"upstreams: {args.versions} appends of {args.rows:,} rows (and updates) in {time.perf_counter() - started:.0f} s", flush=True)
        cold = first_read_s(uris["changes"])
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
        figures: dict[tuple[str, str, int], dict[str, list[float]]] = {}
        rows_in: dict[tuple[str, int], int] = {}
        for engine, master in engines.items():
            measure(engine, master, uris, spans, args.repeat, figures, rows_in)
        write_doc(args, engines, spans, figures, rows_in, cold)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def measure(engine: str, master: str, uris: dict[str, str], spans: list[int], repeat: int, figures: dict, rows_in: dict) -> None:
    """Both readers over each span of each upstream, alternately, in one session on `master`."""
    from spark_jobs.engine.session import default_session

    spark = default_session(master, app_name="delta-read-ways", short_lived=False, delta=True)
    try:
        for read, uri in uris.items():
            by_spark(spark, uri, read, 1, 1)  # warm both paths once
            by_driver(spark, uri, read, 1, 1)
            for span in spans:
                # The changes upstream's updates come in between its appends.
                last = span + (span // 5 if read == "changes" else 0)
                times = figures[engine, read, span] = {"driver": [], "spark": []}
                for _ in range(repeat):
                    for way, reader in (("driver", by_driver), ("spark", by_spark)):
                        t = time.perf_counter()
                        result, n = reader(spark, uri, read, 1, last)
                        times[way].append(time.perf_counter() - t)
                        if n is not None:
                            rows_in[read, span] = n
                            expected = canonical(result)
                        else:
                            assert canonical(result) == expected, f"the readers differ over {read} 1..{last} ({engine})"
                print(engine, read, span, {k: [f"{x:.2f}" for x in v] for k, v in times.items()}, flush=True)
    finally:
        spark.stop()


def write_doc(args, engines: dict[str, str], spans, figures, rows_in, cold: float) -> None:
    where = {"local": "local mode", "cluster": "standalone cluster, 2 executors of 1 core", "given": args.master}
    lines = [
        SECTION,
        "",
        f"Measured by `bench/delta_read_ways.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}. Two upstreams written by delta-rs: for "
        f"`read: changes`, {args.versions} appends of {args.rows:,} rows over {USERS:,} users with the change feed "
        "on, and after every fifth a MERGE updating a tenth of the users; for `read: appends`, the same appends "
        "alone. Per engine, one long-lived session that loads delta-spark (`default_session(delta=True)`), the two "
        f"readers of `engine/delta_read.py` in turn, each followed by a per-user sum, medians of {args.repeat}; both "
        "gave the same result (checked). The cluster runs on loopback on the same two cores "
        "(`tests/spark_servers.py`).",
        "",
        "| engine | read | appends in the range | rows read | driver (`reader: driver`) | Spark (`reader: spark`) | Spark / driver |",
        "|---|---|---|---|---|---|---|",
    ]
    ratio: dict[tuple[str, str, int], float] = {}
    for engine in sorted(engines, key=list(where).index):
        for read in ("changes", "appends"):
            for span in spans:
                times = figures[engine, read, span]
                d, s = statistics.median(times["driver"]), statistics.median(times["spark"])
                ratio[engine, read, span] = s / d
                lines.append(f"| {where[engine]} | {read} | {span} | {rows_in.get((read, span), 0):,} | {d:.2f} s | {s:.2f} s | {s / d:.2f} |")
    small, large = spans[0], spans[-1]
    at_small = [ratio[key] for key in ratio if key[2] == small]
    at_large = [ratio[key] for key in ratio if key[2] == large]
    lines += [
        "",
        f"The first Delta read of a fresh JVM took {cold:.1f} s (Delta reconstructs the table's snapshot with a Spark "
        "job of generated code); the driver's reader needs no JVM warm-up of its own.",
        "",
        f"Which is used when. The driver's reader is the default: at one append's rows Spark's reader took "
        f"{min(at_small):.2f} to {max(at_small):.2f} times as long, and a session that loads delta-spark makes every "
        "one-batch start and catch-up batch slower (\"Figures behind the code's choices\"), plus the first read's "
        "snapshot job above. Chained pipelines make such batches: an upstream's few commits, bounded by "
        f"`batch.max_versions` (and the driver's memory with them). At {args.versions} appends' rows Spark's reader "
        f"took {min(at_large):.2f} to {max(at_large):.2f} times as long, at its best on the cluster, where it spreads "
        "the files over the executors and no row passes through the driver: set `source.reader: spark` for a "
        "pipeline whose batches are millions of rows on a cluster, or whose upstream uses column mapping. "
        "`--master spark://...` adds a real cluster to this comparison.",
        "",
    ]
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
