"""The headline figures beside Structured Streaming, in one run of under half an hour (`make bench`).

Each figure runs its Structured Streaming anchor in the same run, on the same
files, and reports the project's figure over the anchor's; the full
benchmarks (`make bench-full`, about 4.5 hours) measure each of them at more
sizes, with more repeats and with Flink:

1. **one batch**: a fresh pipeline's first 100k-record batch, a new process
   each (`bench/run.py`'s figure 1, `--repeat` times, interleaved);
2. **no-op**: a run with nothing new, a new process each (figure 2);
3. **steady**: batches 2..6 in one process (figure 3);
4. **catch-up**: a backlog of `--backlog` batches (2 files of 50,000 clicks
   each), taken by one new process: `microbatch run --catch-up` against
   an `AvailableNow` query, from process start to exit;
5. **state at 20M keys**: the steady batch of users coming back to a state
   of `--state-keys` keys, both state layouts (`bench/state_vs_ss.py` at
   one size, `--state-batches` batches);
6. **a fleet of 50**: `--fleet` pipelines on a live Airflow with the shared
   Spark Connect engine (and the fleet's parse interval of 300 s), against N queries in one Structured Streaming
   driver (`bench/fleet.py` at one size, a file every `--fleet-interval`
   seconds a pipeline for as long): p95 from landing to commit, and the
   machine's CPU-s per file.

Prints the table and writes docs/benchmarks.md's section "Headline (make
bench)". Each part's own section is left to the full benchmark.

    .venv/bin/python bench/headline.py [--repeat 2] [--backlog 10] [--state-keys 20000000] [--fleet 50]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from harness import measured_by, microbatch, scratch, write_section
from run import BATCH_RECORDS, Figure, Waves, one_batch_and_no_data, project_pipeline, ss_run, steady


def catch_up(work: Path, waves: Waves, backlog: int, repeat: int) -> Figure:
    """Figure 4: a backlog of `backlog` batches taken by one new process (process start to exit, every batch
    committed), each engine on its own hard links of the same files."""
    figure = Figure(f"catch-up: {backlog} batches in one new process")
    landed = range(100, 100 + backlog)  # (the steady figure's waves and more: each engine has its own links)
    for r in range(repeat):
        print(f"  round {r + 1}/{repeat}", flush=True)
        base = work / f"catch-up-{r}"
        took, ss = ss_run(waves.land(base / "ss" / "landing", landed), base / "ss" / "checkpoint")
        assert len(ss["batches"]) == backlog, ss
        figure.add("structured streaming", took)
        took, stdout = microbatch(project_pipeline(base / "project", waves, landed), "--catch-up", timeout=1800)
        outcomes = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        committed = [o for o in outcomes if o["status"] == "committed"]  # (then one no_new_data)
        assert len(committed) == backlog, outcomes
        assert sum(o["records_in"] for o in committed) == backlog * BATCH_RECORDS, outcomes
        figure.add("project", took)
    return figure


def state_at_scale(work: Path, keys: int, batches: int) -> dict[str, Any]:
    """Figure 5: `state_vs_ss.measure` at one size, without the appended
    state's fold and the full reads (`make bench-full` times them)."""
    from state_vs_ss import measure, pace

    row = measure(work, keys, batches, fold_and_reads=False)
    return {
        "keys": keys,
        "ss_seed_s": row["ss_seed_s"],
        **{k: pace(row[f"{k}_s"]) for k in ("ss", "merged", "vectors", "appended")},
    }


def fleet(work: Path, n: int, interval: float) -> dict[str, Any]:
    """Figure 6: `bench/fleet.py` at one size, the shared engine and the anchor."""
    from fleet import machine_cpu, run_anchor, run_project

    args = argparse.Namespace(
        interval=interval, duration=interval, idle=30.0, drain=180.0, poll=10.0, parse_interval=300, warm=0
    )
    out: dict[str, Any] = {"n": n}
    for kind, runner in (
        ("project", lambda w: run_project(n, args, w, "connect")),
        ("structured streaming", lambda w: run_anchor(n, args, w)),
    ):
        folder = work / f"fleet-{kind.replace(' ', '-')}"
        folder.mkdir()
        result = runner(folder)
        out[kind] = {k: result[k] for k in ("p50", "p95", "files", "missing")} | {
            "cpu_per_file": machine_cpu(result)[0]
        }
        print(f"  {kind}: {json.dumps(out[kind])}", flush=True)
    return out


def table(figures: list[Figure], state: dict[str, Any], fleet_row: dict[str, Any]) -> list[str]:
    lines = ["| figure | Structured Streaming | project | project / SS |", "|---|---|---|---|"]
    for f in figures:
        ss, ours = f.value("structured streaming"), f.value("project")
        lines.append(f"| {f.name} | {ss:.2f} s | {ours:.2f} s | **{f.ratio('structured streaming'):.2f}** |")
    merged = (("merged", "`layout: merged`, copy-on-write (`deletion_vectors: false`)"),
              ("vectors", "`layout: merged`, default settings (`deletion_vectors: auto`: merged on read)"))
    for key, label in (*merged, ("appended", "`layout: appended`")):
        lines.append(
            f"| steady batch, users coming back to {state['keys']:,} keys, {label} | {state['ss']:.2f} s "
            f"| {state[key]:.2f} s | **{state[key] / state['ss']:.2f}** |"
        )
    ours, theirs, n = fleet_row["project"], fleet_row["structured streaming"], fleet_row["n"]
    lines.append(
        f"| fleet of {n}, p95 landing to commit (shared engine) | {theirs['p95']:.1f} s | {ours['p95']:.1f} s "
        f"| **{ours['p95'] / theirs['p95']:.2f}** |"
    )
    lines.append(
        f"| fleet of {n}, the machine's CPU-s per file | {theirs['cpu_per_file']:.2f} | {ours['cpu_per_file']:.2f} "
        f"| **{ours['cpu_per_file'] / theirs['cpu_per_file']:.2f}** |"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2, help="new-process runs of figures 1, 2 and 4")
    parser.add_argument("--steady-batches", type=int, default=6)
    parser.add_argument("--backlog", type=int, default=10, help="batches in the catch-up backlog")
    parser.add_argument("--state-keys", type=int, default=20_000_000)
    parser.add_argument(
        "--state-batches",
        type=int,
        default=8,
        help="an even count: reading ahead, the batches alternate short and long",
    )
    parser.add_argument("--fleet", type=int, default=50)
    parser.add_argument("--fleet-interval", type=float, default=180)
    args = parser.parse_args()
    started = time.time()
    with scratch("headline") as work:
        waves = Waves(work / "waves")
        print("one batch, then nothing new, each in a new process...", flush=True)
        one, none, _ = one_batch_and_no_data(work, waves, args.repeat, flink=False)
        print("steady batches in one process...", flush=True)
        steady_figure, _ = steady(work, waves, 1, args.steady_batches, flink=False)
        print(f"a backlog of {args.backlog} batches...", flush=True)
        backlog = catch_up(work, waves, args.backlog, args.repeat)
        shutil.rmtree(work / "waves")
        print(f"users coming back to {args.state_keys:,} keys...", flush=True)
        state = state_at_scale(work, args.state_keys, args.state_batches)
        print(f"a fleet of {args.fleet}...", flush=True)
        fleet_row = fleet(work, args.fleet, args.fleet_interval)
    minutes = (time.time() - started) / 60
    samples = "; ".join(
        f"{f.name}: SS {', '.join(f'{v:.1f}' for v in f.samples['structured streaming'])} s, "
        f"project {', '.join(f'{v:.1f}' for v in f.samples['project'])} s"
        for f in (one, none, backlog)
    )
    fleets = "; ".join(
        f"{k}: p50 {v['p50']:.1f} s, {v['files']} files, {v['missing']} not committed by the end"
        for k, v in fleet_row.items()
        if k != "n"
    )
    write_section(
        "benchmarks.md",
        [
            "## Headline (make bench)",
            "",
            f"{measured_by('`make bench` (`bench/headline.py`)', minutes)}. Every anchor "
            "ran in the same run on the same files; lower ratios are better for the project. The full benchmarks "
            "(`make bench-full`) have each figure at more sizes, with more repeats, Flink, and how the time splits.",
            "",
            *table([one, none, steady_figure, backlog], state, fleet_row),
            "",
            f"* New-process figures are medians of {args.repeat} interleaved runs: {samples}.",
            f"* The steady figures are means of batches 2-{args.steady_batches} (one process each) and of batches 3-"
            f"{args.state_batches} at {args.state_keys:,} keys (both engines warm their JVM in the first two; Structured "
            f"Streaming's RocksDB state was seeded first, in {state['ss_seed_s']:.0f} s). The appended state's fold, off the "
            'batches\' path, is timed by `make bench-full` (docs/benchmarks.md, "State at scale").',
            f"* The fleet: {fleet_row['n']} pipelines, 90% of them getting a file of 200 clicks every {args.fleet_interval:.0f} s "
            f"for {args.fleet_interval:.0f} s; the project on a live Airflow (LocalExecutor, 4 task slots, `run_on_data` polling "
            f"every 10 s) with one shared Spark Connect server; the anchor N queries in one driver (`ProcessingTime` 10 s). {fleets}.",
            "",
        ],
    )


if __name__ == "__main__":
    main()
