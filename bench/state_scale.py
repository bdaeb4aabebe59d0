"""State at scale (issue 35): one steady batch's state write, three ways, as the state grows.

Every batch's keys come back uniformly from the whole state, which is what a
per-user aggregate sees when users return: a state of N keys (`k` + a
number, in files of a million rows, keys hashed over the files so every file
holds keys of every batch), and batches of 100,000 keys drawn uniformly from
all N (one row each: events 1, amount 1.0, summed into the state). For each
N the same state and the same batches go through each way, in one run:

* ``cow``: the state write the job does today (`StateTable.commit_batch`:
  delta-rs MERGE, copy-on-write, with the state fence and commit metadata).
  The anchor of the others.
* ``dv``: delta-spark MERGE into a copy of the state with deletion vectors
  on (merge-on-read), fenced through Delta's idempotent DML settings
  (`write.txnAppId`/`txnVersion`), the commit metadata as `userMetadata`;
  the MERGE's own metrics (scan and rewrite times, rows copied) are
  reported beside its time.
* ``append``: partial aggregates: the batch's rows appended to a copy of the
  state in one fenced delta-rs commit, folded by readers. Its write is
  O(batch); what it moves to readers is measured too: the state as of the
  last batch, folded by a `GROUP BY` over the whole table (delta-rs's
  `QueryBuilder`), against reading the `cow` state as it is.

Each way runs `--batches` batches per N (medians reported); the first one
of each way runs on a 100,000-key state first, to warm up, and gives the
"own 100k batch" the issue's goal is relative to. Results go to
docs/state-at-scale.md, section "Measured: the state write, three ways".
Structured Streaming is not in this run (see that section).

The dv way is left out above `--dv-max-keys` (20M by default): at 20M keys
one of its batches already took about a minute here.

    .venv/bin/python bench/state_scale.py [--sizes 1000000,5000000,20000000,100000000] [--batches 3] [--dv-max-keys N]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402

DOC = ROOT / "docs" / "state-at-scale.md"
SECTION = "## Measured: the state write, three ways"
BATCH_KEYS = 100_000
FILE_ROWS = 1_000_000
WAYS = ("cow", "dv", "append")
#: delta-spark's MERGE metrics reported beside its time.
DV_METRICS = ("scanTimeMs", "rewriteTimeMs", "numTargetRowsCopied", "numTargetFilesAdded", "numTargetDeletionVectorsAdded")


def spec_for(folder: Path):
    from spark_jobs.core.spec import load_spec
    from tests.conftest import write_spec

    spec = {
        "name": "scale",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, events BIGINT, amount DOUBLE"},
        "transform": "SELECT k, count(*) AS events, sum(amount) AS amount FROM batch GROUP BY k",
        "state": {"path": "state", "keys": ["k"], "merge": {"events": "sum", "amount": "sum"}},
        "checkpoint": "_checkpoints/scale",
    }
    return load_spec(write_spec(folder, spec))


def _keys(numbers):
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.binary_join_element_wise("k", pc.utf8_lpad(pc.cast(pa.array(numbers, pa.int64()), pa.string()), 10, "0"), "")


def seed(path: str, size: int) -> None:
    """A state of `size` keys in files of a million rows, keys hashed over the files."""
    import numpy as np
    import pyarrow as pa
    from deltalake import write_deltalake

    from spark_jobs.core.commits import METADATA_KEY
    from spark_jobs.core.fencing import STATE_FENCE, Position, commit_properties

    properties = commit_properties(STATE_FENCE, Position(0, 0), {METADATA_KEY: '{"txn": 0}'})
    order = np.random.default_rng(size).permutation(size)
    for start in range(0, size, FILE_ROWS):
        numbers = order[start:start + FILE_ROWS]
        n = len(numbers)
        piece = pa.table({"k": _keys(numbers), "events": pa.array(np.ones(n, np.int64)), "amount": pa.array(np.ones(n)),
                          "_batch_id": pa.array(np.zeros(n, np.int64))})
        write_deltalake(path, piece, mode="append", commit_properties=properties if start + FILE_ROWS >= size else None)


def batches(size: int, count: int) -> list:
    """`count` batches of the transform's output: 100,000 distinct keys drawn uniformly from `size`."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(size + 1)
    out = []
    for _ in range(count):
        numbers = rng.choice(size, min(BATCH_KEYS, size), replace=False)
        n = len(numbers)
        out.append(pa.table({"k": _keys(numbers), "events": pa.array(np.ones(n, np.int64)), "amount": pa.array(np.ones(n))}))
    return out


def run_cow(spec, updates: list) -> list[float]:
    from deltalake import DeltaTable

    from spark_jobs.core.fencing import Position
    from spark_jobs.core.state import StateTable
    from tests.conftest import batch_metadata

    state = StateTable(spec)
    times = []
    for i, batch in enumerate(updates, start=1):
        table = DeltaTable(spec.state_path)
        started = time.perf_counter()
        state.commit_batch(table, state.align(table, batch), batch_metadata(spec.name, Position(0, i)))
        times.append(time.perf_counter() - started)
    return times


def run_dv(spark, path: str, updates: list) -> tuple[list[float], list[dict]]:
    import pyarrow as pa

    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    times, metrics = [], []
    for i, batch in enumerate(updates, start=1):
        settings = {
            "spark.databricks.delta.write.txnAppId": "microbatch-state:0",
            "spark.databricks.delta.write.txnVersion": str(i),
            "spark.databricks.delta.commitInfo.userMetadata": json.dumps({"batch": i}),
        }
        started = time.perf_counter()
        for key, value in settings.items():
            spark.conf.set(key, value)
        data = batch.append_column("_batch_id", pa.array([i] * batch.num_rows, pa.int64()))
        spark.createDataFrame(data).createOrReplaceTempView("updates")
        spark.sql(
            f"MERGE INTO delta.`{path}` t USING updates s ON t.k = s.k "
            "WHEN MATCHED THEN UPDATE SET events = t.events + s.events, amount = t.amount + s.amount, _batch_id = s._batch_id "
            "WHEN NOT MATCHED THEN INSERT *"
        ).collect()
        times.append(time.perf_counter() - started)
        for key in settings:
            spark.conf.unset(key)
        last = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()[0]
        metrics.append({k: int(last["operationMetrics"].get(k, 0)) for k in DV_METRICS})
    return times, metrics


def run_append(spec, path: str, updates: list) -> list[float]:
    import pyarrow as pa
    from deltalake import write_deltalake

    from spark_jobs.core.commits import METADATA_KEY
    from spark_jobs.core.fencing import STATE_FENCE, Position, commit_properties

    times = []
    for i, batch in enumerate(updates, start=1):
        started = time.perf_counter()
        data = batch.append_column("_batch_id", pa.array([i] * batch.num_rows, pa.int64()))
        props = commit_properties(STATE_FENCE, Position(0, i), {METADATA_KEY: json.dumps({"batch": i})})
        write_deltalake(path, data, mode="append", commit_properties=props)
        times.append(time.perf_counter() - started)
    return times


def read_state_s(path: str, folded: bool) -> float:
    """Seconds to read the state as of its last batch (every key, its values), through delta-rs's QueryBuilder."""
    from deltalake import DeltaTable, QueryBuilder

    query = "SELECT k, sum(events) AS events, sum(amount) AS amount FROM state GROUP BY k" if folded else "SELECT k, events, amount FROM state"
    started = time.perf_counter()
    rows = sum(b.num_rows for b in QueryBuilder().register("state", DeltaTable(path)).execute(query))
    elapsed = time.perf_counter() - started
    assert rows > 0
    return elapsed


def measure(work: Path, size: int, count: int, spark, *, dv: bool) -> dict:
    base = work / f"n{size}"
    spec = spec_for(base)
    started = time.perf_counter()
    seed(spec.state_path, size)
    seeded = time.perf_counter() - started
    copies = {way: str(base / f"state-{way}") for way in (("dv", "append") if dv else ("append",))}
    for copy in copies.values():
        shutil.copytree(spec.state_path, copy)
    state_bytes = sum(p.stat().st_size for p in Path(spec.state_path).rglob("*.parquet"))
    updates = batches(size, count)
    figures = {"keys": size, "seed_s": seeded, "state_mb": state_bytes / 1e6}
    figures["cow"] = run_cow(spec, updates)
    if dv:
        figures["dv"], figures["dv_metrics"] = run_dv(spark, copies["dv"], updates)
    figures["append"] = run_append(spec, copies["append"], updates)
    figures["read_cow_s"] = read_state_s(spec.state_path, folded=False)
    figures["read_append_s"] = read_state_s(copies["append"], folded=True)
    print(json.dumps({k: v for k, v in figures.items()}, default=str), flush=True)
    shutil.rmtree(base)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,5000000,20000000,100000000")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--dv-max-keys", type=int, default=20_000_000, help="leave the dv way out above this many keys")
    args = parser.parse_args()
    from spark_jobs.engine.session import default_session

    spark = default_session("local[*]", app_name="state-scale", short_lived=False, delta=True)
    work = Path(tempfile.mkdtemp(prefix="microbatch-state-scale-"))
    try:
        reference = measure(work, BATCH_KEYS, args.batches, spark, dv=True)
        rows = [measure(work, int(n), args.batches, spark, dv=int(n) <= args.dv_max_keys) for n in args.sizes.split(",")]
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    write_doc(args, reference, rows)


def write_doc(args, reference: dict, rows: list[dict]) -> None:
    med = statistics.median
    own = {way: med(reference[way]) for way in WAYS}
    lines = [
        SECTION,
        "",
        f"Measured by `bench/state_scale.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}, one run: per state size, the same seeded state "
        f"(copied for each way) and the same {args.batches} batches of {BATCH_KEYS:,} keys drawn uniformly from all "
        "of it; medians of the batches. delta-spark runs in local mode on the same 2 cores.",
        "",
        "| keys in state | state (Parquet) | cow: delta-rs MERGE today | dv: delta-spark MERGE, deletion vectors | dv / cow "
        "| append: partial rows | append / cow | read the state: cow table | read the state: append, folded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in [reference, *rows]:
        cow, app = med(r["cow"]), med(r["append"])
        dv = f"{med(r['dv']):.2f} s | {med(r['dv']) / cow:.2f}" if "dv" in r else "not run | -"
        lines.append(
            f"| {r['keys']:,} | {r['state_mb']:.0f} MB | {cow:.2f} s | {dv} | {app:.2f} s | "
            f"{app / cow:.3f} | {r['read_cow_s']:.2f} s | {r['read_append_s']:.2f} s |"
        )
    lines += [
        "",
        f"Against each way's own batch at {BATCH_KEYS:,} keys (the goal: at most 1.5x at 100M): "
        + "; ".join(
            f"{r['keys']:,} keys: cow {med(r['cow']) / own['cow']:.1f}x, "
            + (f"dv {med(r['dv']) / own['dv']:.1f}x, " if "dv" in r else "")
            + f"append {med(r['append']) / own['append']:.1f}x"
            for r in rows
        )
        + ".",
        "",
        "delta-spark's own metrics of its MERGE (the median batch's): "
        + "; ".join(
            f"{r['keys']:,} keys: " + ", ".join(f"{k} {sorted(m[k] for m in r['dv_metrics'])[len(r['dv_metrics']) // 2]:,}" for k in DV_METRICS)
            for r in [reference, *rows]
            if "dv" in r
        )
        + ".",
        "",
    ]
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
