"""delta-spark MERGE of 100k returning users into an N-key Delta state:
copy-on-write vs deletion vectors (merge-on-read), one warm Spark session.

    PYTHONPATH=/work/main:/work/main/bench /work/main/.venv/bin/python bench/dv_merge.py \
        --size 20000000 --batches 8 --variants a,b,c --work /tmp/dv/work  (then removed from bench/: git show <this commit>:bench/dv_merge.py)

Variants (each on its own copy of the seeded state):
  a  as seeded (change feed on), copy-on-write
  b  + delta.enableDeletionVectors=true (change feed on)
  c  + delta.enableDeletionVectors=true, delta.enableChangeDataFeed=false
Per batch: the batch's clicks aggregated by the benchmark's TRANSFORM and staged
as Parquet once (timed apart), then each variant MERGEs the staged files with the
project's `merge_sql` statement (and its fence settings), in rotating order.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

from harness import MERGE, SCHEMA, TRANSFORM
from state_vs_ss import BATCH_RECORDS, click_files, seed_state

from spark_jobs.engine.delta_merge import TXN_APP_ID, TXN_VERSION, USER_METADATA, merge_sql

SPEC = SimpleNamespace(state=SimpleNamespace(keys=["user_id"], merge=MERGE))
COLUMNS = ["user_id", "events", "amount", "last_seen", "_batch_id"]


def log(*a):
    print(*a, flush=True)


def uptime(tag):
    log(f"[uptime {tag}] {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=20_000_000)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--variants", default="a,b,c")
    ap.add_argument("--work", default="/tmp/dv/work")
    ap.add_argument("--low-shuffle", default="", help="a conf key to set true for variant b2 (if it exists)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    seed = work / f"seed-{args.size}"
    out: dict = {"size": args.size, "batches": args.batches}

    if not (seed / "_delta_log").exists():
        t = time.perf_counter()
        seed_state(str(seed), args.size, change_feed=True)
        out["seed_s"] = time.perf_counter() - t
        log(f"seeded {args.size:,} keys in {out['seed_s']:.1f} s")
    out["seed_bytes"] = du(seed)
    log(f"seed on disk: {out['seed_bytes'] / 1e6:.0f} MB, parquet files: {len(list(seed.glob('*.parquet')))}")
    clicks_dir = work / f"clicks-{args.size}-{args.batches}"
    if not clicks_dir.exists():
        click_files(clicks_dir, args.size, args.batches)
    clicks = sorted(clicks_dir.glob("clicks-*.json"))
    assert len(clicks) == args.batches

    for v in variants:
        shutil.rmtree(work / v, ignore_errors=True)
        shutil.copytree(seed, work / v)
    staged_root = work / "staged"
    shutil.rmtree(staged_root, ignore_errors=True)

    from spark_jobs.engine.session import default_session

    t = time.perf_counter()
    spark = default_session("local[*]", app_name="dv", short_lived=False, delta=True)
    log(f"session in {time.perf_counter() - t:.1f} s; Spark {spark.version}")
    jvm = spark.sparkContext._jvm
    try:
        out["delta_spark"] = jvm.io.delta.VersionKt.getDeltaVersion() if False else None
    except Exception:
        pass
    import importlib.metadata as md

    out["versions"] = {p: md.version(p) for p in ("pyspark", "delta-spark", "deltalake", "pyarrow")}
    out["spark"] = spark.version
    log(json.dumps(out["versions"]))

    def path(v):
        return str((work / v).resolve())

    def tbl(v):
        return "delta.`" + path(v) + "`"

    if "b" in variants or "b2" in variants:
        for v in [x for x in variants if x.startswith("b")]:
            spark.sql(f"ALTER TABLE {tbl(v)} SET TBLPROPERTIES ('delta.enableDeletionVectors'='true')")
    if "c" in variants:
        spark.sql(
            f"ALTER TABLE {tbl('c')} SET TBLPROPERTIES ('delta.enableDeletionVectors'='true', "
            "'delta.enableChangeDataFeed'='false')"
        )
    for v in variants:
        d = spark.sql(f"DESCRIBE DETAIL {tbl(v)}").collect()[0].asDict()
        log(f"{v}: detail minReader={d.get('minReaderVersion')} minWriter={d.get('minWriterVersion')} "
            f"features={d.get('tableFeatures')} props={d.get('properties')} files={d.get('numFiles')}")
    start_versions = {v: spark.sql(f"DESCRIBE HISTORY {tbl(v)} LIMIT 1").collect()[0]["version"] for v in variants}
    log(f"start versions {start_versions}")

    stage_s, merge_s, metrics = [], {v: [] for v in variants}, {v: [] for v in variants}
    uptime("before series")
    series_t = time.perf_counter()
    for i, f in enumerate(clicks):
        batch_id = i + 1
        t = time.perf_counter()
        src = spark.read.schema(SCHEMA).json(str(f))
        src.createOrReplaceTempView("batch")
        agg = spark.sql(TRANSFORM).selectExpr("*", f"CAST({batch_id} AS BIGINT) AS _batch_id")
        sdir = staged_root / f"b{batch_id}"
        agg.write.parquet(str(sdir))
        stage_s.append(time.perf_counter() - t)
        order = variants[i % len(variants):] + variants[: i % len(variants)]
        line = [f"batch {batch_id}: stage {stage_s[-1]:.2f} s"]
        for v in order:
            s = spark.newSession()
            if v == "b2" and args.low_shuffle:
                s.conf.set(args.low_shuffle, "true")
            staged = s.read.parquet(str(sdir))
            view = f"src_{v}_{batch_id}"
            staged.createOrReplaceTempView(view)
            s.conf.set(TXN_APP_ID, f"dv-{v}")
            s.conf.set(TXN_VERSION, str(batch_id))
            s.conf.set(USER_METADATA, json.dumps({"batch": batch_id}))
            sql = merge_sql(SPEC, COLUMNS, path(v), view)
            if i == 0 and v == order[0]:
                log(sql)
            t = time.perf_counter()
            s.sql(sql).collect()
            merge_s[v].append(time.perf_counter() - t)
            for k in (TXN_VERSION, TXN_APP_ID, USER_METADATA):
                s.conf.unset(k)
            h = spark.sql(f"DESCRIBE HISTORY {tbl(v)} LIMIT 1").collect()[0]
            m = dict(h["operationMetrics"])
            m["version"] = h["version"]
            metrics[v].append(m)
            line.append(f"{v} {merge_s[v][-1]:.2f} s")
        log(", ".join(line))
    out["series_s"] = time.perf_counter() - series_t
    uptime("after series")

    out["start_versions"] = start_versions
    out["stage_s"] = stage_s
    out["merge_s"] = merge_s
    out["metrics"] = metrics
    log("\nper-variant MERGE seconds (batches 3..):")
    for v in variants:
        xs = merge_s[v][2:]
        log(f"  {v}: mean {statistics.mean(xs):.2f} min {min(xs):.2f} max {max(xs):.2f}  all {[round(x, 2) for x in merge_s[v]]}")
    xs = stage_s[2:]
    log(f"  stage: mean {statistics.mean(xs):.2f} min {min(xs):.2f} max {max(xs):.2f} all {[round(x, 2) for x in stage_s]}")
    keys = ["numTargetFilesAdded", "numTargetFilesRemoved", "numTargetBytesAdded", "numTargetBytesRemoved",
            "numTargetChangeFilesAdded", "numTargetChangeFileBytes", "numTargetDeletionVectorsAdded",
            "numTargetDeletionVectorsRemoved", "numTargetDeletionVectorsUpdated", "numTargetRowsUpdated",
            "numTargetRowsInserted", "numTargetRowsCopied", "executionTimeMs", "scanTimeMs", "rewriteTimeMs"]
    for v in variants:
        log(f"\nmetrics {v}:")
        for m in metrics[v]:
            log("  v%s " % m["version"] + " ".join(f"{k}={m.get(k)}" for k in keys if k in m))
    log("\nall metric keys: " + ", ".join(sorted(metrics[variants[0]][-1])))

    # correctness and table shape
    expected_events = args.size + args.batches * BATCH_RECORDS
    out["check"] = {}
    for v in variants:
        r = spark.sql(f"SELECT count(*) n, count(DISTINCT user_id) k, sum(events) e, max(_batch_id) b FROM {tbl(v)}").collect()[0]
        versions = spark.sql(f"DESCRIBE HISTORY {tbl(v)}").count()
        d = spark.sql(f"DESCRIBE DETAIL {tbl(v)}").collect()[0].asDict()
        out["check"][v] = {"rows": r["n"], "keys": r["k"], "sum_events": r["e"], "max_batch": r["b"],
                           "expected_sum_events": expected_events, "ok": r["n"] == args.size and r["e"] == expected_events,
                           "history_versions": versions, "numFiles": d["numFiles"], "sizeInBytes": d["sizeInBytes"],
                           "on_disk_bytes": du(work / v)}
        log(f"spark check {v}: {out['check'][v]}")
        if v != "c":
            cdf = spark.sql(
                f"SELECT _change_type, count(*) n, sum(events) e FROM table_changes_by_path('{path(v)}', {start_versions[v] + 1}) "
                "GROUP BY _change_type ORDER BY 1").collect()
            out["check"][v]["spark_cdf"] = [tuple(r) for r in cdf]
            log(f"spark cdf {v} from v{start_versions[v] + 1}: {out['check'][v]['spark_cdf']}")
    (work / f"result-{args.size}.json").write_text(json.dumps(out, default=str, indent=1))
    spark.stop()
    log(f"result: {work / f'result-{args.size}.json'}")


if __name__ == "__main__":
    main()
