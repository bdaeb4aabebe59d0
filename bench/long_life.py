"""What a run costs as a pipeline ages: this code against the code before it.

A pipeline of age A has committed A batches of F files each (1 record a
file, `after_commit: delete`, so the source folder holds only new files and
the figures are the ledger's, not a listing's). For each age the script
measures, for this code and for the anchor (the same pipeline folder, copied,
run by the code of git revision `--anchor`, which read the whole ledger and
every manifest each run):

* a run with no new data: the real CLI in a new process, wall and peak RSS;
* a committing run of one batch (F new files), in a new process: its wall
  time and the part of it spent on the ledger and the consumed index (every
  call into them timed; libraries imported before the clock starts, as
  their one-time cost does not depend on age);
* a trigger poll (`inspect.lag`, in a warm process, as Airflow's triggerer
  runs it);
* the checkpoint's disk use, before and after `microbatch maintain`.

Ages up to `--organic` are grown through the real protocol, batch by batch
(`run_batch` with the pure-Arrow compute of the tests: Delta speed, no JVM).
Older ages are fast-forwarded: the ledger rows, the state commit and the
fences a run writes are bulk-written with the protocol's own classes, then
the consumed index is built from the ledger by the code's own migration
(timed) and `maintain` runs, as the maintenance DAG would have. The organic
and fast-forwarded points at the same age cross-check each other.

Results go to docs/benchmarks.md (section "Cost against age"), with a plot,
docs/long_life.svg.

    .venv/bin/python bench/long_life.py [--ages 100,1000,10000,100000] [--files 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from doc_sections import replace_section  # noqa: E402
from spark_jobs.core.commits import CommitKind, CommitMetadata  # noqa: E402
from spark_jobs.core.fencing import COMMIT_FENCE, PLAN_FENCE, Position, commit_properties  # noqa: E402
from spark_jobs.core.identity import SpecIdentity, new_pipeline_id  # noqa: E402
from spark_jobs.core.ledger import SCHEMA, LedgerRow, RowStatus, _to_arrow, scoped  # noqa: E402
from spark_jobs.core.spec import load_spec  # noqa: E402
from spark_jobs.core.state import StateTable  # noqa: E402
from spark_jobs.core.delta_io import ensure_table  # noqa: E402
from tests.conftest import oracle_spec_dict, write_spec  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "long_life.svg"
SECTION = "## Cost against age"

#: Runs in a new process: one batch (or none) of the pipeline, with every
#: ledger and consumed-index call timed. Prints JSON.
PROBE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
t0 = time.perf_counter()
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.core import ledger as ledger_mod
from tests.spark_jobs.arrow_compute import ArrowCompute
spent = [0.0]
depth = [0]
def timed(cls, name):
    original = getattr(cls, name)
    def wrapper(*args, **kwargs):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                spent[0] += time.perf_counter() - start
    setattr(cls, name, wrapper)
for name in ("load", "append", "compact", "read", "at", "committed_between"):
    if hasattr(ledger_mod.OffsetLedger, name):
        timed(ledger_mod.OffsetLedger, name)
for name in ("lineage", "committed_row"):
    timed(ledger_mod.LedgerView, name)
try:
    from spark_jobs.core import lineage as lineage_mod
    for name in ("consumed", "record"):
        timed(lineage_mod.LedgerLineage, name)
except ImportError:
    pass
spec = load_spec(sys.argv[3])
# Libraries load once a process, whatever the age (pyarrow imports pandas on
# its first conversion to Python): loaded before the clock starts, for both codes.
import pandas, pyarrow.parquet, deltalake  # noqa: E401,F401
start = time.perf_counter()
outcome = run_batch(spec, RunOptions(run_id="bench"), compute_factory=ArrowCompute)
wall = time.perf_counter() - start
print(json.dumps({"status": str(outcome.status), "wall": wall, "ledger": spent[0]}))
"""

#: A warm process polling the lag, as the triggerer does.
POLL = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from spark_jobs.core.inspect import lag
from spark_jobs.core.spec import load_spec
spec = load_spec(sys.argv[2])
lag(spec)
times = []
for _ in range(5):
    start = time.perf_counter()
    lag(spec)
    times.append(time.perf_counter() - start)
print(json.dumps({"poll": sorted(times)[2]}))
"""


def spec_dict() -> dict:
    spec = oracle_spec_dict()
    spec["source"]["after_commit"] = "delete"
    return spec


def land(folder: Path, batch: int, files: int) -> None:
    landing = folder / "landing"
    for i in range(files):
        record = {"event_id": f"e{batch}-{i}", "user_id": f"u{(batch * files + i) % 5000}", "amount": 1.0,
                  "ts": "2026-11-23T10:00:00Z"}
        path = landing / f"b{batch:07d}-{i:02d}.json"
        path.write_text(json.dumps(record) + "\n")


def grow_organically(folder: Path, spec_path: Path, ages: list[int], files: int) -> dict[int, Path]:
    """Run real batches; copy the pipeline folder at each age in `ages`."""
    from spark_jobs.core.protocol import RunOptions, run_batch
    from tests.spark_jobs.arrow_compute import ArrowCompute

    spec = load_spec(spec_path)
    copies: dict[int, Path] = {}
    started = time.perf_counter()
    for batch in range(1, max(ages) + 1):
        land(folder, batch, files)
        outcome = run_batch(spec, RunOptions(run_id=f"grow-{batch}"), compute_factory=ArrowCompute)
        assert str(outcome.status) == "committed", outcome.message
        if batch in ages:
            copies[batch] = snapshot(folder, f"organic-{batch}")
            print(f"  grown to {batch} batches organically ({time.perf_counter() - started:.0f} s)", flush=True)
    return copies


def fast_forward(folder: Path, spec_path: Path, age: int, files: int) -> None:
    """Write what `age` committed batches leave in the ledger and the state, in bulk."""
    spec = load_spec(spec_path)
    identity = SpecIdentity.of(spec)
    pipeline_id = new_pipeline_id()
    state = StateTable(spec)
    updates = pa.table({"user_id": [f"u{i}" for i in range(5000)], "events": pa.array([1] * 5000, pa.int64()),
                        "amount": [1.0] * 5000, "idhash": pa.array([1] * 5000, pa.int64()),
                        "last_seen": pa.array([datetime(2026, 11, 23, tzinfo=timezone.utc)] * 5000, pa.timestamp("us", tz="UTC"))})
    table = state.create(updates)
    head = Position(0, age)
    base_ms = int(time.time() * 1000) - age * 60_000
    rows: list[LedgerRow] = []
    ledger = ensure_table(spec.ledger_path, SCHEMA, name=f"{spec.name} offset ledger")

    def flush(final: bool) -> None:
        props = None
        if final:
            props = commit_properties(scoped(PLAN_FENCE, spec.name), head, {"microbatch.event": "bench"})
            props.app_transactions.append(commit_properties(scoped(COMMIT_FENCE, spec.name), head, {}).app_transactions[0])
        write_deltalake(ledger, _to_arrow(rows), mode="append", commit_properties=props)
        rows.clear()

    manifest_of = lambda b: {"files": [  # noqa: E731
        {"name": f"old/b{b:07d}-{i:02d}.json", "uri": f"file://{folder}/landing/old/b{b:07d}-{i:02d}.json",
         "size": 180, "mtime_ms": base_ms + b * 60_000} for i in range(files)]}
    for b in range(1, age + 1):
        common = dict(pipeline=spec.name, epoch=0, batch_id=b, start_offsets={"files": (b - 1) * files},
                      end_offsets={"files": b * files}, manifest=manifest_of(b), pipeline_id=pipeline_id,
                      spec=identity.to_dict(), spec_fingerprint=identity.fingerprint, run_id=f"ff-{b}", attempt=1,
                      planned_at=datetime.fromtimestamp((base_ms + b * 60_000) / 1000, tz=timezone.utc))
        rows.append(LedgerRow(status=RowStatus.PLANNED, **common))
        if b < age:
            rows.append(LedgerRow(status=RowStatus.COMMITTED, state_version=0, keys_updated=files, records_in=files,
                                  records_quarantined=0, committed_at=common["planned_at"], duration_ms=100, **common))
        if len(rows) >= 2_000:
            flush(False)
    # The last batch is committed as a run commits it: state first (the commit point), then its row.
    metadata = CommitMetadata(kind=CommitKind.BATCH, start_offsets={"files": (age - 1) * files}, end_offsets={"files": age * files},
                              manifest=manifest_of(age), position=head, pipeline=spec.name, pipeline_id=pipeline_id,
                              spec=identity.to_dict(), spec_fingerprint=identity.fingerprint, run_id=f"ff-{age}", attempt=1,
                              records_in=files, records_quarantined=0, duration_ms=100, commit_token="bench")
    state.commit_batch(table, updates.slice(0, files), metadata)
    commit = state.find_commit(state.open(), head)
    rows.append(LedgerRow.from_commit(commit))
    flush(True)


@contextlib.contextmanager
def placed(folder: Path, canonical: Path):
    """`folder`'s pipeline at `canonical`: a spec's identity holds its absolute
    locations, so every copy of a pipeline is measured at the one path it grew at."""
    folder.rename(canonical)
    try:
        yield canonical
    finally:
        canonical.rename(folder)


def snapshot(folder: Path, name: str) -> Path:
    target = folder.parent / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(folder, target, symlinks=True)
    return target


def du_mb(path: Path) -> float:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return total / 1e6


def probe(code: Path, folder: Path) -> dict:
    spec = folder / "pipeline.yaml"
    result = subprocess.run([sys.executable, "-c", PROBE, str(code), str(ROOT), str(spec)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def noop_cli(code: Path, folder: Path) -> tuple[float, float]:
    """A no-op run through the real CLI in a new process: (wall seconds, peak RSS MB).

    The peak RSS comes from GNU time, which forks the run from its own small
    process: Linux carries a forking parent's peak into the child's, so the
    figure from a fork of this (large) process would be this process's.
    """
    env = {**os.environ, "PYTHONPATH": str(code)}
    start = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "spark_jobs", "-q", "run", str(folder / "pipeline.yaml")],
                            env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return wall, int(result.stderr.strip().splitlines()[-1]) / 1024


def poll(code: Path, folder: Path) -> float:
    result = subprocess.run([sys.executable, "-c", POLL, str(code), str(folder / "pipeline.yaml")], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])["poll"]


def measure(code: Path, folder: Path, files: int, repeat: int) -> dict:
    """The figures of one code revision on one aged pipeline (which it advances by `repeat` batches)."""
    noop = [noop_cli(code, folder) for _ in range(repeat)]
    commits = []
    age = None
    for _ in range(repeat):
        spec = load_spec(folder / "pipeline.yaml")
        from spark_jobs.core.ledger import OffsetLedger

        age = age or OffsetLedger(spec.ledger_path, spec.name).load().position.batch_id
        age += 1
        land(folder, 10_000_000 + age, files)
        commits.append(probe(code, folder))
        assert commits[-1]["status"] == "committed", commits[-1]
    return {
        "noop_s": statistics.median(w for w, _ in noop),
        "noop_rss_mb": statistics.median(r for _, r in noop),
        "commit_s": statistics.median(c["wall"] for c in commits),
        "ledger_s": statistics.median(c["ledger"] for c in commits),
        "poll_s": poll(code, folder),
    }


def measure_age(folder: Path, age: int, how: str, args: argparse.Namespace) -> dict:
    """This code's figures on one aged pipeline, after building its consumed
    index (the migration of a pipeline older than it) and a maintenance."""
    from spark_jobs.core.maintain import maintain
    from spark_jobs.core.pipeline import Pipeline
    from spark_jobs.core.protocol import reconcile

    spec = load_spec(folder / "pipeline.yaml")
    checkpoint = Path(spec.checkpoint_path)
    row: dict = {"age": age, "how": how, "disk_before_mb": du_mb(checkpoint)}
    p = Pipeline(spec)
    start = time.perf_counter()
    p.lineage(reconcile(p)).record()
    row["index_build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    maintain(spec)
    row["maintain_s"] = time.perf_counter() - start
    row["disk_after_mb"] = du_mb(checkpoint)
    row["new"] = measure(ROOT, folder, args.files, args.repeat)
    return row


def anchor_tree(revision: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix="microbatch-anchor-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(target), revision], check=True,
                   capture_output=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ages", default="100,1000,10000,100000")
    parser.add_argument("--organic", type=int, default=1000, help="grow ages up to this through the real protocol")
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--anchor", default="d0080ea", help="git revision of the code to compare with")
    parser.add_argument("--anchor-max-age", type=int, default=100_000)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    ages = [int(a) for a in args.ages.split(",")]
    work = Path(tempfile.mkdtemp(prefix="microbatch-age-"))
    canonical = work / "pipeline"
    anchor = anchor_tree(args.anchor)
    results: list[dict] = []
    try:
        organic_ages = [a for a in ages if a <= args.organic]
        folders: list[tuple[int, str, Path]] = []
        if organic_ages:
            spec_path = write_spec(canonical, spec_dict())
            folders += [(a, "organic", p) for a, p in grow_organically(canonical, spec_path, organic_ages, args.files).items()]
            shutil.rmtree(canonical)
        for age in (a for a in ages if a not in organic_ages):
            spec_path = write_spec(canonical, spec_dict())
            start = time.perf_counter()
            fast_forward(canonical, spec_path, age, args.files)
            print(f"  fast-forwarded to {age} batches in {time.perf_counter() - start:.0f} s", flush=True)
            folders.append((age, "fast-forwarded", work / f"ff-{age}"))
            canonical.rename(folders[-1][2])
        for age, how, stored in sorted(folders):
            old = snapshot(stored, f"{stored.name}-anchor")
            with placed(stored, canonical) as folder:
                row = measure_age(folder, age, how, args)
            if age <= args.anchor_max_age:
                with placed(old, canonical) as folder:
                    row["anchor"] = measure(anchor, folder, args.files, 1 if age >= 10_000 else args.repeat)
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(stored, ignore_errors=True)
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(anchor)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    if not args.no_write:
        write_doc(results, args)


def write_doc(results: list[dict], args: argparse.Namespace) -> None:
    lines = [
        SECTION,
        "",
        f"Measured by `bench/long_life.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}. Anchor: the code of `{args.anchor}` (before the ledger "
        "was read by position and the consumed index existed), run in the same session on a copy of the same "
        f"pipeline folder. A pipeline of age A has committed A batches of {args.files} files (1 record each, "
        "`after_commit: delete`). Ages up to "
        f"{args.organic:,} were grown batch by batch through the protocol; older ones fast-forwarded (see the "
        "script's docstring), then `maintain` ran. Medians of "
        f"{args.repeat} (the anchor's committing run at 10,000 batches and more: one).",
        "",
        "| age (batches) | grown | no-op run | no-op RSS | committing run | of which ledger + index | trigger poll | checkpoint disk before / after maintain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n, a = r["new"], r.get("anchor")

        def pair(key: str, unit: str, scale: float = 1.0, digits: int = 2) -> str:
            mine = f"{n[key] * scale:.{digits}f} {unit}"
            if not a:
                return mine
            ratio = a[key] / n[key]
            return f"{mine} (anchor {a[key] * scale:.{digits}f}, {ratio:.{1 if ratio < 10 else 0}f}x)"

        lines.append(
            f"| {r['age']:,} | {r['how']} | {pair('noop_s', 's')} | {pair('noop_rss_mb', 'MB', digits=0)} | "
            f"{pair('commit_s', 's')} | {pair('ledger_s', 's', digits=3)} | {pair('poll_s', 's', digits=3)} | "
            f"{r['disk_before_mb']:.1f} / {r['disk_after_mb']:.1f} MB |"
        )
    lines += [
        "",
        "Ratios are the anchor's figure over this code's. \"Checkpoint disk after maintain\" still holds the "
        "files that maintenance's own compaction replaced (the next maintenance removes them: dead files never "
        "exceed one compaction's worth); before it, the files of every batch since the last one. The no-op run "
        "is mostly starting Python and importing pyarrow, pandas (which pyarrow imports on its first conversion), "
        "deltalake and pydantic: about 0.9 s here at any age.",
        "",
        "Building the consumed index of a pipeline older than it (once, by `maintain` or the first committing run) "
        "and `maintain` itself, per age: "
        + "; ".join(f"{r['age']:,}: {r['index_build_s']:.1f} s and {r['maintain_s']:.1f} s" for r in results)
        + ".",
        "",
        "![cost of a run against the pipeline's age](long_life.svg)",
        "",
    ]
    replace_section(DOC, SECTION, lines)
    PLOT.write_text(svg_plot(results))
    print(f"wrote {DOC} and {PLOT}")


def svg_plot(results: list[dict]) -> str:
    """Seconds against age, both axes logarithmic: this code and the anchor."""
    import math

    width, height, margin = 640, 360, 60
    ages = [r["age"] for r in results]
    series = {
        "no-op run": ("noop_s", "#1f77b4"),
        "ledger work of a committing run": ("ledger_s", "#2ca02c"),
        "trigger poll": ("poll_s", "#d62728"),
    }
    values = [r[side][key] for r in results for side in ("new", "anchor") if side in r for key, _ in series.values()]
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    xlo, xhi = math.floor(math.log10(min(ages))), math.ceil(math.log10(max(ages)))

    def x(age: float) -> float:
        return margin + (math.log10(age) - xlo) / max(xhi - xlo, 1) * (width - 2 * margin)

    def y(v: float) -> float:
        return height - margin - (math.log10(v) - lo) / max(hi - lo, 1) * (height - 2 * margin)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for e in range(lo, hi + 1):
        out.append(f'<line x1="{margin}" x2="{width - margin}" y1="{y(10**e):.1f}" y2="{y(10**e):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{margin - 6}" y="{y(10**e) + 4:.1f}" text-anchor="end">{10**e:g} s</text>')
    for e in range(xlo, xhi + 1):
        out.append(f'<text x="{x(10**e):.1f}" y="{height - margin + 16}" text-anchor="middle">{10**e:,}</text>')
    out.append(f'<text x="{width / 2}" y="{height - 18}" text-anchor="middle">committed batches (log)</text>')
    legend = 0
    for label, (key, colour) in series.items():
        for side, dash in (("new", ""), ("anchor", ' stroke-dasharray="5,4"')):
            points = [(x(r["age"]), y(r[side][key])) for r in results if side in r]
            if not points:
                continue
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
            out.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in points)
            name = f"{label} ({'this code' if side == 'new' else 'anchor'})"
            out.append(f'<line x1="{margin + 10}" x2="{margin + 34}" y1="{20 + legend * 14}" y2="{20 + legend * 14}" stroke="{colour}" stroke-width="2"{dash}/>')
            out.append(f'<text x="{margin + 40}" y="{24 + legend * 14}">{name}</text>')
            legend += 1
    out.append("</svg>")
    return "\n".join(out)


if __name__ == "__main__":
    main()
