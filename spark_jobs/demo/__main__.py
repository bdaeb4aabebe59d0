"""`make demo`: the whole story on embedded defaults, in about two minutes.

Local Spark, local folders, no servers. It copies the example spec
(`dags/pipelines/clicks_per_user.yaml`) into a scratch folder, lands click
events in waves, and drives the real `microbatch` CLI as a user would:
three batches, the ledger and the top users, a run killed with SIGKILL right
after its state commit and the re-run that lands exact totals, then a rewind
and its exact replay. Last, event time: the windowed example
(`dags/pipelines/hourly_clicks_per_user.yaml`) over the same clicks, its
watermark, the final rows of the hours it closed, and a file of late
clicks that goes to the quarantine.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from spark_jobs.demo.clickstream import differences, fold, state_totals, write_wave
from spark_jobs.core.faults import ENV as FAULT_ENV
from spark_jobs.core.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "dags" / "pipelines" / "clicks_per_user.yaml"
WINDOWED = ROOT / "dags" / "pipelines" / "hourly_clicks_per_user.yaml"


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def cli(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    import os

    print(f"$ microbatch {' '.join(args)}", flush=True)
    result = subprocess.run(
        [sys.executable, "-m", "spark_jobs", "-q", *args],
        text=True,
        capture_output=True,
        env={**os.environ, **(env or {})},
    )
    sys.stdout.write(result.stdout)
    for line in result.stderr.splitlines():
        if "MICROBATCH-FAULT" in line or line.startswith("error"):
            print(f"  (stderr) {line}")
    if check and result.returncode != 0:
        sys.exit(f"demo: `microbatch {' '.join(args)}` failed:\n{result.stderr[-3000:]}")
    return result


def check_exact(spec_file: Path) -> None:
    """Compare the state with the oracle folded from the consumed files."""
    from spark_jobs.core.ledger import OffsetLedger

    spec = load_spec(spec_file)
    lineage = OffsetLedger(spec.ledger_path, spec.name).load().lineage()
    files = [Path(spec.source_path) / f["name"] for r in lineage for f in r.manifest["files"]]
    expected = fold(files)
    problems = differences(expected, state_totals(spec), check_hash=False)
    if problems:
        sys.exit("demo: state differs from the oracle:\n" + "\n".join(problems[:10]))
    events = sum(t.events for t in expected.values())
    print(f"exact: {len(expected)} users, {events} events, amounts match the input to the cent")


def check_late(spec_file: Path, late_file: Path, expected: int) -> None:
    """The late file's clicks are in the quarantine, as late, and the state
    counts every valid click of the other files, once."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    spec = load_spec(spec_file)
    reasons = DeltaTable(spec.quarantine_path).to_pyarrow_table(columns=["reason"]).column("reason")
    late = pc.sum(pc.starts_with(reasons, "late: ")).as_py() or 0
    others = sorted(p for p in Path(spec.source_path).iterdir() if p != late_file)
    clicks = sum(t.events for t in fold(others).values())
    counted = pc.sum(DeltaTable(spec.state_path).to_pyarrow_table(columns=["clicks"]).column("clicks")).as_py()
    if (late, counted) != (expected, clicks):
        sys.exit(f"demo: {late} late clicks in the quarantine and {counted} clicks in the state; expected {expected} and {clicks}")
    print(f"exact: {clicks} clicks counted by hour, the {late} late ones in the quarantine, as late")


def check_final(spec_file: Path) -> None:
    """The final table holds each closed hour's rows once, as the state holds
    them, and no hour the watermark has not passed."""
    from datetime import timedelta

    from deltalake import DeltaTable

    from spark_jobs.core.ledger import OffsetLedger

    spec = load_spec(spec_file)
    watermark = OffsetLedger(spec.ledger_path, spec.name).load().head.watermark
    final = DeltaTable(spec.final_path).to_pyarrow_table().to_pylist()
    state = DeltaTable(spec.state_path).to_pyarrow_table().to_pylist()
    closed = {(r["user_id"], r["hour"]): (r["clicks"], r["amount"]) for r in state if r["hour"] + timedelta(hours=1) <= watermark}
    appended = {(r["user_id"], r["hour"]): (r["clicks"], r["amount"]) for r in final}
    if len(appended) != len(final) or appended != closed:
        sys.exit(f"demo: the final table has {len(final)} rows ({len(appended)} windows); the state's closed hours have {len(closed)}")
    hours = sorted({h.strftime("%H:%M") for _, h in closed})
    open_hours = sorted({r["hour"].strftime("%H:%M") for r in state} - set(hours))
    print(f"final: {len(final)} rows, once each, for the hours {', '.join(hours)} (watermark {watermark:%H:%M}); still open: {', '.join(open_hours)}")


def top_users(spec_file: Path, n: int = 5) -> None:
    from rich.console import Console
    from rich.table import Table

    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    # What a user does to query the state with SQL (delta-rs's engine).
    spec = load_spec(spec_file)
    sql = f"SELECT user_id, events, round(amount, 2) AS amount, last_seen, _batch_id FROM state ORDER BY events DESC, user_id LIMIT {n}"
    rows = pa.table(QueryBuilder().register("state", DeltaTable(spec.state_path)).execute(sql).read_all()).to_pylist()
    table = Table(title=f"top {n} users in {spec.state.path}", title_justify="left")
    for column in ("user_id", "events", "amount", "last_seen", "_batch_id"):
        table.add_column(column)
    for row in rows:
        table.add_row(*[str(row[c]) for c in ("user_id", "events", "amount", "last_seen", "_batch_id")])
    Console(width=120).print(table)


def event_time(work: Path, landing: str) -> None:
    """Act 5: the windowed example over the clicks landed so far, then a file of late clicks."""
    banner("5. Event time: clicks per user per hour, a watermark, final hours, a late file")
    windowed = work / WINDOWED.name
    shutil.copy(WINDOWED, windowed)
    cli("run", str(windowed))
    cli("status", str(windowed))
    check_final(windowed)
    late = write_wave(landing, 1, files=1, records_per_file=200, users=2000, seed=99)
    print(f"landed {late[0].name}: 200 clicks of hour 1, older than the watermark: late")
    cli("run", str(windowed))
    check_late(windowed, late[0], expected=200)
    check_final(windowed)  # hour 1 was final, and stays as it was


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=str(ROOT / ".demo"), help="scratch folder (recreated)")
    parser.add_argument("--records", type=int, default=5000, help="records per file")
    args = parser.parse_args()

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec_file = work / EXAMPLE.name
    shutil.copy(EXAMPLE, spec_file)
    landing = load_spec(spec_file).source_path

    def land(wave: int) -> None:
        paths = write_wave(landing, wave, files=3, records_per_file=args.records, users=2000, bad_every=500)
        print(f"landed wave {wave}: {len(paths)} files x {args.records} records (1 in 500 malformed) in {landing}")

    banner("1. Three waves of clicks, three micro-batches")
    for wave in range(3):
        land(wave)
        cli("run", str(spec_file))
    cli("run", str(spec_file))  # nothing new: no Spark session, well under a second

    banner("2. The offset ledger and the state")
    cli("history", str(spec_file))
    top_users(spec_file)
    check_exact(spec_file)

    banner("3. SIGKILL right after the state commit, before the ledger row")
    land(3)
    crashed = cli("run", str(spec_file), env={FAULT_ENV: "after_state_commit"}, check=False)
    print(f"the run died with exit code {crashed.returncode} (SIGKILL)")
    cli("status", str(spec_file))
    print("re-running: step 1 of the protocol records the committed batch; nothing is re-counted")
    cli("run", str(spec_file))
    cli("history", str(spec_file), "--limit", "3")
    check_exact(spec_file)

    banner("4. Rewind to batch 1 and replay")
    cli("rewind", str(spec_file), "--to-batch", "1")
    check_exact(spec_file)
    cli("run", str(spec_file))
    cli("history", str(spec_file), "--limit", "4")
    top_users(spec_file)
    check_exact(spec_file)

    event_time(work, landing)
    print(f"\ndemo done. Explore: .venv/bin/microbatch status {spec_file}")


if __name__ == "__main__":
    main()
