"""A chain's upstream: one big batch of returning users into a merged state with a change feed (issue 64).

For a state of N users (one row each, `state.change_feed: true`, as a chain's
upstream has it), one batch of N clicks whose users are drawn from all N
(users coming back; about 63% of the state's keys touched), in one run:

* Structured Streaming: a seed run puts the N users into its RocksDB state,
  then one `AvailableNow` batch over the same clicks (its `triggerExecution`);
* the project, `microbatch run` in a new process with default settings: the
  executors write the batch, and their join merges it into the state's files
  and writes the change data, committed by the job
  (`StateTable._merge_by_join`);
* the project's path before issue 64, the same run with
  `engine.state_write: driver`: the batch's rows read into the job's process
  and MERGEd there by delta-rs;
* the state merged on read (`state.deletion_vectors: true`), after a batch
  of 2,000 returning clicks left vectors on its files: the same big batch,
  merged by the executors' join reading each file without the rows its
  vector deletes (MERGEd by delta-spark until 2026-12-04). Only the big
  batch's run is timed.

(Until 2026-12-04 the default was delta-spark's MERGE: its figures stay in
docs/benchmarks.md.)

Then the chain's downstream (`type: delta`, `read: changes`, default
settings) takes its first batch: every change of the upstream, the seed's
N inserts and the batch's updates (read by Spark's executors on
`local[*]` once the versions weigh more than 4 MB).

Each project run starts from its own copy of the seeded state. Reported:
wall seconds of each, and the job's Python process's peak resident memory
(its `VmHWM`, read while it runs: the JVM's is not in it).

`--first N` runs issue 64's chain goal as written instead
(`measure_first`): a first batch of N distinct users into the upstream
beside Structured Streaming's run of it, then `--returning` clicks of
users drawn from them, then the downstream's first batch, its total of
events checked against the upstream's.

    .venv/bin/python bench/chain_upstream.py [--sizes 1000000,4000000]
    .venv/bin/python bench/chain_upstream.py --first 30000000 [--returning 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import MERGE, ROOT, SCHEMA, measured_by, scratch, ss_anchor, write_section, write_spec
from state_vs_ss import seed_parquet, seed_state, users


#: The downstream: each bucket's events, from the upstream's change feed.
DOWNSTREAM = """
SELECT substr(user_id, -2, 2) AS bucket,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN events
                WHEN _change_type IN ('delete', 'update_preimage') THEN -events ELSE 0 END) AS events
FROM batch GROUP BY substr(user_id, -2, 2)
"""


def clicks(path: Path, size: int, among: int | None = None) -> None:
    """N clicks as one JSON file, users drawn uniformly from all N (or from `among` users)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    drawn = np.random.default_rng(size + 11).integers(0, among or size, size)
    with path.open("w") as out:
        for start in range(0, size, 500_000):
            out.write("".join(
                f'{{"event_id":"e{start + i}","user_id":"u{u:09d}","amount":1.5,"ts":"2026-12-02T10:00:00Z"}}\n'
                for i, u in enumerate(drawn[start : start + 500_000].tolist())
            ))


def run_watched(spec: Path) -> tuple[float, float, dict[str, Any], float]:
    """`microbatch run SPEC --json` in a new process: wall seconds, the Python
    process's peak resident MB, its outcome, and its children's (the driver
    JVM's) peak resident MB."""
    args = [sys.executable, "-m", "spark_jobs", "-q", "run", str(spec), "--json"]
    started = time.perf_counter()
    with open(spec.parent / "run.out", "w+") as out, open(spec.parent / "run.err", "w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, cwd=ROOT)
        peak = jvm = 0.0
        while proc.poll() is None:
            peak = max(peak, _peak_mb(proc.pid))
            jvm = max(jvm, sum(_peak_mb(child) for child in _children(proc.pid)))
            time.sleep(0.2)
        took = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"run failed ({proc.returncode}): {err.read()[-3000:]}")
        return took, peak, json.loads(out.read()), jvm


def _peak_mb(pid: int) -> float:
    """A process's peak resident memory so far (`VmHWM`), in MB; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 1024
    except (OSError, StopIteration):
        return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def measure(work: Path, size: int) -> dict[str, Any]:
    base = work / f"n{size}"
    clicks(base / "clicks" / "clicks-0000.json", size)
    seed_state(str(base / "seed-state"), size, change_feed=True)
    figures: dict[str, Any] = {"keys": size}

    seed_parquet(base / "ss-seed", size)
    (base / "ss-landing").mkdir()
    anchor = ("--landing", base / "ss-landing", "--seed", base / "ss-seed", "--checkpoint", base / "ss-checkpoint")
    ss_anchor(*anchor, "--max-files", 1, timeout=7200)
    os.link(base / "clicks" / "clicks-0000.json", base / "ss-landing" / "clicks-0000.json")
    _, run = ss_anchor(*anchor, "--max-files", 1, timeout=7200)
    figures["ss_s"] = run["batches"][-1]["duration_ms"]["triggerExecution"] / 1000
    shutil.rmtree(base / "ss-checkpoint")
    shutil.rmtree(base / "ss-seed")

    for label, write in (("executors", "auto"), ("in_process", "driver"), ("vectors", "auto")):
        folder = base / label
        state = {"path": "state", "keys": ["user_id"], "merge": MERGE, "change_feed": True}
        if label == "vectors":  # (the others take the default, `auto`: at these sizes, copy-on-write)
            state["deletion_vectors"] = True
        spec = write_spec(folder, f"chain_{label}", state=state, engine={"state_write": write})
        shutil.copytree(base / "seed-state", folder / "state")
        if label == "vectors":  # a few returning users merged on read first: their rows' vectors on the state's files
            clicks(folder / "landing" / "clicks-0000.json", 2_000, among=size)
            assert run_watched(spec)[2]["status"] == "committed"
        os.link(base / "clicks" / "clicks-0000.json", folder / "landing" / "clicks-0001.json")
        seconds, peak, outcome, _ = run_watched(spec)
        assert outcome["status"] == "committed", outcome
        figures[f"{label}_s"], figures[f"{label}_peak_mb"] = seconds, peak
        figures[f"{label}_keys_updated"] = outcome.get("keys_updated")
        figures[f"{label}_steps_ms"] = outcome.get("steps_ms")
        print(f"  {size:,} keys, {label}: {seconds:.1f} s, Python peak {peak:.0f} MB, steps {outcome.get('steps_ms')}", file=sys.stderr)
        if label == "executors":
            # The chain's downstream reads the upstream's changes: the seed's N inserts and the batch's updates.
            down = write_spec(folder, "chain_downstream", source={"type": "delta", "path": "state", "read": "changes"},
                              transform=DOWNSTREAM, state={"path": "buckets", "keys": ["bucket"], "merge": {"events": "sum"}})
            seconds, peak, outcome, _ = run_watched(down)
            assert outcome["status"] == "committed", outcome
            figures["downstream_s"], figures["downstream_peak_mb"] = seconds, peak
            print(f"  {size:,} keys, downstream: {seconds:.1f} s, Python peak {peak:.0f} MB", file=sys.stderr)
        shutil.rmtree(folder)
    print(json.dumps(figures), flush=True)
    shutil.rmtree(base)
    return figures


def measure_first(work: Path, size: int, returning: int) -> dict[str, Any]:
    """Issue 64's chain goal as it reads: a first batch of `size` distinct
    users (Parquet) into a chain's upstream, then `returning` clicks of
    users drawn from them, then the downstream's first batch (every
    change); each a new process with default settings. The anchor:
    Structured Streaming's run of the same first batch, a new process too.
    The downstream's totals are checked against the upstream's."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable, QueryBuilder

    base = work / f"first{size}"
    seed_parquet(base / "events", size)
    figures: dict[str, Any] = {"keys": size, "clicks_back": returning,
                               "input_mb": sum(f.stat().st_size for f in (base / "events").iterdir()) / 1e6}

    (base / "ss-landing").mkdir(parents=True)
    took, run = ss_anchor("--landing", base / "ss-landing", "--seed", base / "events", "--checkpoint", base / "ss-checkpoint",
                          "--max-files", 1000, timeout=7200)
    assert sum(b["rows"] for b in run["batches"]) == size, run
    figures["ss_s"] = took
    shutil.rmtree(base / "ss-checkpoint")
    print(f"  first batch of {size:,} keys, Structured Streaming: {took:.1f} s", file=sys.stderr, flush=True)

    folder = base / "project"
    source = {"type": "files", "path": "landing", "format": "parquet", "schema": SCHEMA}
    up = write_spec(folder, "chain_first", source=source,
                    state={"path": "state", "keys": ["user_id"], "merge": MERGE, "change_feed": True})
    for f in (base / "events").iterdir():
        os.link(f, folder / "landing" / f.name)
    back = users(np.random.default_rng(size + 7).integers(0, size, returning))
    pq.write_table(pa.table({"event_id": back, "user_id": back, "amount": pa.array(np.ones(returning)),
                             "ts": pa.nulls(returning, pa.timestamp("us", tz="UTC"))}), base / "returning.parquet")
    down = write_spec(folder, "chain_downstream", source={"type": "delta", "path": "state", "read": "changes"},
                      transform=DOWNSTREAM, state={"path": "buckets", "keys": ["bucket"], "merge": {"events": "sum"}})
    for label, spec in (("first", up), ("returning", up), ("downstream", down)):
        if label == "returning":
            os.link(base / "returning.parquet", folder / "landing" / "zz-returning.parquet")
        seconds, peak, outcome, jvm = run_watched(spec)
        assert outcome["status"] == "committed", outcome
        figures[label] = {"s": seconds, "peak_mb": peak, "jvm_peak_mb": jvm, "keys_updated": outcome.get("keys_updated"),
                          "steps_ms": outcome.get("steps_ms")}
        print(f"  {label}: {seconds:.1f} s, Python peak {peak:.0f} MB, JVM {jvm:.0f} MB, {outcome.get('keys_updated')} keys",
              file=sys.stderr, flush=True)
    assert figures["first"]["keys_updated"] == size
    total = {name: QueryBuilder().register("t", DeltaTable(str(folder / name))).execute("SELECT sum(events) AS n FROM t")
             .read_all().column("n")[0].as_py() for name in ("state", "buckets")}
    assert total["state"] == total["buckets"] == size + returning, total
    figures["exact"] = True
    print(json.dumps(figures), flush=True)
    shutil.rmtree(base)
    return figures


def first_section(r: dict[str, Any], minutes: float) -> list[str]:
    first, back, down = r["first"], r["returning"], r["downstream"]
    return [
        "## Chain: a first batch of N keys, returning keys, the downstream (issue 64's goal)",
        "",
        measured_by("`bench/chain_upstream.py --first`", minutes) + ".",
        f"A chain's upstream (`state.change_feed: true`, default settings) takes a first batch of {r['keys']:,} "
        f"distinct users ({r['input_mb']:.0f} MB of Parquet), then {r['clicks_back']:,} clicks of users drawn from "
        "them; then its downstream (`type: delta`, `read: changes`, default settings) takes its first batch, every "
        "change. Each a new process, timed from its start to its exit; peak memory is the job's own Python process's "
        "(`VmHWM`) and its driver JVM's. Structured Streaming: the same first batch, one `AvailableNow` run "
        "with RocksDB state, a new process. The downstream's total of events was checked equal to the upstream's.",
        "",
        "| run | time | / Structured Streaming | Python peak | JVM peak | keys updated |",
        "|---|---:|---:|---:|---:|---:|",
        f"| Structured Streaming, the first batch | {r['ss_s']:.1f} s | 1.00 | | | |",
        f"| the upstream's first batch | {first['s']:.1f} s | **{first['s'] / r['ss_s']:.2f}** | {first['peak_mb']:.0f} MB | "
        f"{first['jvm_peak_mb']:.0f} MB | {first['keys_updated']:,} |",
        f"| then {r['clicks_back']:,} returning clicks | {back['s']:.1f} s | | {back['peak_mb']:.0f} MB | "
        f"{back['jvm_peak_mb']:.0f} MB | {back['keys_updated']:,} |",
        f"| the downstream's first batch | {down['s']:.1f} s | | {down['peak_mb']:.0f} MB | {down['jvm_peak_mb']:.0f} MB | "
        f"{down['keys_updated']:,} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,4000000")
    parser.add_argument("--first", type=int, metavar="KEYS",
                        help="run issue 64's goal instead: a first batch of KEYS users, returning clicks, the downstream")
    parser.add_argument("--returning", type=int, default=100_000, help="with --first: the returning clicks")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.first:
        with scratch("chain-first") as work:
            # The upstream's key directory (`core/key_directory.py`) in the scratch folder, gone with it.
            os.environ.setdefault("MICROBATCH_KEY_DIRECTORY", str(work / "keys"))
            figures = measure_first(work, args.first, args.returning)
        write_section("benchmarks.md", first_section(figures, (time.perf_counter() - started) / 60))
        return
    rows = []
    with scratch("chain-upstream") as work:
        os.environ.setdefault("MICROBATCH_KEY_DIRECTORY", str(work / "keys"))
        for size in (int(s) for s in args.sizes.split(",")):
            rows.append(measure(work, size))
    lines = [
        "## Chain upstream: a big batch of returning users into a change-feed state",
        "",
        measured_by("`bench/chain_upstream.py`", (time.perf_counter() - started) / 60) + ".",
        "A merged state with `change_feed: true` (a chain's upstream) of N users; one batch of N clicks of users drawn "
        "from all N. The project's runs are new processes with default settings (the executors' join writes the rows and the "
        "change data; the job commits them); \"before\" is the same run with `engine.state_write: driver`, which merges "
        "in the job's process with delta-rs (the only path before issue 64); \"over vectors\": the state merged on read "
        "(`deletion_vectors: true`), a batch of 2,000 returning clicks first leaving vectors on its files, then the same "
        "batch, which the join merges reading each file without its deleted rows (only that run timed). "
        "Structured Streaming: the same batch into its RocksDB state (writing no table, no change feed). "
        "Peak memory is the job's Python process's.",
        "",
        "| keys | Structured Streaming | the executors' join | / SS | before (delta-rs in process) | / SS | the join over vectors | / SS | Python peak, the join | before | over vectors | downstream (its first batch: every change) | its Python peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['keys']:,} | {r['ss_s']:.1f} s | {r['executors_s']:.1f} s | **{r['executors_s'] / r['ss_s']:.2f}** | "
            f"{r['in_process_s']:.1f} s | {r['in_process_s'] / r['ss_s']:.2f} | {r['vectors_s']:.1f} s | {r['vectors_s'] / r['ss_s']:.2f} | "
            f"{r['executors_peak_mb']:.0f} MB | {r['in_process_peak_mb']:.0f} MB | {r['vectors_peak_mb']:.0f} MB | "
            f"{r['downstream_s']:.1f} s | {r['downstream_peak_mb']:.0f} MB |"
        )
    write_section("benchmarks.md", lines)


if __name__ == "__main__":
    main()
