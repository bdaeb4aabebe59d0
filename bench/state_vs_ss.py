"""State at scale beside Structured Streaming (issue 35): one steady batch as the state grows, users coming back.

For each state size N, in one run, on the same files:

* the state is seeded with N users, one row each: the project's Delta state
  written directly (as a fold leaves it: one row per key, in files of a
  million rows, keys spread over every file); Structured Streaming's RocksDB
  state by a first `AvailableNow` run over the same N users as Parquet
  (`bench/anchors/structured_streaming.py --seed`);
* then `--batches` files of 100,000 clicks each land, users drawn uniformly
  from all N (users coming back), and each engine takes one file a batch:
  Structured Streaming in one `AvailableNow` run (`maxFilesPerTrigger` 1,
  each batch's `durationMs`), the project in one `run --catch-up` process
  (`max_files: 1`), once with `state.layout: merged` (a copy-on-write MERGE a batch) and
  once with `layout: appended` (an append a batch; a batch never folds);
* the appended state's fold and reads are timed on what the batches left:
  one fold as `maintain` makes it, by Spark's executors (off the batches'
  path since issue 47, so the figure is maintenance's cost), and the state
  read in full through `microbatch query`'s SQL, against the merged table's
  plain read.

Steady batch = the mean over batches 3..B (the first two of a process
warm its JVM up); for the project, a batch's seconds run from the previous
batch's outcome to its own (it reads ahead while the previous commits). The appended layout's "amortized" figure adds the fold spread over
the batches between two folds (`fold_at` x max(N, 100,000) / 100,000).
Results: docs/benchmarks.md, "State at scale: users coming back", with a plot.

    .venv/bin/python bench/state_vs_ss.py [--sizes 1000000,10000000,20000000,100000000] [--batches 8] [--no-reads]
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402
from run import project_steady, timed  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_state_at_scale.png"
SECTION = "## State at scale: users coming back"
BATCH_RECORDS = 100_000
FILE_ROWS = 1_000_000
FOLD_AT = 0.1
TRANSFORM = "SELECT user_id, count(*) AS events, sum(amount) AS amount, max(ts) AS last_seen FROM batch GROUP BY user_id"
SCHEMA = "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"


def users(numbers) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.binary_join_element_wise("u", pc.utf8_lpad(pc.cast(pa.array(numbers, pa.int64()), pa.string()), 9, "0"), "")


def seed_parquet(folder: Path, size: int) -> None:
    """The N users as clicks (one each), for Structured Streaming's seed run."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for start in range(0, size, 5 * FILE_ROWS):
        numbers = np.arange(start, min(size, start + 5 * FILE_ROWS))
        n = len(numbers)
        pq.write_table(pa.table({"event_id": users(numbers), "user_id": users(numbers), "amount": pa.array(np.ones(n)),
                                 "ts": pa.nulls(n, pa.timestamp("us", tz="UTC"))}), folder / f"seed-{start:012d}.parquet")


def seed_state(path: str, size: int) -> None:
    """The project's state of N users as a fold leaves it, in one commit
    carrying the fence at the origin and the fold's marker (so the appended
    layout counts its rows as folded)."""
    import numpy as np
    import pyarrow as pa
    from deltalake import CommitProperties, Transaction, write_deltalake

    from spark_jobs.core.commits import METADATA_KEY
    from spark_jobs.core.fencing import STATE_FENCE, Position
    from spark_jobs.core.folding import FOLD_KEY

    order = np.random.default_rng(size).permutation(size)
    schema = pa.schema([("user_id", pa.string()), ("events", pa.int64()), ("amount", pa.float64()),
                        ("last_seen", pa.timestamp("us", tz="UTC")), ("_batch_id", pa.int64())])

    def pieces():
        for start in range(0, size, FILE_ROWS):
            numbers = order[start:start + FILE_ROWS]
            n = len(numbers)
            yield pa.record_batch([users(numbers), pa.array(np.ones(n, np.int64)), pa.array(np.ones(n)),
                                   pa.nulls(n, pa.timestamp("us", tz="UTC")), pa.array(np.zeros(n, np.int64))], schema=schema)

    origin = Position(0, 0).encode()
    props = CommitProperties(custom_metadata={METADATA_KEY: json.dumps({"txn": origin}), FOLD_KEY: json.dumps({"seed": size})},
                             app_transactions=[Transaction(STATE_FENCE, origin)])
    write_deltalake(path, pa.RecordBatchReader.from_batches(schema, pieces()), mode="append", commit_properties=props,
                    target_file_size=64 * 1024 * 1024)


def click_files(folder: Path, size: int, count: int) -> list[Path]:
    """`count` JSON files of 100,000 clicks, users drawn uniformly from all `size`."""
    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(size + 7)
    out = []
    for f in range(count):
        drawn = rng.integers(0, size, BATCH_RECORDS)
        seconds = rng.integers(0, 86_400, BATCH_RECORDS)
        lines = (
            f'{{"event_id":"e{f}-{i}","user_id":"u{u:09d}","amount":1.5,"ts":"2026-11-26T{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}Z"}}'
            for i, (u, s) in enumerate(zip(drawn.tolist(), seconds.tolist()))
        )
        path = folder / f"clicks-{f:04d}.json"
        path.write_text("\n".join(lines) + "\n")
        out.append(path)
    return out


def ss_batches(landing: Path, seed: Path, checkpoint: Path) -> dict[str, Any]:
    _, stdout = timed([sys.executable, str(ROOT / "bench/anchors/structured_streaming.py"), "--landing", str(landing),
                       "--seed", str(seed), "--checkpoint", str(checkpoint), "--max-files", "1"], timeout=7200)
    return json.loads(stdout.strip().splitlines()[-1])


def project_spec(folder: Path, layout: str, engine: dict[str, Any] | None = None) -> Path:
    from tests.conftest import write_spec

    spec = {
        "name": f"scale_{layout}",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": SCHEMA},
        "transform": TRANSFORM,
        "state": {"path": "state", "keys": ["user_id"], "merge": {"events": "sum", "amount": "sum", "last_seen": "max"},
                  "layout": layout, "fold_at": FOLD_AT},
        "checkpoint": "_checkpoints/scale",
        "batch": {"max_files": 1},
        **({"engine": engine} if engine else {}),
    }
    return write_spec(folder, spec)


def seeded_project(base: Path, folder: Path, layout: str, clicks: list[Path], engine: dict[str, Any] | None = None) -> Path:
    """A project in `folder` on its own copy of the seeded state
    (`base/seed-state`), the clicks landed (hard links); its spec's path."""
    spec_path = project_spec(folder, layout, engine)
    shutil.copytree(base / "seed-state", folder / "state")
    for path in clicks:
        os.link(path, folder / "landing" / path.name)
    return spec_path


def read_s(spec_path: Path) -> float:
    """Seconds to read the whole state as of its last batch through delta-rs (`microbatch query`'s SQL)."""
    from spark_jobs.core.folding import read_state
    from spark_jobs.core.spec import load_spec

    started = time.perf_counter()
    rows = sum(batch.num_rows for batch in read_state(load_spec(spec_path)))
    assert rows > 0
    return time.perf_counter() - started


def fold_s(spec_path: Path) -> float:
    """One fold as `maintain` makes it (issue 47: never inside a batch): by
    Spark's executors, the job's process committing; the session is
    started before the clock does."""
    from deltalake import DeltaTable

    from spark_jobs.core.folding import fold
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.spark_compute import SparkCompute

    spec = load_spec(spec_path)
    compute = SparkCompute()
    try:
        started = time.perf_counter()
        assert fold(spec, DeltaTable(spec.state_path), files=compute) is not None
        return time.perf_counter() - started
    finally:
        compute.close()


def measure(work: Path, size: int, batches: int, *, fold_and_reads: bool = True, reads: bool = True) -> dict[str, Any]:
    """One state size; `fold_and_reads`: also time the appended state's
    fold and, with `reads`, both states' full reads (`make bench` leaves
    them out; a full read of 100M keys holds them all in this process,
    about 23 GB)."""
    base = work / f"n{size}"
    clicks = click_files(base / "clicks", size, batches)
    started = time.perf_counter()
    seed_state(str(base / "seed-state"), size)
    figures: dict[str, Any] = {"keys": size, "seed_state_s": time.perf_counter() - started}
    figures["state_mb"] = sum(p.stat().st_size for p in (base / "seed-state").rglob("*.parquet")) / 1e6

    # Structured Streaming: seed run, then the clicks.
    seed_parquet(base / "ss-seed", size)
    (base / "ss-landing").mkdir()
    seeded = ss_batches(base / "ss-landing", base / "ss-seed", base / "ss-checkpoint")
    figures["ss_seed_s"] = seeded["query_s"]
    assert sum(b["rows"] for b in seeded["batches"]) == size, seeded["batches"]
    for path in clicks:
        os.link(path, base / "ss-landing" / path.name)
    run = ss_batches(base / "ss-landing", base / "ss-seed", base / "ss-checkpoint")
    assert [b["rows"] for b in run["batches"]] == [BATCH_RECORDS] * batches, run["batches"]
    figures["ss_s"] = [b["duration_ms"]["triggerExecution"] / 1000 for b in run["batches"]]
    shutil.rmtree(base / "ss-checkpoint")
    shutil.rmtree(base / "ss-seed")
    print(f"  {size:,} keys: structured streaming seeded in {figures['ss_seed_s']:.1f} s, batches {figures['ss_s']}", file=sys.stderr, flush=True)

    for layout in ("merged", "appended"):
        folder = base / layout
        spec_path = seeded_project(base, folder, layout, clicks)
        runs = project_steady(spec_path, batches)
        assert [r["records"] for r in runs] == [BATCH_RECORDS] * batches, runs
        figures[f"{layout}_s"] = [r["seconds"] for r in runs]
        figures[f"{layout}_pace_s"] = steady(figures[f"{layout}_s"])
        figures[f"{layout}_folds"] = sum(1 for r in runs if r["steps_ms"] and r["steps_ms"].get("fold", 0) > 50)
        if fold_and_reads:
            if reads:
                figures[f"{layout}_read_s"] = read_s(spec_path)
            if layout == "appended":
                figures["fold_s"] = fold_s(spec_path)
                if reads:
                    figures["appended_read_folded_s"] = read_s(spec_path)
        print(f"  {size:,} keys, {layout}: batches {[round(s, 2) for s in figures[f'{layout}_s']]}, pace "
              f"{figures[f'{layout}_pace_s']:.2f} s", file=sys.stderr, flush=True)
        shutil.rmtree(folder)
    print(json.dumps(figures), flush=True)
    shutil.rmtree(base)
    return figures


def steady(seconds: list[float]) -> float:
    """The steady batch: the mean of batches 3 on (the first two of a
    process warm its JVM up, for both engines). The mean, not the median:
    reading ahead, the project's batches alternate short and long (a batch
    read while the previous one committed ends soon after it), so only the
    mean is its pace."""
    return statistics.mean(seconds[2:])


def _seconds(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f} s"


def fold_every(size: int) -> float:
    """Batches of 100,000 new rows between two folds."""
    return max(1.0, FOLD_AT * max(size, 100_000) / BATCH_RECORDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000,20000000,100000000")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--no-reads", action="store_true", help="leave out the full reads of each state (100M keys: about 23 GB in this process)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="microbatch-state-vs-ss-"))
    try:
        rows = [measure(work, int(n), args.batches, reads=not args.no_reads) for n in ["100000", *args.sizes.split(",")]]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_doc(args, rows)


def write_doc(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    for r in rows:
        for layout in ("merged", "appended"):
            r[f"{layout}_pace_s"] = steady(r[f"{layout}_s"])
    def ss(r: dict[str, Any]) -> float:
        return steady(r["ss_s"])

    def amortized(r: dict[str, Any]) -> float:
        folds_in_run = r["appended_folds"]
        # A run whose batches already folded has the fold in its pace.
        return r["appended_pace_s"] + (0 if folds_in_run else r["fold_s"] / fold_every(r["keys"]))

    own = rows[0]["appended_pace_s"]
    lines = [
        SECTION,
        "",
        f"Measured by `bench/state_vs_ss.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}, one run. Per state size: the state seeded with N users "
        f"(one row each), then {args.batches} files of {BATCH_RECORDS:,} clicks whose users are drawn uniformly from all N, "
        "one file a batch, the same files for every engine. Structured Streaming: `Trigger.AvailableNow`, RocksDB state "
        "(seeded by a first run over the N users), `noop` sink, each batch's `durationMs`. This project: `run --catch-up`, "
        "`max_files: 1`, a batch's seconds from the previous batch's outcome to its own; means of batches 3 on, with "
        f"`state.layout: merged` (a MERGE a batch) and `appended` (`fold_at: {FOLD_AT}`).",
        "",
        "| keys in state | state (Parquet) | Structured Streaming | merged | merged / SS | appended | **appended / SS** "
        "| appended / its 100k batch | fold (every ~N batches) | appended, fold amortized | amortized / SS "
        "| read the state: merged | read: appended, before its fold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, app = ss(r), r["appended_pace_s"]
        lines.append(
            f"| {r['keys']:,} | {r['state_mb']:.0f} MB | {s:.2f} s | {r['merged_pace_s']:.2f} s | {r['merged_pace_s'] / s:.2f} "
            f"| {app:.2f} s | **{app / s:.2f}** | {app / own:.2f} | {r['fold_s']:.1f} s (every {fold_every(r['keys']):.0f}) "
            f"| {amortized(r):.2f} s | {amortized(r) / s:.2f} | {_seconds(r.get('merged_read_s'))} | {_seconds(r.get('appended_read_s'))} |"
        )
    big = rows[-1]
    lines += [
        "",
        f"The goal (issue 35), at {big['keys']:,} keys: the appended steady batch at most 0.5x Structured Streaming's "
        f"(measured: {big['appended_pace_s'] / ss(big):.2f}) and at most 1.5x its own batch at 100,000 keys (measured: "
        f"{big['appended_pace_s'] / own:.2f}). With the fold spread over the batches between two folds: "
        f"{amortized(big) / ss(big):.2f}x Structured Streaming. Structured Streaming's seed runs took "
        + ", ".join(f"{r['ss_seed_s']:.0f} s ({r['keys']:,})" for r in rows)
        + "; all batches: "
        + "; ".join(
            f"{r['keys']:,}: SS {[round(x, 2) for x in r['ss_s']]}, merged {[round(x, 2) for x in r['merged_s']]}, "
            f"appended {[round(x, 2) for x in r['appended_s']]}"
            for r in rows
        )
        + ".",
        "",
        f"![steady batch against state size]({PLOT.name})",
        "",
    ]
    plot(rows, ss, amortized)
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


def plot(rows: list[dict[str, Any]], ss, amortized) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [r["keys"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(keys, [ss(r) for r in rows], "o-", color="#9aa5b1", label="Structured Streaming (RocksDB)")
    ax.plot(keys, [r["merged_pace_s"] for r in rows], "s-", color="#c9a26b", label="project, layout: merged")
    ax.plot(keys, [r["appended_pace_s"] for r in rows], "D-", color="#2f6f9f", label="project, layout: appended")
    ax.plot(keys, [amortized(r) for r in rows], "D--", color="#2f6f9f", alpha=0.5, label="appended, fold amortized")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("users in the state (each batch: 100,000 clicks of returning users)")
    ax.set_ylabel("steady batch (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


if __name__ == "__main__":
    main()
