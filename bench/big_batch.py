"""A batch bigger than one process (issue 47): 1M, 10M and 30M distinct keys in one batch, beside Structured Streaming.

For each size N, in one run, on the same Parquet files (N events of N
distinct users, files of 2M rows):

* the project runs the batch as a user would: `microbatch run SPEC --json`,
  a new process, `local[*]`, default settings, the whole folder in one
  batch, once with `state.layout: merged` and once with `appended`;
* the anchor, Structured Streaming with RocksDB state, runs the same files
  as one `AvailableNow` batch (`bench/anchors/structured_streaming.py
  --seed`), a new process too;
* then `microbatch maintain` folds the appended state after a second batch
  of N/10 returning users (a fold of N keys).

Measured: wall seconds from process start to exit; for the project, the
peak RSS of the job's own Python process (`VmHWM` in /proc, sampled until
it exits: its driver JVM, a child, apart, and reported apart), which is
what a batch used to fill with its rows (about 170 bytes a key before this
change: 943 MB at 4M keys).

With `--cluster 2`, both run on a standalone cluster of two one-core
workers started for the run (`tests/spark_servers.py`), executors with
Spark's default settings.

Results: docs/state-at-scale.md, "A batch bigger than one process" (and
"The same batch on a standalone cluster").

    .venv/bin/python bench/big_batch.py [--sizes 1000000,10000000,30000000] [--cluster 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402
from state_vs_ss import TRANSFORM, users  # noqa: E402

DOC = ROOT / "docs" / "state-at-scale.md"
SECTION = "## A batch bigger than one process"
CLUSTER_SECTION = "## The same batch on a standalone cluster"
FILE_ROWS = 2_000_000


def land(folder: Path, size: int, start: int = 0, step: int = 1) -> None:
    """`size` events of distinct users (`u` + 9 digits, from `start` by `step`) as Parquet files."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for first in range(0, size, FILE_ROWS):
        numbers = start + step * np.arange(first, min(size, first + FILE_ROWS))
        n = len(numbers)
        pq.write_table(
            pa.table({
                "event_id": users(numbers + 10**9 * (start + 1)),
                "user_id": users(numbers),
                "amount": pa.array(np.full(n, 1.5)),
                "ts": pa.array(np.full(n, 1_795_000_000_000_000, dtype="datetime64[us]")).cast(pa.timestamp("us", tz="UTC")),
            }),
            folder / f"events-{start:010d}-{first:012d}.parquet",
        )


def spec(folder: Path, layout: str) -> Path:
    from tests.conftest import write_spec

    return write_spec(folder, {
        "name": f"big_{layout}",
        "source": {"type": "files", "path": "landing", "format": "parquet",
                   "schema": "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"},
        "transform": TRANSFORM,
        "state": {"path": "state", "keys": ["user_id"], "merge": {"events": "sum", "amount": "sum", "last_seen": "max"}, "layout": layout},
        "checkpoint": "_checkpoints/big",
    })


def _rss(pid: int) -> int:
    """A process's peak resident memory so far (VmHWM), in bytes; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def run(args: list[str], *, timeout: float = 7200) -> dict[str, Any]:
    """A new process: wall seconds, its own peak RSS and its children's, its stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(args, stdout=out, stderr=err, cwd=ROOT)
        peak = {"own": 0, "children": 0}

        def sample() -> None:
            while proc.poll() is None:
                peak["own"] = max(peak["own"], _rss(proc.pid))
                peak["children"] = max(peak["children"], sum(_rss(c) for c in _children(proc.pid)))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait(timeout=timeout)
        seconds = time.perf_counter() - started
        sampler.join()
        out.seek(0)
        err.seek(0)
        stdout = out.read()
        if code != 0:
            raise RuntimeError(f"{' '.join(args[:4])} ... failed ({code}):\n{stdout[-3000:]}\n{err.read()[-3000:]}")
    return {"seconds": seconds, "rss_mb": peak["own"] / 1e6, "jvm_rss_mb": peak["children"] / 1e6, "stdout": stdout}


def measure(work: Path, size: int, master: str) -> dict[str, Any]:
    base = work / f"n{size}"
    land(base / "events", size)
    figures: dict[str, Any] = {"keys": size, "input_mb": sum(p.stat().st_size for p in (base / "events").glob("*")) / 1e6}

    (base / "ss-landing").mkdir(parents=True)
    ss = run([sys.executable, str(ROOT / "bench/anchors/structured_streaming.py"), "--landing", str(base / "ss-landing"),
              "--seed", str(base / "events"), "--checkpoint", str(base / "ss-checkpoint"), "--max-files", "1000",
              "--master", master])
    rows = sum(b["rows"] for b in json.loads(ss["stdout"].strip().splitlines()[-1])["batches"])
    assert rows == size, rows
    figures["ss"] = {k: v for k, v in ss.items() if k != "stdout"}
    shutil.rmtree(base / "ss-checkpoint")
    print(f"  {size:,} keys: structured streaming {ss['seconds']:.1f} s", file=sys.stderr, flush=True)

    for layout in ("merged", "appended"):
        folder = base / layout
        path = spec(folder, layout)
        for f in (base / "events").glob("*.parquet"):
            os.link(f, folder / "landing" / f.name)
        first = run([sys.executable, "-m", "spark_jobs", "run", str(path), "--json", "--master", master])
        outcome = json.loads(first["stdout"])
        assert outcome["status"] == "committed" and outcome["keys_updated"] == size, outcome
        figures[layout] = {k: v for k, v in first.items() if k != "stdout"}
        print(f"  {size:,} keys, {layout}: {first['seconds']:.1f} s, job's process {first['rss_mb']:.0f} MB "
              f"(JVM {first['jvm_rss_mb']:.0f} MB)", file=sys.stderr, flush=True)
        if layout == "appended":
            land(folder / "landing", size // 10, start=1, step=10)  # a tenth of the users come back
            again = run([sys.executable, "-m", "spark_jobs", "run", str(path), "--json", "--master", master])
            assert json.loads(again["stdout"])["status"] == "committed"
            fold = run([sys.executable, "-m", "spark_jobs", "maintain", str(path), "--json", "--master", master])
            figures["fold"] = {k: v for k, v in fold.items() if k != "stdout"}
            print(f"  {size:,} keys: fold {fold['seconds']:.1f} s, job's process {fold['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
        shutil.rmtree(folder)
    shutil.rmtree(base)
    print(json.dumps(figures), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000,30000000")
    parser.add_argument("--work", help="a folder for the data (default: a new temporary one)")
    parser.add_argument("--cluster", type=int, default=0, metavar="WORKERS",
                        help="run both on a standalone cluster of this many workers of one core each (tests/spark_servers.py)")
    parser.add_argument("--worker-memory", default="8g", help="each worker's memory (--cluster); executors keep Spark's default")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="microbatch-big-batch-"))
    cluster = None
    try:
        master = "local[*]"
        if args.cluster:
            from tests.spark_servers import start_cluster

            cluster, master = start_cluster(work / "cluster", cores=1, memory=args.worker_memory, workers=args.cluster)
        rows = [measure(work, int(n), master) for n in args.sizes.split(",")]
    finally:
        if cluster is not None:
            cluster.stop()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    write_doc(rows, f"a standalone cluster of {args.cluster} workers of one core" if args.cluster else "`local[*]`")


def write_doc(rows: list[dict[str, Any]], where: str) -> None:
    lines = [
        SECTION if where == "`local[*]`" else CLUSTER_SECTION,
        "",
        f"`bench/big_batch.py`, {date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores, one run: a first "
        "batch of N events of N distinct users (Parquet, files of 2M rows) through `microbatch run` (a new process, "
        f"{where}, default settings), beside Structured Streaming (RocksDB state, one `AvailableNow` batch, a new "
        "process) on the same files. \"Job's process\" is the peak RSS of the run's own Python process (its driver "
        "JVM apart). The fold is `microbatch maintain` of the appended state after a second batch of N/10 returning users.",
        "",
        "| keys | input | Structured Streaming | merged | merged / SS | job's process | appended | appended / SS | job's process | fold | fold's process |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ss = r["ss"]["seconds"]
        lines.append(
            f"| {r['keys']:,} | {r['input_mb']:.0f} MB | {ss:.1f} s | {r['merged']['seconds']:.1f} s | "
            f"{r['merged']['seconds'] / ss:.2f} | {r['merged']['rss_mb']:.0f} MB | {r['appended']['seconds']:.1f} s | "
            f"**{r['appended']['seconds'] / ss:.2f}** | {r['appended']['rss_mb']:.0f} MB | {r['fold']['seconds']:.1f} s | "
            f"{r['fold']['rss_mb']:.0f} MB |"
        )
    lines.append("")
    replace_section(DOC, lines[0], lines)


if __name__ == "__main__":
    main()
