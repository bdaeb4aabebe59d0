"""Event-time windows beside Structured Streaming (issue 66): a day of clicks, an hour a batch.

In one run, on the same files: `--hours` JSON files, one per hour of event
time, each of `--records` clicks over `--users` users, spread over its hour
in random order, plus 0.5% late clicks from two hours before. Each engine
takes one file a batch:

* Structured Streaming (`bench/anchors/structured_streaming.py --windowed`):
  `withWatermark("ts", "10 minutes")`, per user and `window(ts, "1 hour")`
  count and sum, append mode (each window's row once), RocksDB state, a
  `noop` sink (writing nothing favours it), `Trigger.AvailableNow` with
  `maxFilesPerTrigger` 1; each batch's `durationMs` and the state's rows
  (`numRowsTotal`).
* The project: the same aggregation with `event_time: {column: ts, delay: 10
  minutes, late: drop, window: 1 hour, final: ..., expire: {after: 1
  hour}}`, so that the state keeps about two hours; its final rows go to a
  Delta table; in one `run --catch-up` process, as `bench/run.py` times
  steady batches (a batch's seconds run from the previous outcome to its
  own). The state's rows after each batch (and its expiry) come from the
  Delta log.

`--dedup`: 1% of each hour's clicks come again (a producer's retry: the
same click, in the same file or the next hour's), and both engines drop
duplicate event ids first: Structured Streaming with
`dropDuplicatesWithinWatermark`, the project with `dedup: {key: [event_id],
within: 10 minutes}` (an id remembered as long as the watermark's delay, as
Spark keeps it); the final rows then count each click once.

Steady batch = the mean over batches 3..H. The final rows of both are
checked to be the same windows with the same counts (the anchor's are
counted from the project's files by the same rules, not read: its sink
writes nothing). Results: docs/benchmarks.md, "Event time: windows beside
Structured Streaming".

    .venv/bin/python bench/windows_vs_ss.py [--hours 24] [--records 100000] [--users 10000] [--dedup]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from harness import measured_by, scratch, ss_anchor, write_section, write_spec
from run import project_steady

DAY = datetime(2026, 11, 26, tzinfo=UTC)
LATE_SHARE = 0.005
#: `--dedup`: the share of each hour's clicks that come again.
RETRY_SHARE = 0.01


def click_files(folder: Path, hours: int, records: int, users: int, retries: bool = False) -> None:
    """One file per hour of event time: clicks spread over the hour, shuffled,
    and a few from two hours before; `retries`: 1% of them again, half in
    the same file, half at the head of the next hour's."""
    import numpy as np

    rng = np.random.default_rng(66)
    carried: list[str] = []
    for hour in range(hours):
        start = DAY + timedelta(hours=hour)
        seconds = rng.integers(0, 3600, records)
        late = rng.random(records) < LATE_SHARE if hour >= 2 else np.zeros(records, bool)
        seconds = np.where(late, seconds - 7200, seconds)
        drawn = rng.integers(0, users, records)
        lines = (
            f'{{"event_id":"e{hour}-{i}","user_id":"u{u:06d}","amount":1.5,"ts":"{(start + timedelta(seconds=int(s))).strftime("%Y-%m-%dT%H:%M:%SZ")}"}}'
            for i, (u, s) in enumerate(zip(drawn.tolist(), seconds.tolist()))
        )
        written = list(lines)
        if retries:
            again = [written[i] for i in rng.choice(len(written), int(len(written) * RETRY_SHARE), replace=False).tolist()]
            written = carried + written + again[: len(again) // 2]
            carried = again[len(again) // 2 :]
        (folder / f"clicks-{hour:04d}.json").write_text("\n".join(written) + "\n")


def project(folder: Path, hours: int, dedup: bool = False) -> tuple[list[dict[str, Any]], list[int], int, int]:
    """The project's batches (catch-up), its state's rows after each batch
    settled, its final rows, and the ids its dedup table holds at the end."""
    from deltalake import DeltaTable

    from spark_jobs.core.ledger import OffsetLedger
    from spark_jobs.core.spec import load_spec

    spec_path = write_spec(
        folder,
        "windows",
        transform="SELECT user_id, window(ts, '1 hour').start AS hour, count(*) AS clicks, sum(amount) AS amount FROM batch GROUP BY user_id, window(ts, '1 hour')",
        state={"path": "lake/state", "keys": ["user_id", "hour"], "merge": {"clicks": "sum", "amount": "sum"}},
        batch={"max_files": 1},
        event_time={
            "column": "ts",
            "delay": "10 minutes",
            "late": "drop",
            "window": {"key": "hour", "size": "1 hour"},
            "final": {"path": "lake/final"},
            "expire": {"after": "1 hour"},
        },
        **({"dedup": {"key": ["event_id"], "within": "10 minutes"}} if dedup else {}),
    )
    for path in sorted((folder.parent / "clicks").iterdir()):
        (folder / "landing" / path.name).hardlink_to(path)
    batches = project_steady(spec_path, hours)
    spec = load_spec(spec_path)
    commits = sorted(r.state_version for r in OffsetLedger(spec.ledger_path, spec.name).load().lineage())
    latest = DeltaTable(spec.state_path).version()

    def rows(version: int) -> int:
        import pyarrow as pa
        import pyarrow.compute as pc

        actions = pa.table(DeltaTable(spec.state_path, version=version).get_add_actions(flatten=True))
        return int(pc.sum(actions.column("num_records")).as_py() or 0) if actions.num_rows else 0

    # After batch N settled: the version before N+1's commit (its expiry is the last commit before it).
    settled = [rows((commits[i + 1] - 1) if i + 1 < len(commits) else latest) for i in range(len(commits))]
    final = DeltaTable(spec.final_path).to_pyarrow_table(columns=["clicks"])
    ids = DeltaTable(spec.dedup_path).to_pyarrow_table(columns=["id"]).num_rows if dedup else 0
    return batches, settled, final.num_rows, ids


def steady(values: list[float]) -> float:
    return statistics.mean(values[2:]) if len(values) > 2 else statistics.mean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=int, default=24)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--dedup", action="store_true", help="1%% of the clicks again; both engines drop duplicate ids first")
    args = parser.parse_args()
    started = time.monotonic()
    with scratch("windows") as base:
        (base / "clicks").mkdir()
        click_files(base / "clicks", args.hours, args.records, args.users, args.dedup)
        deduped = ("--dedup",) if args.dedup else ()
        _, anchor = ss_anchor("--landing", base / "clicks", "--checkpoint", base / "ss", "--max-files", 1, "--windowed", "1 hour", *deduped, timeout=3600)
        ss_seconds = [b["duration_ms"]["triggerExecution"] / 1000 for b in anchor["batches"]]
        ss_state = [sum(b["state_rows"]) for b in anchor["batches"]]
        batches, state, final_rows, ids = project(base / "project", args.hours, args.dedup)
    ours = [b["seconds"] for b in batches if b["status"] == "committed"]
    ss_steady, our_steady = steady(ss_seconds), steady(ours)
    title = "## Event time: windows and duplicates beside Structured Streaming" if args.dedup else "## Event time: windows beside Structured Streaming"
    lines = [
        title,
        "",
        measured_by("bench/windows_vs_ss.py", (time.monotonic() - started) / 60) + ".",
        f"{args.hours} files, one per hour of event time, of {args.records:,} clicks over {args.users:,} users each "
        f"(shuffled within the hour; {LATE_SHARE:.1%} from two hours before: late); one file a batch. Per user and "
        "hour, count and sum, behind a 10-minute watermark; late clicks dropped; each hour's row emitted once when "
        "the watermark passes its end. Structured Streaming: `withWatermark` + `window`, append mode, RocksDB, "
        "`noop` sink, `AvailableNow`. This project: `event_time` with `window`, `final` (a Delta table) and "
        "`expire: {after: 1 hour}`, `run --catch-up`. Steady batch: mean of batches 3 and on."
        + (
            f" Duplicates: {RETRY_SHARE:.0%} of each hour's clicks again (half in the same file, half in the next), dropped "
            "first: `dropDuplicatesWithinWatermark` beside `dedup: {key: [event_id], within: 10 minutes}`."
            if args.dedup
            else ""
        ),
        "",
        "| | steady batch (s) | state rows after the last batch | state rows, most over the day | final rows |",
        "|---|---|---|---|---|",
        f"| Structured Streaming | {ss_steady:.2f} | {ss_state[-1]:,} | {max(ss_state):,} | (noop sink) |",
        f"| this project | {our_steady:.2f} | {state[-1]:,} | {max(state):,} | {final_rows:,} |",
        "",
        f"Ratio (this project / Structured Streaming), steady batch: **{our_steady / ss_steady:.2f}x**.",
        "",
        "State rows after each batch (this project, after its expiry): " + ", ".join(f"{n:,}" for n in state) + ".",
        "Structured Streaming's: " + ", ".join(f"{n:,}" for n in ss_state) + ".",
    ]
    if args.dedup:
        lines += [
            "",
            f"This project's dedup table after the last batch: {ids:,} ids (Structured Streaming's state rows above "
            "include its deduplication's; the project's ids older than the watermark less `within` are read by no "
            "batch and deleted by `maintain`, which this run does not run).",
        ]
    write_section("benchmarks.md", lines)


if __name__ == "__main__":
    main()
