"""Side by side, in one run: the project against Structured Streaming and a Flink job.

Every figure is measured here, now, on the same generated files and the same
machine, with the anchors' runs interleaved with the project's, so load that
comes and goes hits all of them alike; ratios are the project's figure over
the anchor's.

Workload: JSON click events, 2 files of 50,000 records per 100k-record batch,
over 100,000 users (about 63,000 distinct users a batch); per user count,
sum and max, merged into keyed state.

* Structured Streaming (`bench/anchors/structured_streaming.py`, this env):
  `Trigger.AvailableNow`, `maxFilesPerTrigger` 2, RocksDB state, noop sink.
* Flink (`bench/anchors/flink_clicks.py`, its own virtualenv, made by
  `make bench-full` when missing): the same aggregation as a Flink SQL job with
  RocksDB state, 1 s checkpoints and an exactly-once file sink, run bounded.
* The project: `max_files: 2`, state in a Delta table merged by delta-rs.

Figures:

1. one 100k batch in a new process (median of `--repeat`);
2. a run with no new data in a new process (median of `--repeat`);
3. steady batches in one process, mean of batches 2-6 (median of `--repeat`
   such runs); Flink's figure is its steady throughput, as time per 100k;
4. the project alone: one batch against states of growing size, and how its
   time splits between Spark (read) and the delta-rs MERGE (commit).

Prints the table and writes docs/benchmarks.md's sections "Side by side" and
"State size", with plots (docs/bench_*.png).

    .venv/bin/python bench/run.py [--repeat 3] [--state-sizes 100000,1000000,10000000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402
from spark_jobs.demo.clickstream import write_wave  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
FLINK_PYTHON = ROOT / ".venv-flink" / "bin" / "python"
RECORDS_PER_FILE = 50_000
FILES_PER_BATCH = 2
USERS = 100_000
SEED = 11
TRANSFORM = "SELECT user_id, count(*) AS events, sum(amount) AS amount, max(ts) AS last_seen FROM batch GROUP BY user_id"


def spec_dict(max_files: int = FILES_PER_BATCH) -> dict[str, Any]:
    return {
        "name": "bench_clicks",
        "source": {"type": "files", "path": "landing", "format": "json",
                   "schema": "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"},
        "transform": TRANSFORM,
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum", "amount": "sum", "last_seen": "max"}},
        "checkpoint": "lake/_checkpoints/bench",
        "batch": {"max_files": max_files},
    }


# -- data ----------------------------------------------------------------------------------


class Waves:
    """Generated batches, written once and hard-linked into each run's landing folder,
    so every engine reads the very same files (same bytes, same mtimes)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.written = 0

    def files(self, wave: int) -> list[Path]:
        while self.written <= wave:
            write_wave(self.folder, self.written, files=FILES_PER_BATCH, records_per_file=RECORDS_PER_FILE, users=USERS, seed=SEED)
            self.written += 1
        return sorted(self.folder.glob(f"clicks-s{SEED}-w{wave:05d}-*.json"))

    def land(self, landing: Path, waves: range) -> Path:
        landing.mkdir(parents=True, exist_ok=True)
        for wave in waves:
            for path in self.files(wave):
                os.link(path, landing / path.name)
        return landing


# -- runs ----------------------------------------------------------------------------------


def timed(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> tuple[float, str]:
    """Wall seconds of a new process from its start to its exit, and its stdout.

    Output goes to files, not pipes: a pipe is read until every process
    holding it has closed it, so a JVM child still shutting down would count.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        code = subprocess.run(args, stdout=out, stderr=err, env={**os.environ, **(env or {})}, timeout=timeout, cwd=ROOT).returncode
        took = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout = out.read()
        if code != 0:
            raise RuntimeError(f"{' '.join(args[:3])} ... failed ({code}):\n{stdout[-3000:]}\n{err.read()[-3000:]}")
    return took, stdout


def project_pipeline(folder: Path, waves: Waves, landed: range, max_files: int = FILES_PER_BATCH) -> Path:
    folder.mkdir(parents=True)
    waves.land(folder / "landing", landed)
    spec = folder / "bench.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(max_files), sort_keys=False))
    return spec


def project_run(spec: Path, remote: str | None = None) -> tuple[float, dict[str, Any]]:
    """`microbatch run` in a new process, as an Airflow task runs it; on `remote`'s
    Spark Connect server when given."""
    took, stdout = timed([sys.executable, "-m", "spark_jobs", "-q", "run", str(spec), "--json",
                          *(["--master", remote] if remote else [])])
    return took, json.loads(stdout)


def ss_run(landing: Path, checkpoint: Path, remote: str | None = None) -> tuple[float, dict[str, Any]]:
    took, stdout = timed([sys.executable, str(ROOT / "bench/anchors/structured_streaming.py"), "--landing", str(landing),
                          "--checkpoint", str(checkpoint), "--max-files", str(FILES_PER_BATCH),
                          *(["--remote", remote] if remote else [])])
    return took, json.loads(stdout.strip().splitlines()[-1])


def flink_run(landing: Path, work: Path) -> tuple[float, list[dict[str, Any]]]:
    """A bounded Flink run over `landing`: wall seconds and its progress events."""
    metrics = work / "metrics.jsonl"
    took, _ = timed([str(FLINK_PYTHON), str(ROOT / "bench/anchors/flink_clicks.py"), "--landing", str(landing),
                     "--out", str(work / "out"), "--checkpoints", str(work / "checkpoints"), "--bounded",
                     "--checkpoint-interval-ms", "1000", "--backend", "rocksdb", "--metrics-file", str(metrics)],
                    timeout=1800)
    return took, [json.loads(line) for line in metrics.read_text().splitlines()]


def flink_available() -> str | None:
    """Why Flink cannot run here, or None."""
    if not FLINK_PYTHON.exists():
        return f"no Flink virtualenv at {FLINK_PYTHON.parent.parent} (`make bench-full` creates it)"
    return None


def project_steady(spec: Path, batches: int, *, read_ahead: bool = True) -> list[dict[str, Any]]:
    """`batches` batches in one new process (this script's --child-steady)."""
    _, stdout = timed([sys.executable, __file__, "--child-steady", str(spec), "--batches", str(batches),
                       *([] if read_ahead else ["--one-by-one"])], timeout=1800)
    return json.loads(stdout.strip().splitlines()[-1])


def child_steady(spec_path: str, batches: int, read_ahead: bool) -> None:
    """Run `batches` batches back to back in this process, one Spark session; print their timings.

    With `read_ahead`, as `microbatch run --catch-up` runs them (`catch_up`:
    batches N+1 and N+2 are read while N commits): a batch's seconds run
    from the previous batch's outcome to its own, and `at` is when its outcome came
    (`steady_pace` turns them into the figure). Without, each batch is a
    `run_batch` call, timed from its start to its end.
    """
    from spark_jobs.core.catch_up import catch_up
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.session import default_session
    from spark_jobs.engine.spark_compute import SparkCompute

    spec = load_spec(spec_path)
    session = default_session(short_lived=False)
    out = []

    begun = time.perf_counter()

    def record(outcome: Any, started: float) -> None:
        now = time.perf_counter()
        out.append({"seconds": now - started, "at": now - begun, "status": str(outcome.status), "records": outcome.records_in,
                    "steps_ms": outcome.steps_ms})

    if read_ahead:
        last = [time.perf_counter()]

        def on_outcome(outcome: Any) -> None:
            record(outcome, last[0])
            last[0] = time.perf_counter()

        catch_up(spec, RunOptions(run_id="bench-catch-up"), lambda: SparkCompute(session=session), max_batches=batches,
                 on_outcome=on_outcome)
    else:
        for n in range(batches):
            started = time.perf_counter()
            record(run_batch(spec, RunOptions(run_id=f"bench-{n}"), compute_factory=lambda: SparkCompute(session=session)), started)
    print(json.dumps(out))


# -- the side-by-side figures --------------------------------------------------------------


@dataclass
class Figure:
    """One row of the side-by-side table: samples per engine."""

    name: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    note: str = ""

    def add(self, engine: str, value: float) -> None:
        self.samples.setdefault(engine, []).append(value)

    def value(self, engine: str) -> float | None:
        values = self.samples.get(engine)
        return statistics.median(values) if values else None

    def ratio(self, engine: str) -> float | None:
        ours, theirs = self.value("project"), self.value(engine)
        return ours / theirs if ours is not None and theirs else None


def one_batch_and_no_data(work: Path, waves: Waves, repeat: int, flink: bool) -> tuple[Figure, Figure, dict[str, Any]]:
    """Figures 1 and 2: a fresh pipeline's first 100k batch in a new process, then runs with nothing new."""
    one, none = Figure("one 100k batch, new process"), Figure("no new data, new process")
    detail: dict[str, Any] = {"ss_session_s": [], "project_steps": [], "flink_first_record_s": []}
    for r in range(repeat):
        print(f"  round {r + 1}/{repeat}", flush=True)
        base = work / f"one-{r}"
        landing = waves.land(base / "ss" / "landing", range(r, r + 1))
        took, ss = ss_run(landing, base / "ss" / "checkpoint")
        one.add("structured streaming", took)
        detail["ss_session_s"].append(ss["session_s"])
        spec = project_pipeline(base / "project", waves, range(r, r + 1))
        took, outcome = project_run(spec)
        assert outcome["status"] == "committed" and outcome["records_in"] == RECORDS_PER_FILE * FILES_PER_BATCH, outcome
        one.add("project", took)
        detail["project_steps"].append(outcome["steps_ms"])
        if flink:
            took, events = flink_run(waves.land(base / "flink" / "landing", range(r, r + 1)), base / "flink")
            one.add("flink", took)
            first = next(e["t"] for e in events if e["event"] == "first_record")
            detail["flink_first_record_s"].append(first - next(e["t"] for e in events if e["event"] == "process_start"))
        took, ss = ss_run(landing, base / "ss" / "checkpoint")
        assert not ss["batches"], ss
        none.add("structured streaming", took)
        took, outcome = project_run(spec)
        assert outcome["status"] == "no_new_data", outcome
        none.add("project", took)
    one.note = "process start to exit: JVM start, planning, reading, state, commit"
    none.note = "Flink: a continuous job has no such run (its idle cost is in docs/micro-batch-vs-continuous.md)"
    return one, none, detail


def one_batch_connect(work: Path, waves: Waves, repeat: int) -> Figure:
    """Figure 1 again with the JVM kept warm: both run their batch from a new Python
    process on one Spark Connect server (local[2]) that outlives the runs."""
    from tests.spark_servers import start_connect

    figure = Figure("one 100k batch, new process, warm Spark Connect server")
    server, url = start_connect(work / "connect-server")
    try:
        # The server's first queries compile and load what every later one uses;
        # a deployment that keeps a server up pays that once, not per run.
        base = work / "connect-warm"
        ss_run(waves.land(base / "ss" / "landing", range(50, 51)), base / "ss" / "checkpoint", url)
        project_run(project_pipeline(base / "project", waves, range(50, 51)), url)
        for r in range(repeat):
            print(f"  round {r + 1}/{repeat}", flush=True)
            base = work / f"connect-{r}"
            landing = waves.land(base / "ss" / "landing", range(r, r + 1))
            took, _ = ss_run(landing, base / "ss" / "checkpoint", url)
            figure.add("structured streaming", took)
            took, outcome = project_run(project_pipeline(base / "project", waves, range(r, r + 1)), url)
            assert outcome["status"] == "committed" and outcome["records_in"] == RECORDS_PER_FILE * FILES_PER_BATCH, outcome
            figure.add("project", took)
    finally:
        server.stop()
    figure.note = "both on the same warm server; the project's ratio to Structured Streaming in its own JVM is in the notes"
    return figure


def steady_pace(runs: list[dict[str, Any]]) -> float:
    """Seconds per batch over batches 2..N of a read-ahead run: from the start
    of batch 2's read to batch N's outcome, over N-1.

    Batch 2 is read while batch 1 commits (batch 3 with it), so its read
    starts `read_ahead_lead` seconds before batch 2 begins, which is batch
    1's outcome; counting from there puts every read and commit of batches
    2..N in the window (and part of batch 1's commit too: the figure leans
    against the project, never for it)."""
    steps = runs[1]["steps_ms"]
    lead = steps.get("read_ahead_lead", steps.get("read_ahead", steps.get("read", 0))) / 1000
    return (runs[-1]["at"] - runs[0]["at"] + lead) / (len(runs) - 1)


def steady(work: Path, waves: Waves, repeat: int, batches: int, flink: bool) -> tuple[Figure, dict[str, Any]]:
    """Figure 3: batches 2..N in one process. The project runs them as
    `microbatch run --catch-up` does (reading ahead); the same batches run
    one `run_batch` at a time are reported beside it."""
    figure = Figure(f"steady batch in one process (mean of batches 2-{batches})")
    detail: dict[str, Any] = {"ss": [], "project": [], "one_by_one": [], "flink_records_per_s": []}
    landed = range(100, 100 + batches)
    for r in range(repeat):
        print(f"  round {r + 1}/{repeat}", flush=True)
        base = work / f"steady-{r}"
        _, ss = ss_run(waves.land(base / "ss" / "landing", landed), base / "ss" / "checkpoint")
        times = [b["duration_ms"]["triggerExecution"] / 1000 for b in ss["batches"]]
        assert len(times) == batches, ss
        figure.add("structured streaming", statistics.mean(times[1:]))
        detail["ss"].append(times)
        runs = project_steady(project_pipeline(base / "project", waves, landed), batches)
        assert all(run["status"] == "committed" for run in runs) and len(runs) == batches, runs
        figure.add("project", steady_pace(runs))
        detail["project"].append(runs)
        runs = project_steady(project_pipeline(base / "one-by-one", waves, landed), batches, read_ahead=False)
        assert all(run["status"] == "committed" for run in runs), runs
        detail["one_by_one"].append(statistics.mean(run["seconds"] for run in runs[1:]))
        if flink:
            _, events = flink_run(waves.land(base / "flink" / "landing", landed), base / "flink")
            first = next(e["t"] for e in events if e["event"] == "first_record")
            finished = next(e["t"] for e in events if e["event"] == "job_finished")
            records = batches * FILES_PER_BATCH * RECORDS_PER_FILE
            detail["flink_records_per_s"].append(records / (finished - first))
            figure.add("flink", (finished - first) / batches)
    figure.note = "Flink: its steady throughput, as seconds per 100k records (first record to the job's end, final checkpoint included)"
    return figure, detail


# -- state size ----------------------------------------------------------------------------


def state_size_curve(work: Path, sizes: list[int], spread_sizes: list[int]) -> list[dict[str, Any]]:
    """Batches against a state of each size, in one process (Spark warm)."""
    _, stdout = timed([sys.executable, __file__, "--child-state", str(work / "state"), "--sizes", ",".join(map(str, sizes)),
                       "--spread", ",".join(map(str, spread_sizes))], timeout=7200)
    return json.loads(stdout.strip().splitlines()[-1])


def child_state(folder: str, sizes: list[int], spread_sizes: list[int]) -> None:
    """For each size and layout: seed a state of that many keys, then run 3 batches
    on it and keep the median; 6 batches on a small state first warm the JVM up."""
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.session import default_session
    from spark_jobs.engine.spark_compute import SparkCompute

    session = default_session(short_lived=False)
    waves = Waves(Path(folder) / "waves")
    out = []
    cases = [(USERS, "warm-up"), *[(n, "clustered") for n in sizes], *[(n, "spread") for n in spread_sizes]]
    for size, layout in cases:
        batches = 6 if layout == "warm-up" else 3
        spec_path = project_pipeline(Path(folder) / f"state-{size}-{layout}", waves, range(200, 200 + batches))
        spec = load_spec(spec_path)
        started = time.perf_counter()
        _seed_state(spec.state_path, size, spread=layout == "spread")
        seeded = time.perf_counter() - started
        runs = []
        for n in range(batches):
            outcome = run_batch(spec, RunOptions(run_id=f"bench-{n}"), compute_factory=lambda: SparkCompute(session=session))
            assert outcome.status == "committed" and outcome.records_in == RECORDS_PER_FILE * FILES_PER_BATCH, outcome
            runs.append({"seconds": outcome.duration_ms / 1000, "steps_ms": outcome.steps_ms})
        median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
        state_bytes = sum(p.stat().st_size for p in Path(spec.state_path).rglob("*.parquet"))
        print(f"  {layout} state of {size:,} keys: batches {[round(r['seconds'], 2) for r in runs]} {median['steps_ms']}",
              file=sys.stderr, flush=True)
        if layout != "warm-up":
            out.append({"keys": size, "layout": layout, **median, "all_s": [r["seconds"] for r in runs], "seed_s": seeded,
                        "state_bytes": state_bytes})
        shutil.rmtree(Path(folder) / f"state-{size}-{layout}")
    print(json.dumps(out))


def _seed_state(path: str, size: int, *, spread: bool) -> None:
    """A state of `size` keys, as if many batches had run, written in files of a
    million rows. The batch's 100k users are among them; the other keys are
    older ones. `spread=False`: the users' keys sort after the old ones, so a
    batch's MERGE touches only the file holding them (the key range it prunes
    to). `spread=True`: every file holds some users, so every batch rewrites
    the whole state (keys hashed over the files: the worst case for a
    copy-on-write MERGE)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import write_deltalake

    from spark_jobs.core.commits import METADATA_KEY
    from spark_jobs.core.fencing import STATE_FENCE, Position, commit_properties

    properties = commit_properties(STATE_FENCE, Position(0, 0), {METADATA_KEY: '{"txn": 0}'})
    stride = max(1, size // USERS) if spread else 1
    step = 1_000_000
    for start in range(0, size, step):
        numbers = pa.array(range(start, min(size, start + step)), pa.int64())
        is_user = pc.and_(pc.equal(pc.subtract(numbers, pc.multiply(pc.divide(numbers, stride), stride)), 0),
                          pc.less(pc.divide(numbers, stride), USERS))
        user_digits = pc.utf8_lpad(pc.cast(pc.divide(numbers, stride), pa.string()), 6, "0")
        users = pc.binary_join_element_wise("user", user_digits, "")
        old = pc.binary_join_element_wise("old", pc.utf8_lpad(pc.cast(numbers, pa.string()), 10, "0"), "")
        ids = pc.if_else(is_user, users, old)
        n = len(ids)
        piece = pa.table({"user_id": ids, "events": pa.array([1] * n, pa.int64()), "amount": pa.array([1.0] * n),
                          "last_seen": pa.nulls(n, pa.timestamp("us", tz="UTC")), "_batch_id": pa.array([0] * n, pa.int64())})
        write_deltalake(path, piece, mode="append", commit_properties=properties if start + step >= size else None)


# -- report --------------------------------------------------------------------------------


def machine() -> str:
    memory = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")), "0")
    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[0]
    return (f"{platform.machine()}, {os.cpu_count()} cores, {int(memory) / 1024 ** 2:.0f} GB, Python {platform.python_version()}, "
            f"{java}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")


TARGETS = {"one 100k batch, new process": 0.4, "no new data, new process": 0.1, "steady": 0.5}


def _target(name: str) -> float | None:
    return next((t for key, t in TARGETS.items() if name == key or (key == "steady" and name.startswith(key))), None)


def side_by_side_table(figures: list[Figure]) -> list[str]:
    engines = ["structured streaming", "flink"]
    lines = ["| figure | Structured Streaming | Flink | project | project / SS | project / Flink | target (project / SS) |",
             "|---|---|---|---|---|---|---|"]
    for f in figures:
        cells = [f.name]
        for engine in [*engines, "project"]:
            v = f.value(engine)
            cells.append(f"{v:.2f} s" if v is not None else "-")
        for engine in engines:
            r = f.ratio(engine)
            # Three decimals: a ratio a hair above its target must not print as on it.
            cells.append(f"**{r:.3f}**" if r is not None and engine == "structured streaming" else (f"{r:.3f}" if r is not None else "-"))
        target = _target(f.name)
        reached = f.ratio("structured streaming")
        cells.append(f"<= {target} ({'met' if reached is not None and reached <= target else 'not met'})" if target else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def samples_line(f: Figure) -> str:
    return f"{f.name}: " + "; ".join(f"{e} " + ", ".join(f"{v:.2f}" for v in vs) for e, vs in f.samples.items()) + " s"


def plot_side_by_side(figures: list[Figure], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [("structured streaming", "#9aa5b1"), ("flink", "#c9a26b"), ("project", "#2f6f9f")]
    fig, axes = plt.subplots(1, len(figures), figsize=(4.2 * len(figures), 3.6))
    for ax, f in zip(axes, figures):
        names = [e for e, _ in engines if f.value(e) is not None]
        values = [f.value(e) for e in names]
        bars = ax.bar(range(len(names)), values, color=[c for e, c in engines if e in names])
        for bar, name in zip(bars, names):
            for v in f.samples[name]:
                ax.plot(bar.get_x() + bar.get_width() / 2, v, "k.", markersize=4)
        ax.set_xticks(range(len(names)), [n.replace("structured streaming", "SS") for n in names])
        ax.set_title(f.name.replace(" (mean", "\n(mean").replace(", warm", ",\nwarm"), fontsize=9)
        ax.set_ylabel("seconds")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    fig.suptitle("One run, same files, same machine (bars: medians; dots: each run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_state(curve: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.0))
    for layout, marker in (("clustered", "o"), ("spread", "s")):
        rows = [c for c in curve if c["layout"] == layout]
        if not rows:
            continue
        keys = [c["keys"] for c in rows]
        ax.plot(keys, [c["seconds"] for c in rows], marker + "-", color="black", label=f"whole batch, {layout}")
        ax.plot(keys, [c["steps_ms"].get("read", 0) / 1000 for c in rows], marker + ":", color="#2f6f9f", label=f"read (Spark), {layout}")
        ax.plot(keys, [c["steps_ms"].get("commit", 0) / 1000 for c in rows], marker + "--", color="#c9a26b",
                label=f"commit (delta-rs MERGE), {layout}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("keys in the state")
    ax.set_ylabel("seconds")
    ax.set_title("One 100k-record batch against states of growing size", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steady-batches", type=int, default=6)
    parser.add_argument("--state-sizes", default="100000,1000000,10000000,100000000",
                        help="state sizes, keys, with the batch's keys clustered in one file")
    parser.add_argument("--spread-sizes", default="1000000,10000000", help="state sizes with the batch's keys in every file")
    parser.add_argument("--no-flink", action="store_true", help="leave the Flink anchor out")
    parser.add_argument("--only-state", action="store_true", help="only the state-size curve (rewrites only its section)")
    parser.add_argument("--child-steady", help=argparse.SUPPRESS)
    parser.add_argument("--one-by-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-state", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--spread", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_steady:
        return child_steady(args.child_steady, args.batches, read_ahead=not args.one_by_one)
    if args.child_state:
        return child_state(args.child_state, [int(s) for s in args.sizes.split(",")], [int(s) for s in args.spread.split(",") if s])

    if args.only_state:
        work = Path(tempfile.mkdtemp(prefix="microbatch-bench-"))
        try:
            curve = state_size_curve(work, [int(s) for s in args.state_sizes.split(",")],
                                     [int(s) for s in args.spread_sizes.split(",") if s])
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print("\n".join(write_state_doc(curve)))
        return
    missing = None if not args.no_flink else "left out (--no-flink)"
    missing = missing or flink_available()
    if missing:
        print(f"Flink anchor: {missing}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="microbatch-bench-"))
    started = time.time()
    try:
        waves = Waves(work / "waves")
        print("one batch, then nothing new, each in a new process (SS, project, Flink interleaved)...", flush=True)
        one, none, detail_one = one_batch_and_no_data(work, waves, args.repeat, flink=missing is None)
        print("one batch in a new process, both on a warm Spark Connect server...", flush=True)
        connect = one_batch_connect(work, waves, args.repeat)
        print("steady batches in one process...", flush=True)
        steady_figure, detail_steady = steady(work, waves, args.repeat, args.steady_batches, flink=missing is None)
        print("state size (project alone)...", flush=True)
        curve = state_size_curve(work, [int(s) for s in args.state_sizes.split(",")],
                                 [int(s) for s in args.spread_sizes.split(",") if s])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = [one, none, steady_figure, connect]
    minutes = (time.time() - started) / 60
    table = side_by_side_table(figures)
    print("\n".join(table))
    write_docs(figures, detail_one, detail_steady, curve, missing, minutes)


def write_docs(figures: list[Figure], detail_one: dict[str, Any], detail_steady: dict[str, Any],
               curve: list[dict[str, Any]], flink_missing: str | None, minutes: float) -> None:
    plot_side_by_side(figures, ROOT / "docs" / "bench_side_by_side.png")
    one, _, steady_figure, connect = figures
    steps = detail_one["project_steps"]
    median_step = {k: statistics.median(s.get(k, 0) for s in steps) / 1000 for k in steps[0]}
    lines = [
        "## Side by side",
        "",
        f"Measured by `make bench-full` (`bench/run.py`) in one run of {minutes:.0f} minutes on {machine()}.",
        "Each figure's anchor runs were interleaved with the project's, on the same files (hard links of one set of "
        "generated files). Workload: JSON click events, 2 files of 50,000 records per 100k-record batch, over 100,000 "
        "users; per user count, sum and max merged into keyed state.",
        "",
        "* **Structured Streaming** (`bench/anchors/structured_streaming.py`): `Trigger.AvailableNow`, "
        "`maxFilesPerTrigger` 2, RocksDB state store, 8 shuffle partitions, noop sink (its state stays in the state store: "
        "it writes less than the project, which writes a queryable Delta table), Spark's default JVM flags.",
        "* **Flink** (`bench/anchors/flink_clicks.py`, PyFlink 2.3 in its own virtualenv): the same aggregation as Flink SQL, "
        "RocksDB state with incremental checkpoints every second, exactly-once file sink, bounded run, parallelism 2."
        + (f" Not run this time: {flink_missing}." if flink_missing else ""),
        "* **The project**: `microbatch run` (a new process, as an Airflow task) with `max_files: 2`; the steady figure runs "
        "the batches in one process with one Spark session, as `microbatch run --catch-up` does: batches N+1 and N+2 are "
        "read, at once, while N commits. Its figure is the time from the start of batch 2's read to batch N's commit, "
        "over N-1 batches (which counts part of batch 1's commit as well).",
        "",
        *side_by_side_table(figures),
        "",
        "Ratios are the project's median over the anchor's (lower is better for the project).",
        "",
        *[f"* {samples_line(f)}" for f in figures],
        "* Where a new-process batch of the project goes (medians): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in median_step.items())
        + "; the rest is Python's start and imports, and the process's exit.",
        f"* The project on a warm Spark Connect server against Structured Streaming in its own JVM (the first row's anchor): "
        f"{connect.value('project') / one.value('structured streaming'):.2f}; on a warm server a new-process batch is "
        "Python's start, the plan, the server's work and the commit.",
        f"* Structured Streaming's session start in those runs: {', '.join(f'{v:.1f}' for v in detail_one['ss_session_s'])} s.",
    ]
    if detail_one["flink_first_record_s"]:
        lines.append(f"* Flink, process start to the first record read: {', '.join(f'{v:.1f}' for v in detail_one['flink_first_record_s'])} s.")
    if detail_steady["flink_records_per_s"]:
        lines.append(f"* Flink's steady throughput: {', '.join(f'{v:,.0f}' for v in detail_steady['flink_records_per_s'])} records/s.")
    for runs in detail_steady["project"][:1]:
        lines.append("* One steady run of the project, time from each batch's outcome to the next (the first: from the start): "
                     + "; ".join(f"{r['seconds']:.2f} s (read ahead {r['steps_ms'].get('read_ahead', 0) / 1000:.2f}, "
                                 f"commit {r['steps_ms'].get('commit', 0) / 1000:.2f})" for r in runs))
    if detail_steady["one_by_one"]:
        ss_steady = steady_figure.value("structured streaming")
        one_by_one = statistics.median(detail_steady["one_by_one"])
        lines.append(f"* The same batches, one `run_batch` call each, nothing read ahead (as one Airflow task a batch on a warm "
                     f"engine would run them): {', '.join(f'{v:.2f}' for v in detail_steady['one_by_one'])} s a batch, "
                     f"median {one_by_one:.2f} s" + (f", {one_by_one / ss_steady:.2f} of Structured Streaming." if ss_steady else "."))
    for times in detail_steady["ss"][:1]:
        lines.append("* One steady run of Structured Streaming, batch by batch (`triggerExecution`): " + ", ".join(f"{t:.2f}" for t in times) + " s")
    lines += ["", "![side by side](bench_side_by_side.png)", ""]
    replace_section(DOC, "## Side by side", lines)
    write_state_doc(curve)


def write_state_doc(curve: list[dict[str, Any]]) -> list[str]:
    """The "State size" section of docs/benchmarks.md, and its plot."""
    plot_state(curve, ROOT / "docs" / "bench_state_size.png")
    state = [
        "## State size",
        "",
        f"Measured by `make bench-full` (`bench/run.py`) on {machine()}. A 100k-record batch (about 63,000 keys) merged into a state of N keys, "
        "in one process with Spark warm (6 batches on a small state first); each row is the median of 3 batches on its "
        "state. The state is seeded in files of a million rows, two ways: **clustered**, the batch's users' keys sort "
        "apart from the old ones, so the MERGE (unstreamed, so delta-rs prunes files by the batch's key range) rewrites one file; "
        "**spread**, every file holds some of the batch's keys, so every batch rewrites the whole state: the worst case "
        "of a copy-on-write MERGE. `read` is Spark (read, parse, aggregate, result to Arrow), `commit` the delta-rs "
        "MERGE and the ledger's commit.",
        "",
        "| keys in state | layout | state on disk | batch | read (Spark) | commit (MERGE) | commit's share | batch / batch at 100k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = next((c["seconds"] for c in curve if c["keys"] == USERS), curve[0]["seconds"])
    for c in curve:
        s = c["steps_ms"]
        state.append(f"| {c['keys']:,} | {c['layout']} | {c['state_bytes'] / 1e6:,.0f} MB | {c['seconds']:.2f} s | "
                     f"{s.get('read', 0) / 1000:.2f} s | {s.get('commit', 0) / 1000:.2f} s | "
                     f"{s.get('commit', 0) / 1000 / c['seconds']:.0%} | {c['seconds'] / base:.2f} |")
    state += ["", "Each case's three batches: " + "; ".join(
        f"{c['keys']:,} {c['layout']} " + ", ".join(f"{v:.2f}" for v in c["all_s"]) for c in curve) + " s.",
        "", "![state size](bench_state_size.png)", ""]
    replace_section(DOC, "## State size", state)
    return state


if __name__ == "__main__":
    main()
