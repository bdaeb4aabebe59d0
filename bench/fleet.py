"""A fleet of pipelines on one live Airflow, beside Structured Streaming (issue 36).

For each fleet size N (`--sizes`), in one run:

1. **The project.** N pipelines of distinct specs and folders, each with
   `airflow.run_on_data` (the fleet default: no run until data waits), on a
   live Airflow (`tests/plugins/live_airflow.py`: api-server, scheduler,
   dag-processor, triggerer, LocalExecutor with `--parallelism` task slots,
   PostgreSQL; Airflow's default scheduler heartbeat). All unpaused; once
   every watcher runs, `--idle` seconds with nothing arriving, then
   `--duration` seconds in which each active pipeline (all but
   `--idle-share` of them) gets a file every `--interval` seconds, the
   landings spread evenly over the interval; then up to `--drain` seconds
   for the last files to be committed.
2. **The anchor.** Structured Streaming with N queries in one driver over
   the same kind of folders and the same landing schedule
   (`anchors/structured_streaming_fleet.py`: `ProcessingTime` at the
   watchers' `--poll` interval, RocksDB state, a sink that writes nothing).

Measured for each:

* latency from a file landing (its rename) to its batch being committed
  (the ledger row's `committed_at`; for the anchor, the end of the
  `foreachBatch` that saw the file's probe record), p50 and p95, over the
  files landed in the window;
* for the project, where that time goes: watcher to DAG run queued, the
  scheduler's delay (run queued to started), and the run itself;
* CPU: whole process trees (every process of each component's session,
  the reaped ones included), over the idle window and the landing window;
  CPU-s per batch (all of Airflow's CPU in the window over the batches it
  committed) and per idle pipeline-hour (all of Airflow's CPU while idle,
  over N: an upper bound, since Airflow's fixed cost is in it);
* the machine's busy share of its cores over the window, peak memory (RSS
  of the trees, sampled every 2 s), batches a minute, and the files still
  waiting when the window ends (the backlog);

and, apart, the dag-processor's parse of the pipelines' DAG file for N
specs and for 1,000 specs one of which is broken (the other 999 listed).

Writes docs/fleet.md's "The fleet benchmark" section and
docs/fleet_latency.png.

    .venv/bin/python bench/fleet.py [--sizes 10,50,100] [--interval 120] [--duration 360] [--poll 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "plugins"))

from doc_sections import replace_section  # noqa: E402
from tests.plugins.live_airflow import LiveAirflow  # noqa: E402

DOC = ROOT / "docs" / "fleet.md"
SECTION = "## The fleet benchmark"
PLOT = ROOT / "docs" / "fleet_latency.png"
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
RECORDS_PER_FILE = 200


# -- processes -------------------------------------------------------------------


def _stat(pid: str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_cpu(sessions: set[int]) -> float:
    """CPU seconds of every live process of `sessions`, with what each has
    reaped (cutime, cstime): ended tasks and JVMs count too."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(pid)
        if fields and int(fields[3]) in sessions:
            total += sum(int(f) for f in fields[11:15])
    return total / TICK


def tree_rss(sessions: set[int]) -> int:
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(pid)
        if fields and int(fields[3]) in sessions:
            total += int(fields[21]) * PAGE
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class Sampler(threading.Thread):
    """Peak RSS of the trees of `sessions`, every 2 s."""

    def __init__(self, sessions: set[int]) -> None:
        super().__init__(daemon=True)
        self.sessions = sessions
        self.peak = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(2):
            self.peak = max(self.peak, tree_rss(self.sessions))

    def stop(self) -> int:
        self._done.set()
        self.join(5)
        return self.peak


# -- data ------------------------------------------------------------------------


def land(folder: Path, wave: int) -> tuple[str, float]:
    """One file of clicks ending with a probe record `probe-<wave>`, written
    under a temporary name and renamed; (its name, the time of the rename)."""
    rng = random.Random(f"{folder.name}-{wave}")
    lines = [
        json.dumps({"event_id": f"{folder.name}-w{wave}-r{r}", "user_id": f"user{rng.randrange(50):03d}",
                    "amount": round(rng.uniform(0, 100), 2), "ts": "2026-11-26T00:00:00Z"})
        for r in range(RECORDS_PER_FILE - 1)
    ]
    lines.append(json.dumps({"event_id": f"{folder.name}-w{wave}-probe", "user_id": f"probe-{wave:05d}", "amount": 0.0,
                             "ts": "2026-11-26T00:00:00Z"}))
    folder.mkdir(parents=True, exist_ok=True)
    name = f"clicks-w{wave:05d}.json"
    temporary = folder / f".{name}.tmp"
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, folder / name)
    return name, time.time()


def schedule(active: list[str], interval: float, duration: float) -> list[tuple[float, str, int]]:
    """(offset in seconds, pipeline, wave) of every landing: each active
    pipeline every `interval`, the pipelines spread evenly over it."""
    plan = []
    for k, name in enumerate(active):
        offset, wave = k * interval / len(active), 0
        while offset < duration:
            plan.append((offset, name, wave))
            offset, wave = offset + interval, wave + 1
    return sorted(plan)


def run_landings(landings: Path, plan: list[tuple[float, str, int]]) -> dict[tuple[str, str], float]:
    """Land the plan's files on time; {(pipeline, file name): landed at}."""
    landed = {}
    start = time.time()
    for offset, name, wave in plan:
        delay = start + offset - time.time()
        if delay > 0:
            time.sleep(delay)
        file, at = land(landings / name, wave)
        landed[(name, file)] = at
    return landed


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# -- the project -----------------------------------------------------------------


def make_specs(folder: Path, n: int, poll: float) -> list[str]:
    from tests.conftest import oracle_spec_dict, write_spec

    names = []
    for i in range(n):
        name = f"fleet_{i:03d}"
        spec = oracle_spec_dict(name=name, airflow={"run_on_data": {"poll_seconds": poll}})
        spec["source"]["path"] = f"landing/{name}"
        spec["state"]["path"] = f"lake/{name}"
        spec["checkpoint"] = f"lake/_checkpoints/{name}"
        write_spec(folder, spec, f"{name}.yaml")
        names.append(name)
    return names


def committed_files(spec_path: Path) -> dict[str, tuple[float, int, str | None, float | None]]:
    """{file name: (committed at, batch id, Airflow run id, planned at)} from the pipeline's ledger."""
    from spark_jobs.core.ledger import OffsetLedger, RowStatus
    from spark_jobs.core.spec import load_spec

    spec = load_spec(spec_path)
    found = {}
    for row in OffsetLedger(spec.ledger_path, spec.name).load().rows:
        if row.status != RowStatus.COMMITTED or row.committed_at is None:
            continue
        for entry in (row.manifest or {}).get("files", []):
            planned = row.planned_at.timestamp() if row.planned_at else None
            found[entry["name"].rsplit("/", 1)[-1]] = (row.committed_at.timestamp(), row.batch_id, row.run_id, planned)
    return found


def run_project(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from idle_cost import running_watchers

    folder = work / "pipelines"
    names = make_specs(folder, n, args.poll)
    active = names[: max(1, round(n * (1 - args.idle_share)))]
    live = LiveAirflow(work / "airflow", folder)
    # Airflow's defaults, not the live tests' quick loops: a fleet's settings.
    for key in ("AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC", "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC", "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL"):
        live.env.pop(key, None)
    live.env["AIRFLOW__CORE__PARALLELISM"] = str(args.parallelism)
    live.env["AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG"] = "1"
    live.start()
    sessions = {p.pid for p in live.procs}
    try:
        for name in names:
            live.wait_for_dag(name, timeout=900)
        for name in names:
            live.unpause(name)
        live.wait(lambda: running_watchers(live) == n, 900, "every watcher to run in the triggerer")
        time.sleep(args.poll * 2)
        cpu0, busy0 = tree_cpu(sessions), machine_busy()
        time.sleep(args.idle)
        cpu1, busy1 = tree_cpu(sessions), machine_busy()
        idle_runs = sum(len(live.runs(name)) for name in names)
        sampler = Sampler(sessions)
        sampler.start()
        plan = schedule(active, args.interval, args.duration)
        landed = run_landings(folder / "landing", plan)
        window_end = time.time()
        cpu2, busy2 = tree_cpu(sessions), machine_busy()
        spec_of = {name: folder / f"{name}.yaml" for name in names}
        waiting_at_end = sum(1 for (name, file) in landed if file not in committed_files(spec_of[name]))
        deadline = time.time() + args.drain
        while time.time() < deadline:
            done = {name: committed_files(spec_of[name]) for name in active}
            if all(file in done[name] for name, file in landed):
                break
            time.sleep(5)
        peak = sampler.stop()
        done = {name: committed_files(spec_of[name]) for name in active}
        latencies = [done[name][file][0] - at for (name, file), at in landed.items() if file in done[name]]
        missing = sum(1 for name, file in landed if file not in done[name])
        batches_in_window = sum(len({v[1] for v in done[name].values() if v[0] <= window_end}) for name in active)
        runs = {r["dag_run_id"]: r for name in active for r in live.runs(name)}
        # Where a file's time goes: landed to its run queued (the watcher's
        # poll, the triggerer, the scheduler making the run), queued to the
        # batch planned (the scheduler starting the task, the task process
        # and its imports), planned to committed (the batch, JVM included).
        to_queued, to_planned, to_committed = [], [], []
        for (name, file), at in landed.items():
            committed, _, run_id, planned = done[name].get(file, (None, None, None, None))
            run = runs.get(run_id or "")
            if committed is None or run is None or planned is None or not run.get("queued_at"):
                continue
            queued = _seconds(run["queued_at"])
            to_queued.append(queued - at)
            to_planned.append(planned - queued)
            to_committed.append(committed - planned)
        empty_runs = sum(1 for r in runs.values() if r["state"] == "success") - sum(len({v[1] for v in done[name].values()}) for name in active)
    finally:
        live.stop()
    minutes = args.duration / 60
    return {
        "n": n,
        "active": len(active),
        "files": len(landed),
        "missing": missing,
        "p50": pct(latencies, 0.5),
        "p95": pct(latencies, 0.95),
        "max": max(latencies, default=float("nan")),
        "to_queued": (pct(to_queued, 0.5), pct(to_queued, 0.95)),
        "to_planned": (pct(to_planned, 0.5), pct(to_planned, 0.95)),
        "to_committed": (pct(to_committed, 0.5), pct(to_committed, 0.95)),
        "idle_runs": idle_runs,
        "empty_runs": empty_runs,
        "idle_cpu_per_hour": (cpu1 - cpu0) * 3600 / args.idle,
        "cpu_per_batch": (cpu2 - cpu1) / max(batches_in_window, 1),
        "busy_idle": (busy1[0] - busy0[0]) / (busy1[1] - busy0[1]),
        "busy": (busy2[0] - busy1[0]) / (busy2[1] - busy1[1]),
        "batches_per_minute": batches_in_window / minutes,
        "files_per_minute": len(landed) / minutes,
        "waiting_at_end": waiting_at_end,
        "peak_gb": peak / 1e9,
        "latencies": latencies,
    }


def _seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# -- the anchor ------------------------------------------------------------------


def run_anchor(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    names = [f"fleet_{i:03d}" for i in range(n)]
    active = names[: max(1, round(n * (1 - args.idle_share)))]
    landings = work / "landing"
    for name in names:
        (landings / name).mkdir(parents=True)
    stop = work / "stop"
    log = open(work / "anchor.log", "w")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "anchors" / "structured_streaming_fleet.py"), "--landings", str(landings),
         "--checkpoints", str(work / "checkpoints"), "--interval", str(args.poll), "--stop-file", str(stop)],
        stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True, cwd=ROOT / "bench" / "anchors",
    )
    sessions = {process.pid}
    seen: dict[tuple[str, str], float] = {}
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            record = json.loads(line)
            if "ready" in record:
                ready.set()
            elif "probe" in record:
                seen.setdefault((record["query"], record["probe"]), record["at"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(900):
            raise RuntimeError(f"the anchor's {n} queries did not start: {(work / 'anchor.log').read_text()[-3000:]}")
        time.sleep(args.poll * 2)
        cpu0, busy0 = tree_cpu(sessions), machine_busy()
        time.sleep(args.idle)
        cpu1, busy1 = tree_cpu(sessions), machine_busy()
        sampler = Sampler(sessions)
        sampler.start()
        plan = schedule(active, args.interval, args.duration)
        landed = run_landings(landings, plan)
        cpu2, busy2 = tree_cpu(sessions), machine_busy()
        probe_of = {(name, file): f"probe-{int(file[8:13]):05d}" for name, file in landed}
        waiting_at_end = sum(1 for key in landed if (key[0], probe_of[key]) not in seen)
        deadline = time.time() + args.drain
        while time.time() < deadline and any((key[0], probe_of[key]) not in seen for key in landed):
            time.sleep(2)
        peak = sampler.stop()
    finally:
        stop.touch()
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
        log.close()
    latencies = [seen[(key[0], probe_of[key])] - at for key, at in landed.items() if (key[0], probe_of[key]) in seen]
    minutes = args.duration / 60
    return {
        "n": n,
        "files": len(landed),
        "missing": len(landed) - len(latencies),
        "p50": pct(latencies, 0.5),
        "p95": pct(latencies, 0.95),
        "max": max(latencies, default=float("nan")),
        "idle_cpu_per_hour": (cpu1 - cpu0) * 3600 / args.idle,
        "cpu_window": cpu2 - cpu1,
        "busy_idle": (busy1[0] - busy0[0]) / (busy1[1] - busy0[1]),
        "busy": (busy2[0] - busy1[0]) / (busy2[1] - busy1[1]),
        "files_per_minute": len(landed) / minutes,
        "waiting_at_end": waiting_at_end,
        "peak_gb": peak / 1e9,
        "latencies": latencies,
    }


# -- parsing ---------------------------------------------------------------------


PARSE = """
import os, sys, time
sys.path[:0] = [{root!r}, {plugins!r}]
os.environ["MICROBATCH_PIPELINES_DIR"] = {folder!r}
from airflow.dag_processing.dagbag import DagBag
started = time.perf_counter()
bag = DagBag(dag_folder={dags!r})
seconds = time.perf_counter() - started
import json
print(json.dumps({{"seconds": seconds, "dags": len([d for d in bag.dag_ids if d.startswith("fleet_")]), "errors": len(bag.import_errors)}}))
"""


def parse_time(n: int, work: Path, broken: bool) -> dict[str, Any]:
    """The pipelines' DAG files parsed by Airflow's DagBag in a fresh process, as the dag-processor parses them."""
    folder = work / f"parse-{n}"
    make_specs(folder, n, 30)
    if broken:
        spec = folder / "fleet_000.yaml"
        spec.write_text(spec.read_text().replace("keys:", "keyz:"))
    code = PARSE.format(root=str(ROOT), plugins=str(ROOT / "plugins"), folder=str(folder), dags=str(ROOT / "dags"))
    env = {**os.environ, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- report ----------------------------------------------------------------------


def write_doc(args: argparse.Namespace, ours: list[dict], anchor: list[dict], parses: dict[str, dict]) -> None:
    lines = [
        SECTION,
        "",
        f"Measured by `bench/fleet.py` on {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{date.today().isoformat()}, one run. Each active pipeline ({100 - args.idle_share * 100:.0f}% of N; the rest stay idle) "
        f"got a file of {RECORDS_PER_FILE} clicks every {args.interval:.0f} s for {args.duration:.0f} s, the landings spread evenly. "
        f"The project: `run_on_data` polling every {args.poll:.0f} s, a live Airflow (LocalExecutor, {args.parallelism} task "
        "slots, PostgreSQL, Airflow's default loop settings), a task and a driver JVM per batch. The anchor: Structured "
        f"Streaming, N queries in one driver (`ProcessingTime` every {args.poll:.0f} s, RocksDB, a sink that writes nothing).",
        "",
        "| N | engine | files landed | latency p50 | p95 | max | waiting at window's end | batches/min | CPU-s per batch | cores busy | CPU-s per hour while idle (all; per pipeline) | peak memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mine, theirs in zip(ours, anchor or [None] * len(ours)):
        lines.append(
            f"| {mine['n']} | project | {mine['files']} ({mine['missing']} not committed) | {mine['p50']:.1f} s | {mine['p95']:.1f} s | "
            f"{mine['max']:.1f} s | {mine['waiting_at_end']} | {mine['batches_per_minute']:.1f} | {mine['cpu_per_batch']:.1f} | "
            f"{mine['busy'] * os.cpu_count():.2f} | {mine['idle_cpu_per_hour']:.0f}; {mine['idle_cpu_per_hour'] / mine['n']:.1f} | {mine['peak_gb']:.1f} GB |"
        )
        if theirs:
            lines.append(
                f"| {theirs['n']} | Structured Streaming | {theirs['files']} ({theirs['missing']} not seen) | {theirs['p50']:.1f} s | "
                f"{theirs['p95']:.1f} s | {theirs['max']:.1f} s | {theirs['waiting_at_end']} | | "
                f"{theirs['cpu_window'] / max(theirs['files'], 1):.1f} per file | {theirs['busy'] * os.cpu_count():.2f} | "
                f"{theirs['idle_cpu_per_hour']:.0f}; {theirs['idle_cpu_per_hour'] / theirs['n']:.1f} | {theirs['peak_gb']:.1f} GB |"
            )
    lines += [
        "",
        "Where a file's time goes in the project, p50 / p95: from landing to its DAG run queued (the watcher's "
        "poll, the triggerer, the scheduler making the run), from queued to the batch planned (the scheduler "
        "starting the task, the task process and its imports), and from planned to committed (the batch, its "
        "JVM included); and the runs that found nothing:",
        "",
        "| N | landed to run queued | queued to planned | planned to committed | runs that found nothing | runs while idle |",
        "|---|---|---|---|---|---|",
    ]
    for mine in ours:
        lines.append(
            f"| {mine['n']} | {mine['to_queued'][0]:.1f} / {mine['to_queued'][1]:.1f} s | {mine['to_planned'][0]:.1f} / "
            f"{mine['to_planned'][1]:.1f} s | {mine['to_committed'][0]:.1f} / {mine['to_committed'][1]:.1f} s | "
            f"{mine['empty_runs']} | {mine['idle_runs']} |"
        )
    lines += [
        "",
        "Parsing (`dags/microbatch_pipelines.py` and `dags/microbatch_spec_errors.py` in Airflow's DagBag, a fresh process):",
        "",
        "| specs | parse time | DAGs listed | import errors |",
        "|---|---|---|---|",
    ]
    for label, parse in parses.items():
        lines.append(f"| {label} | {parse['seconds']:.2f} s | {parse['dags']} | {parse['errors']} |")
    lines += ["", f"![latency from a file landing to its batch committed]({PLOT.name})", ""]
    if not DOC.exists():
        DOC.write_text("# A fleet of pipelines on one Airflow (issue 36)\n\nFigures from `bench/` scripts, each from one run.\n")
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


def plot(ours: list[dict], anchor: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for rows, label, marker in ((ours, "project (run_on_data, a task per batch)", "o"), (anchor, "Structured Streaming (N queries, one driver)", "s")):
        if not rows:
            continue
        sizes = [r["n"] for r in rows]
        left.plot(sizes, [r["p50"] for r in rows], marker=marker, label=f"{label}, p50")
        left.plot(sizes, [r["p95"] for r in rows], marker=marker, linestyle="--", label=f"{label}, p95")
        right.plot(sizes, [r["busy"] * os.cpu_count() for r in rows], marker=marker, label=label)
    left.set_xlabel("pipelines (N)")
    left.set_ylabel("file landed to committed (s)")
    left.legend(fontsize=7)
    right.set_xlabel("pipelines (N)")
    right.set_ylabel("cores busy while files land")
    right.axhline(os.cpu_count(), color="grey", linewidth=0.8)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,50,100")
    parser.add_argument("--interval", type=float, default=120)
    parser.add_argument("--duration", type=float, default=360)
    parser.add_argument("--idle", type=float, default=120)
    parser.add_argument("--drain", type=float, default=300)
    parser.add_argument("--poll", type=float, default=10)
    parser.add_argument("--idle-share", type=float, default=0.1)
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--no-anchor", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ours, anchor, parses = [], [], {}
    for n in sizes:
        for kind, runner, out in (("project", run_project, ours), ("anchor", run_anchor, anchor)):
            if kind == "anchor" and args.no_anchor:
                continue
            work = Path(tempfile.mkdtemp(prefix=f"microbatch-fleet-{kind}-{n}-"))
            try:
                result = runner(n, args, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            out.append(result)
            print(kind, {k: v for k, v in result.items() if k != "latencies"}, flush=True)
    work = Path(tempfile.mkdtemp(prefix="microbatch-fleet-parse-"))
    try:
        for n in sizes:
            parses[str(n)] = parse_time(n, work, broken=False)
        parses["1000, one broken"] = parse_time(1000, work, broken=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_doc(args, ours, anchor, parses)
    plot(ours, anchor)


if __name__ == "__main__":
    main()
