"""Two versions of the project, interleaved on the same files: is a change slower?

For a change that must not cost speed (a reshape, a refactor), run `make
bench`'s two project figures for the code before and after it, in turn, on
the same generated files and in the same virtualenv:

* one 100k batch in a new process (`microbatch run`, as an Airflow task
  runs it), wall seconds;
* the steady pace of batches 2..N in one process (`--catch-up`'s way, the
  version's own `bench/run.py --child-steady`), seconds per batch.

Each version is the tree of a git revision (`git archive`), run with
``PYTHONPATH`` pointing at it. Rounds alternate which version goes first.
Prints medians, the ratio after/before and each round's pair, and writes
the section "Versions compared" of docs/benchmarks.md.

    .venv/bin/python bench/versions.py --before f54f149 [--after HEAD] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402
from run import DOC, Waves, project_pipeline, steady_pace, timed  # noqa: E402

HEADING = "## Versions compared"


def checkout(rev: str, into: Path) -> Path:
    """The tree of `rev`, unpacked into `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def one_batch(tree: Path, spec: Path) -> float:
    """`microbatch run` of the version in `tree`, in a new process: wall seconds.
    (`-m` puts the working folder on the path before PYTHONPATH: the tree
    must be that folder. Output to a file, as `run.timed` says why.)"""
    with tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "spark_jobs", "-q", "run", str(spec), "--json"], cwd=tree,
                              env={**os.environ, "PYTHONPATH": str(tree)}, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
        took = time.perf_counter() - started
        out.seek(0)
        text = out.read()
    assert code == 0 and '"committed"' in text, text[-3000:]
    return took


def steady(tree: Path, spec: Path, batches: int) -> float:
    _, stdout = timed(
        [sys.executable, str(tree / "bench" / "run.py"), "--child-steady", str(spec), "--batches", str(batches)],
        env={"PYTHONPATH": str(tree)},
        timeout=1800,
    )
    return steady_pace(json.loads(stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the revision before the change")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=6, help="batches of the steady run (the pace is of 2..N)")
    parser.add_argument("--only", choices=["one", "steady"], help="measure one figure only (and write no docs)")
    args = parser.parse_args()
    revs = {name: subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
            for name, rev in (("before", args.before), ("after", args.after))}
    with tempfile.TemporaryDirectory(prefix="microbatch-versions-") as tmp:
        work = Path(tmp)
        trees = {name: checkout(rev, work / f"tree-{name}") for name, rev in revs.items()}
        waves = Waves(work / "waves")
        figures: dict[str, dict[str, list[float]]] = {}
        if args.only != "steady":
            figures["one batch, new process"] = {}
        if args.only != "one":
            figures["steady, one process"] = {}
        for round_ in range(args.rounds):
            order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
            for name in order:
                folder = work / f"r{round_}-{name}"
                if "one batch, new process" in figures:
                    figures["one batch, new process"].setdefault(name, []).append(
                        one_batch(trees[name], project_pipeline(folder / "one", waves, range(1))))
                if "steady, one process" in figures:
                    figures["steady, one process"].setdefault(name, []).append(
                        steady(trees[name], project_pipeline(folder / "steady", waves, range(args.batches)), args.batches))
            print(f"round {round_ + 1}: " + "; ".join(
                f"{figure}: before {samples['before'][-1]:.3f} s, after {samples['after'][-1]:.3f} s" for figure, samples in figures.items()),
                flush=True)
    lines = [HEADING, "",
             f"`bench/versions.py --before {revs['before']} --after {revs['after']}` "
             f"({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {args.rounds} rounds, order alternating; "
             f"{os.cpu_count()} cores). Medians; the ratio is after / before.", "",
             "| figure | before | after | after / before | faster after, rounds |", "|---|---|---|---|---|"]
    for figure, samples in figures.items():
        before, after = statistics.median(samples["before"]), statistics.median(samples["after"])
        wins = sum(a < b for a, b in zip(samples["after"], samples["before"]))
        lines.append(f"| {figure} | {before:.3f} s | {after:.3f} s | {after / before:.3f} | {wins} of {len(samples['after'])} |")
    lines += ["", "Samples (before; after): " + "; ".join(
        f"{figure}: " + ", ".join(f"{b:.3f}" for b in samples["before"]) + "; " + ", ".join(f"{a:.3f}" for a in samples["after"])
        for figure, samples in figures.items()), ""]
    print("\n".join(lines))
    if args.only is None:
        replace_section(DOC, HEADING, lines)


if __name__ == "__main__":
    main()
