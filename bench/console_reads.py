"""What the console's reads cost as a ledger ages: the batch page read by
position (`inspect.recent`) against reading the whole history
(`inspect.history`, what `microbatch history` does), on the same ledger in
the same run; and the pipelines line (`inspect.status`).

Ledgers are fast-forwarded (`bench/long_life.py`) and compacted as runs
compact them. Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/console_reads.py --ages 1000,10000,100000
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.doc_sections import replace_section  # noqa: E402
from bench.long_life import fast_forward, spec_dict  # noqa: E402
from spark_jobs.core import inspect  # noqa: E402
from spark_jobs.core.ledger import OffsetLedger  # noqa: E402
from spark_jobs.core.spec import load_spec  # noqa: E402
from tests.conftest import write_spec  # noqa: E402

HEADING = "## Console reads with age"


def median_seconds(fn, repeat: int) -> float:
    fn()  # the first call in a process pays for imports and the table's first open
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(age: int, files: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec_path = write_spec(folder, spec_dict(), "clicks.yaml")
        fast_forward(folder, spec_path, age, files)
        spec = load_spec(spec_path)
        OffsetLedger(spec.ledger_path, spec.name).compact()  # as the runs would have
        page = inspect.recent(spec, 50)
        assert [r.batch_id for r in page][-1] == age and len(page) == 50
        return {
            "age": age,
            "recent": median_seconds(lambda: inspect.recent(spec, 50), repeat),
            "history": median_seconds(lambda: inspect.history(spec), repeat),
            "status": median_seconds(lambda: inspect.status(spec), repeat),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ages", default="1000,10000,100000")
    parser.add_argument("--files", type=int, default=2, help="files per batch in the fast-forwarded ledger")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = []
    for age in (int(a) for a in args.ages.split(",")):
        r = measure(age, args.files, args.repeat)
        results.append(r)
        print(f"{age:>8,} batches: page of 50 {r['recent']:.3f} s, whole history {r['history']:.3f} s "
              f"({r['history'] / r['recent']:.0f}x), status {r['status']:.3f} s", flush=True)
    lines = [
        HEADING,
        "",
        f"`bench/console_reads.py`, {date.today().isoformat()}, {platform.machine()} with 2 cores; medians of "
        f"{args.repeat} calls in a warm process. The console's batch page reads the newest 50 rows by position "
        "(`inspect.recent`); the anchor, measured on the same ledger in the same run, reads the whole history "
        "(`inspect.history`, as `microbatch history` does). The pipelines line is `inspect.status`.",
        "",
        "| batches in the ledger | page of 50 | whole history (anchor) | anchor / page | pipelines line (status) |",
        "|---|---|---|---|---|",
        *(f"| {r['age']:,} | {r['recent']:.3f} s | {r['history']:.3f} s | {r['history'] / r['recent']:.0f}x | {r['status']:.3f} s |"
          for r in results),
        "",
    ]
    if not args.no_write:
        replace_section(ROOT / "docs" / "benchmarks.md", HEADING, lines)


if __name__ == "__main__":
    main()
