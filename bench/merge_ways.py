"""A small batch into a big merged state, merged three ways (issue 47): where the state's rows go, and what it costs.

A merged state's batch of up to `staged.IN_PROCESS_ROWS` rows is merged by
delta-rs's MERGE in the job's process while the state's files it rewrites
weigh at most `staged.REWRITE_FROM_BYTES`; above that, by the executors,
each file where it stands (`FileWriting.rewrite_files`). This measures the
ways side by side on the same state and the same batches, for each state
size, in one run:

* `driver` (`engine.state_write: driver`): delta-rs's MERGE here, whatever
  the state's size (what `auto` did for every small batch before);
* `auto` (the default): the batch comes back here (its input is under 32
  MB), and above `REWRITE_FROM_BYTES` of state it is staged as a file and
  the executors rewrite the state's files with it;
* `executors`: the executors write the batch's files too.

The state is `bench/state_vs_ss.py`'s (N users, one row each, files of
64 MB, as a fold leaves it); `--batches` files of 100,000 clicks land,
users drawn from all N (users coming back: every file is rewritten), and
each way runs them in one `run --catch-up` process (`bench/run.py
--child-steady`), its own copy of the state. Measured: the steady batch
(the mean of batches 3 on) and the peak RSS of that process (the job's,
its driver JVM apart). The ways run in turn, `--rounds` times.

Results: docs/state-at-scale.md, "A small batch into a big merged state".

    .venv/bin/python bench/merge_ways.py [--sizes 1000000,10000000,30000000] [--batches 6] [--rounds 1]
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
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from big_batch import run  # noqa: E402
from doc_sections import replace_section  # noqa: E402
from state_vs_ss import BATCH_RECORDS, click_files, seed_state, seeded_project, steady  # noqa: E402

from spark_jobs.core.staged import REWRITE_FROM_BYTES  # noqa: E402

DOC = ROOT / "docs" / "state-at-scale.md"
SECTION = "## A small batch into a big merged state"
WAYS = ("driver", "auto", "executors")


def measure(work: Path, size: int, batches: int, rounds: int) -> dict[str, Any]:
    base = work / f"n{size}"
    clicks = click_files(base / "clicks", size, batches)
    seed_state(str(base / "seed-state"), size)
    figures: dict[str, Any] = {"keys": size, "state_mb": sum(p.stat().st_size for p in (base / "seed-state").rglob("*.parquet")) / 1e6}
    for round_ in range(rounds):
        for way in WAYS:
            folder = base / way
            spec_path = seeded_project(base, folder, "merged", clicks, {"state_write": way})
            done = run([sys.executable, str(ROOT / "bench/run.py"), "--child-steady", str(spec_path), "--batches", str(batches)])
            runs = json.loads(done["stdout"].strip().splitlines()[-1])
            assert [r["records"] for r in runs] == [BATCH_RECORDS] * batches, runs
            seconds = [r["seconds"] for r in runs]
            figures.setdefault(way, []).append({"steady_s": steady(seconds), "batches_s": seconds, "rss_mb": done["rss_mb"]})
            print(f"  {size:,} keys ({figures['state_mb']:.0f} MB), {way}, round {round_ + 1}: steady {steady(seconds):.2f} s, "
                  f"job's process {done['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
            shutil.rmtree(folder)
    print(json.dumps(figures), flush=True)
    shutil.rmtree(base)
    return figures


def write_doc(rows: list[dict[str, Any]], batches: int, rounds: int) -> None:
    def cell(row: dict[str, Any], way: str) -> str:
        runs = row[way]
        return f"{statistics.mean(r['steady_s'] for r in runs):.2f} s, {max(r['rss_mb'] for r in runs):.0f} MB"

    lines = [
        SECTION,
        "",
        f"`bench/merge_ways.py`, {date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores, one run "
        f"({rounds} round{'s' if rounds > 1 else ''} of the three ways in turn): a merged state of N users (files of "
        f"64 MB, as a fold leaves them), then {batches} batches of 100,000 clicks of users drawn from all N (every file "
        "rewritten), in one `run --catch-up` process a way, `local[*]`. Each cell: the steady batch (the mean of "
        "batches 3 on) and the peak RSS of the job's own Python process (its driver JVM apart). `auto` rewrites the "
        f"state's files on the executors above {REWRITE_FROM_BYTES // 2**20} MB of them (`staged.REWRITE_FROM_BYTES`).",
        "",
        "| keys | state's files | `driver`: delta-rs's MERGE here | `auto` | `executors` | auto / driver |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = statistics.mean(r["steady_s"] for r in row["auto"]) / statistics.mean(r["steady_s"] for r in row["driver"])
        lines.append(f"| {row['keys']:,} | {row['state_mb']:.0f} MB | {cell(row, 'driver')} | {cell(row, 'auto')} | "
                     f"{cell(row, 'executors')} | {ratio:.2f} |")
    lines.append("")
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000,30000000")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="microbatch-merge-ways-"))
    try:
        rows = [measure(work, int(n), args.batches, args.rounds) for n in args.sizes.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_doc(rows, args.batches, args.rounds)


if __name__ == "__main__":
    main()
