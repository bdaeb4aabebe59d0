"""A fleet of pipelines on one live Airflow, beside Structured Streaming (issue 36).

For each fleet size N (`--sizes`), in one run:

1. **The project.** N pipelines of distinct specs and folders, each with
   `airflow.run_on_data` (the fleet default: no run until data waits), on a
   live Airflow (`tests/plugins/live_airflow.py`: api-server, scheduler,
   dag-processor, triggerer, LocalExecutor with `--parallelism` task slots,
   PostgreSQL; Airflow's default scheduler heartbeat; the DAG files parsed
   every `--parse-interval` seconds, 300 by default, the fleet setting that
   docs/fleet.md advises). All unpaused and parsed at once (`airflow dags
   reserialize`, as docs/fleet.md tells a fleet to); once
   every watcher runs, `--idle` seconds with nothing arriving, then
   `--duration` seconds in which each active pipeline (all but
   `--idle-share` of them) gets a file every `--interval` seconds, the
   landings spread evenly over the interval; then up to `--drain` seconds
   for the last files to be committed. Once per `--engines`: `local`, a
   driver JVM in each task; `connect`, one shared Spark Connect server
   whose thin clients the tasks are (`make airflow ENGINE=connect`);
   `celery`, that server with the CeleryExecutor's two workers (Redis),
   one of which is SIGKILLed, whole, halfway through the landings (once a
   task has run on it for 1.5 s): its
   batches are retried on the other once their heartbeats are missed
   (`--heartbeat-timeout`), and every pipeline is checked by the
   exactly-once oracle (`tests/conftest.py`'s `assert_exact`).
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

Writes docs/fleet.md's "The fleet benchmark" section (or `--section`) and
docs/fleet_latency.png (or `--plot`).

    .venv/bin/python bench/fleet.py [--sizes 10,50,100,200] [--interval 300] [--duration 300] [--poll 10] [--parse-interval 300]
        [--engines local,connect,celery] [--no-anchor] [--merge-log EARLIER_RUN.log] [--section HEADING [--plot PNG]]
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
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "plugins"))

from doc_sections import replace_section  # noqa: E402
from tests.plugins.live_airflow import LiveAirflow, session_pids  # noqa: E402

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


def tree_pss(sessions: set[int]) -> int:
    """Proportional set size (shared pages split among their sharers) of
    every process of `sessions`; a process keeps its session when it is
    orphaned, so a JVM outliving its task still counts."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(pid)
        if not fields or int(fields[3]) not in sessions:
            continue
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot. CPU is counted for the
    whole machine: an engine's processes cannot all be followed (a task's
    JVM outlives it, and what init reaps leaves no trace), and the
    metadata database is Airflow's cost too. Nothing else runs meanwhile."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def part_cpu(live: LiveAirflow, server: subprocess.Popen | None) -> dict[str, float]:
    """CPU seconds so far of each part of the project, by session: each
    Airflow component's (a LocalExecutor's workers, the task supervisors and
    the tasks are in the scheduler's session, split off from the scheduler's
    own process as "tasks"; a Celery worker's are in its own session), and
    the Connect server's. Reaped processes count in the process that reaped
    them."""
    from idle_cost import session_cpu

    parts = {name: session_cpu(proc.pid) for name, proc in zip(live.components, live.procs)}
    if live.executor == "local":
        fields = _stat(str(live.procs[live.components.index("scheduler")].pid)) or ["0"] * 15
        own = sum(int(v) for v in fields[11:15]) / TICK
        parts["tasks"] = parts["scheduler"] - own
        parts["scheduler"] = own
    if server is not None:
        parts["Connect server"] = session_cpu(server.pid)
    return parts


def machine_shares(busy0, busy1, busy2, idle_s: float, window_s: float) -> dict[str, float]:
    """The machine's busy share and CPU seconds over the idle window
    (`busy0` to `busy1`) and the landing window (`busy1` to `busy2`)."""
    return {
        "busy_idle": (busy1[0] - busy0[0]) / (busy1[1] - busy0[1]),
        "busy": (busy2[0] - busy1[0]) / (busy2[1] - busy1[1]),
        "cpu_idle_s": (busy1[0] - busy0[0]) / TICK,
        "idle_s": idle_s,
        "cpu_window_s": (busy2[0] - busy1[0]) / TICK,
        "window_s": window_s,
    }


class Sampler(threading.Thread):
    """Peak PSS of the trees of `sessions`, every 2 s."""

    def __init__(self, sessions: set[int]) -> None:
        super().__init__(daemon=True)
        self.sessions = sessions
        self.peak = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(2):
            self.peak = max(self.peak, tree_pss(self.sessions))

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


def schedule(active: list[str], interval: float, duration: float, first_wave: int = 0) -> list[tuple[float, str, int]]:
    """(offset in seconds, pipeline, wave) of every landing: each active
    pipeline every `interval`, the pipelines spread evenly over it; waves
    numbered from `first_wave` (after a warm-up's wave 0)."""
    plan = []
    for k, name in enumerate(active):
        offset, wave = k * interval / len(active), first_wave
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


def warm_up(landings: Path, names: list[str], landed: Callable[[str, str], bool], give_up: float) -> None:
    """Land wave 0 for `names` at once and wait until `landed(name, file)`
    says each is through (or `give_up` seconds): the engine's first
    batches (its JIT, its first compilations, the workers' first tasks)
    then fall before the measured window, as in a fleet that has been
    running for a while. A warm-up file sorts before the window's."""
    files = {name: land(landings / name, 0)[0] for name in names}
    deadline = time.time() + give_up
    while time.time() < deadline and not all(landed(name, file) for name, file in files.items()):
        time.sleep(2)
    through = sum(1 for name, file in files.items() if landed(name, file))
    print(f"warm-up: {through} of {len(files)} files through", flush=True)


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


def fleet_airflow(
    home: Path, folder: Path, parse_interval: int | None = None, idle_sleep: float | None = None, **executor: Any
) -> LiveAirflow:
    """A live Airflow (not started) over the specs in `folder`, with Airflow's
    default loops rather than the live tests' quick ones: a fleet's settings.
    `parse_interval`: the dag-processor's ``min_file_process_interval``
    (None: Airflow's 30 s; docs/fleet.md tells a fleet to set 300, as `make
    airflow PARSE_INTERVAL=300` does). `idle_sleep`: the scheduler's
    ``scheduler_idle_sleep_time`` (None: Airflow's 1 s; `make airflow
    SCHEDULER_IDLE_SLEEP=...`). `executor`: LiveAirflow's executor keywords
    (the LocalExecutor by default)."""
    live = LiveAirflow(home, folder, **executor)
    for key in ("AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC", "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC", "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL"):
        live.env.pop(key, None)
    if parse_interval is not None:
        live.env["AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL"] = str(parse_interval)
    if idle_sleep is not None:
        live.env["AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"] = f"{idle_sleep:g}"
    return live


def start_watching(live: LiveAirflow, names: list[str], poll: float) -> None:
    """Start `live`, unpause every pipeline and wait until each one's watcher
    runs in the triggerer and has polled twice."""
    from idle_cost import running_watchers

    live.start()
    for name in names:
        live.wait_for_dag(name, timeout=900)
    for name in names:
        live.unpause(name)
    # A watcher is registered by a parse of its unpaused DAG: what
    # docs/fleet.md tells a fleet to run after unpausing, rather than wait
    # for the next parse (up to the parse interval).
    live.airflow("dags", "reserialize", timeout=900).check_returncode()
    live.wait(lambda: running_watchers(live) == len(names), 900, "every watcher to run in the triggerer")
    time.sleep(poll * 2)


def run_project(n: int, args: argparse.Namespace, work: Path, engine: str = "local") -> dict[str, Any]:
    """`engine`: "local", a driver JVM in each task; "connect", one Spark
    Connect server (`dev/airflow.py`'s, as `make airflow ENGINE=connect`
    starts it) whose thin clients the tasks are; "celery", the same server
    with the CeleryExecutor's two workers (`--parallelism` slots between
    them) running the tasks, one of which is SIGKILLed, whole, halfway
    through the landings (`WorkerKill`)."""
    from dev.airflow import _signal_sessions, _start_connect
    from tests.plugins.live_airflow import free_port

    folder = work / "pipelines"
    names = make_specs(folder, n, args.poll)
    active = names[: max(1, round(n * (1 - args.idle_share)))]
    if engine == "celery":
        live = fleet_airflow(work / "airflow", folder, args.parse_interval, args.idle_sleep, executor="celery", workers=2,
                             worker_concurrency=max(1, args.parallelism // 2))
        # The killed worker's tasks are found by their missed heartbeats:
        # after `--heartbeat-timeout` seconds (Airflow's default is 300).
        live.env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"] = str(int(args.heartbeat_timeout))
    else:
        live = fleet_airflow(work / "airflow", folder, args.parse_interval, args.idle_sleep)
    live.env["AIRFLOW__CORE__PARALLELISM"] = str(args.parallelism)
    live.env["AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG"] = "1"
    server, killer = None, None
    try:
        if engine in ("connect", "celery"):
            server, url = _start_connect(work, free_port())
            live.env["MICROBATCH_SPARK_MASTER"] = url
        start_watching(live, names, args.poll)
        spec_of = {name: folder / f"{name}.yaml" for name in names}
        if args.warm:
            warm_up(folder / "landing", active[: args.warm], lambda name, file: file in committed_files(spec_of[name]), args.drain)
        runs_before = sum(len(live.runs(name)) for name in names)
        sessions = {p.pid for p in live.procs} | ({server.pid} if server is not None else set())
        busy0 = machine_busy()
        time.sleep(args.idle)
        busy1 = machine_busy()
        parts1 = part_cpu(live, server)
        idle_runs = sum(len(live.runs(name)) for name in names) - runs_before
        window_start = time.time()
        sampler = Sampler(sessions)
        sampler.start()
        plan = schedule(active, args.interval, args.duration, first_wave=1 if args.warm else 0)
        if engine == "celery":
            killer = WorkerKill(live, "celery-worker-1", args.duration / 2, give_up=max(0.0, args.duration / 2 - 10))
        landed = run_landings(folder / "landing", plan)
        window_end = time.time()
        busy2 = machine_busy()
        parts2 = part_cpu(live, server)
        if killer is not None and killer.cpu is not None:
            parts2["celery-worker-1"] = killer.cpu
        at_end = {name: committed_files(spec_of[name]) for name in active}
        waiting_at_end = sum(1 for (name, file) in landed if file not in at_end[name])
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
        batches_in_window = sum(len({v[1] for v in done[name].values() if window_start <= v[0] <= window_end}) for name in active)
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
        committing = {v[2] for name in active for v in done[name].values()}
        empty_runs = sum(1 for run_id, r in runs.items() if r["state"] == "success" and run_id not in committing)
        # A pipeline with files still waiting is checked as far as it went.
        waiting = {name for name, file in landed if file not in done[name]}
        exact = sum(1 for name in names if _is_exact(spec_of[name], drained=name not in waiting))
        retried = sum(1 for name in active for run_id in {v[2] for v in done[name].values()}
                      if any(ti["try_number"] > 1 for ti in live.task_instances(name, run_id)))
    finally:
        if killer is not None:
            killer.stop()
        live.stop()
        if server is not None:
            _signal_sessions([server.pid], 9)
            server.wait()
    minutes = args.duration / 60
    return {
        "n": n,
        "engine": engine,
        "parse_interval": args.parse_interval,
        "idle_sleep": args.idle_sleep,
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
        "exact": exact,
        "retried": retried,
        "killed": killer.killed if killer is not None else 0,
        "killed_mid_task": killer.mid_task if killer is not None else False,
        # The window's CPU by part (the rest, PostgreSQL and this script's landings included, is the machine's less these).
        "cpu_parts": {name: parts2[name] - parts1.get(name, 0.0) for name in parts2},
        **machine_shares(busy0, busy1, busy2, args.idle, window_end - window_start),
        "batches_per_minute": batches_in_window / minutes,
        "files_per_minute": len(landed) / minutes,
        "waiting_at_end": waiting_at_end,
        "peak_gb": peak / 1e9,
        "latencies": latencies,
    }


class WorkerKill(threading.Thread):
    """SIGKILL every process of the Celery worker `name` (its pool, the task
    supervisors, the tasks), as a lost machine would: `after` seconds from
    now, once the worker runs a task (a process its session did not have
    when idle has lived `SETTLED` seconds: a task killed between its fork
    and its start would wait in QUEUED for `[scheduler] task_queued_timeout`,
    not be found by its heartbeats), or `give_up` seconds later regardless.
    `killed` says how many processes went, `mid_task` whether a task ran,
    `cpu` the session's CPU seconds just before (the reaped pool's CPU
    leaves the session with it)."""

    SETTLED = 1.5

    def __init__(self, live: LiveAirflow, name: str, after: float, give_up: float) -> None:
        super().__init__(daemon=True)
        self.session = live.procs[live.components.index(name)].pid
        self.idle = set(session_pids(self.session))
        self.after, self.give_up = after, give_up
        self.killed, self.mid_task, self.cpu = 0, False, None
        self._cancelled = threading.Event()
        self.start()

    def run(self) -> None:
        from idle_cost import session_cpu
        from tests.plugins.live_airflow import kill_session

        if self._cancelled.wait(self.after):
            return
        deadline, first_seen = time.time() + self.give_up, {}
        while time.time() < deadline:
            now = time.time()
            first_seen = {pid: first_seen.get(pid, now) for pid in session_pids(self.session) if pid not in self.idle}
            self.mid_task = any(now - seen >= self.SETTLED for seen in first_seen.values())
            if self.mid_task or self._cancelled.wait(0.2):
                break
        if not self._cancelled.is_set():
            self.cpu = session_cpu(self.session)
            self.killed = kill_session(self.session)

    def stop(self) -> None:
        """Cancel a kill not yet made, and wait for one under way."""
        self._cancelled.set()
        self.join()


def _is_exact(spec_path: Path, drained: bool) -> bool:
    """Whether the pipeline passes the exactly-once oracle (tests/conftest.py's
    `assert_exact`): contiguous lineage, every landed file consumed once, the
    state equal to their fold."""
    from tests.conftest import assert_exact

    try:
        assert_exact(spec_path, drained=drained)
    except AssertionError as failure:
        print(f"not exact: {spec_path.stem}: {failure}", flush=True)
        return False
    return True


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

    failures: list[str] = []

    def read() -> None:
        for line in process.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                failures.append(f"not a record: {line!r}")
                continue
            if "ready" in record:
                ready.set()
            elif "probe" in record:
                seen.setdefault((record["query"], record["probe"]), record["at"])
            elif "failed" in record:
                failures.append(f"queries failed: {record}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(900):
            raise RuntimeError(f"the anchor's {n} queries did not start: {(work / 'anchor.log').read_text()[-3000:]}")
        time.sleep(args.poll * 2)
        if args.warm:
            warm_up(landings, active[: args.warm], lambda name, file: (name, "probe-00000") in seen, args.drain)
        busy0 = machine_busy()
        time.sleep(args.idle)
        busy1 = machine_busy()
        sampler = Sampler(sessions)
        sampler.start()
        plan = schedule(active, args.interval, args.duration, first_wave=1 if args.warm else 0)
        window_start = time.time()
        landed = run_landings(landings, plan)
        window_end = time.time()
        busy2 = machine_busy()
        probe_of = {(name, file): f"probe-{int(file[8:13]):05d}" for name, file in landed}
        waiting_at_end = sum(1 for key in landed if (key[0], probe_of[key]) not in seen)
        deadline = time.time() + args.drain
        while time.time() < deadline and any((key[0], probe_of[key]) not in seen for key in landed):
            time.sleep(2)
        peak = sampler.stop()
        if failures:
            raise RuntimeError(f"the anchor failed: {failures[:3]}\n{(work / 'anchor.log').read_text()[-3000:]}")
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
        **machine_shares(busy0, busy1, busy2, args.idle, window_end - window_start),
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


ENGINE_LABEL = {"local": "project, a JVM a task", "connect": "project, one Connect server",
                "celery": "project, one Connect server, Celery (2 workers, one SIGKILLed)"}


def machine_cpu(result: dict, args: argparse.Namespace) -> tuple[float, float]:
    """(CPU-s per file landed, CPU-s per hour while idle), the machine's.
    Results printed before these fields existed carry the busy shares only:
    times the cores and the window's nominal length."""
    cores = os.cpu_count()
    window = result.get("cpu_window_s", result["busy"] * cores * args.duration)
    idle = result.get("cpu_idle_s", result["busy_idle"] * cores * args.idle)
    return window / max(result["files"], 1), idle * 3600 / result.get("idle_s", args.idle)


PARTS = ("tasks", "celery-worker-1", "celery-worker-2", "Connect server", "scheduler", "api-server", "triggerer", "dag-processor")


def _parts_table(ours: list[dict], args: argparse.Namespace) -> list[str]:
    """Where the landing window's CPU went, a file's share by part: the
    rows whose results have it (results printed before it existed have not)."""
    rows = [r for r in ours if "cpu_parts" in r]
    if not rows:
        return []
    present = [part for part in PARTS if any(part in r["cpu_parts"] for r in rows)]
    lines = [
        "",
        "Where the landing window's CPU went, in CPU-s per file landed, by session: `tasks` are the LocalExecutor's "
        "workers, the task supervisors and the tasks apart from the scheduler's own process (a task's own JVM counts "
        "there once its task reaped it, else in the rest); a Celery worker's tasks are in its row; the rest is "
        "PostgreSQL, this script's landings and the machine's other processes:",
        "",
        "| N | engine | " + " | ".join(present) + " | the rest | machine |",
        "|---|---|" + "---|" * (len(present) + 2),
    ]
    for r in sorted(rows, key=lambda r: (r["n"], list(ENGINE_LABEL).index(r.get("engine", "local")))):
        files = max(r["files"], 1)
        cells = [f"{r['cpu_parts'][part] / files:.2f}" if part in r["cpu_parts"] else "" for part in present]
        machine = machine_cpu(r, args)[0]
        lines.append(f"| {r['n']} | {ENGINE_LABEL[r['engine']]} | " + " | ".join(cells)
                     + f" | {machine - sum(r['cpu_parts'].values()) / files:.2f} | {machine:.2f} |")
    return lines


def _retried_cell(result: dict) -> str:
    """Batches retried, and for Celery whether the worker was killed while it ran a task."""
    if "retried" not in result:
        return "n/a"
    if result.get("engine") != "celery":
        return str(result["retried"])
    if not result.get("killed"):
        return f"{result['retried']} (no worker killed)"
    if "killed_mid_task" not in result:
        return f"{result['retried']} (a worker killed)"
    return f"{result['retried']} (a worker killed {'mid-task' if result['killed_mid_task'] else 'idle'})"


def _exact_cell(result: dict) -> str:
    """"k of N" by the oracle; "n/a" for results printed before the check existed."""
    return f"{result['exact']} of {result['n']}" if "exact" in result else "n/a"


def write_doc(args: argparse.Namespace, ours: list[dict], anchor: list[dict], parses: dict[str, dict]) -> None:
    cores = os.cpu_count()
    lines = [
        args.section,
        "",
        f"Measured by `bench/fleet.py` on {platform.machine()}, {cores} cores, Python {platform.python_version()}, "
        f"{date.today().isoformat()}. Each active pipeline ({100 - args.idle_share * 100:.0f}% of N; the rest stay idle) "
        f"got a file of {RECORDS_PER_FILE} clicks every {args.interval:.0f} s for {args.duration:.0f} s, the landings spread evenly"
        + (f", after a warm-up: a file each for {args.warm} of the pipelines, landed at once and committed (seen by the anchor) "
           "before the idle window, so that neither engine's first batches (its JIT, its first compiled code) fall in "
           "the measured windows" if args.warm else "") + ". "
        f"The project: `run_on_data` polling every {args.poll:.0f} s, a live Airflow (LocalExecutor, {args.parallelism} task "
        f"slots, PostgreSQL, Airflow's default loop settings but the DAG files parsed every {args.parse_interval} s, "
        "the fleet setting" + (f", and the scheduler's idle sleep at {args.idle_sleep:g} s" if args.idle_sleep else "")
        + "), a task per batch, its Spark either a driver JVM in the task "
        "or one shared Spark Connect server (`make airflow ENGINE=connect`). With Celery: that server, and the "
        f"CeleryExecutor's two workers ({max(1, args.parallelism // 2)} slots each, Redis), one of which is SIGKILLed, whole, "
        f"from halfway through the landings as soon as a task has run on it for 1.5 s; its tasks are retried once {args.heartbeat_timeout:.0f} s of heartbeats are missed "
        "(Airflow's default: 300 s), and every pipeline is checked by the exactly-once oracle. The anchor: Structured "
        f"Streaming, N queries in one driver (`ProcessingTime` every {args.poll:.0f} s, RocksDB, a sink that writes nothing).",
        "",
        "| N | engine | files landed | latency p50 | p95 | max | waiting at window's end | batches/min | CPU-s per file | cores busy | CPU-s per hour while idle (N pipelines; per pipeline) | peak memory (PSS) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["n"] for r in ours + anchor}):
        for mine in sorted((r for r in ours if r["n"] == n), key=lambda r: list(ENGINE_LABEL).index(r.get("engine", "local"))):
            lines.append(
                f"| {n} | {ENGINE_LABEL[mine.get('engine', 'local')]} | {mine['files']} ({mine['missing']} not committed) | "
                f"{mine['p50']:.1f} s | {mine['p95']:.1f} s | {mine['max']:.1f} s | {mine['waiting_at_end']} | "
                f"{mine['batches_per_minute']:.1f} | {machine_cpu(mine, args)[0]:.1f} | "
                f"{mine['busy'] * cores:.2f} | {machine_cpu(mine, args)[1]:.0f}; {machine_cpu(mine, args)[1] / n:.1f} | {mine['peak_gb']:.1f} GB |"
            )
        for theirs in (r for r in anchor if r["n"] == n):
            lines.append(
                f"| {n} | Structured Streaming | {theirs['files']} ({theirs['missing']} not seen) | {theirs['p50']:.1f} s | "
                f"{theirs['p95']:.1f} s | {theirs['max']:.1f} s | {theirs['waiting_at_end']} | | "
                f"{machine_cpu(theirs, args)[0]:.1f} | {theirs['busy'] * cores:.2f} | "
                f"{machine_cpu(theirs, args)[1]:.0f}; {machine_cpu(theirs, args)[1] / n:.1f} | {theirs['peak_gb']:.1f} GB |"
            )
    lines += [
        "",
        "CPU is the machine's, all processes (Airflow's components, PostgreSQL, tasks, JVMs, the Connect server; the "
        "anchor's driver; this script's landings): CPU-s per file is the landing window's over the files landed, and "
        "while idle it is what N pipelines with nothing arriving cost, Airflow's own fixed cost included (what one "
        "idle pipeline adds is in \"An idle pipeline\" above). Peak memory: the engine's processes' proportional set "
        "size, sampled every 2 s. Where a file's time goes in the "
        "project, p50 / p95: from landing to its DAG run queued (the watcher's poll, the triggerer, the scheduler "
        "making the run), from queued to the batch planned (the scheduler starting the task, the task process and "
        "its imports), and from planned to committed (the batch, its JVM or Connect session included); and the runs "
        "that found nothing:",
        "",
        "| N | engine | landed to run queued | queued to planned | planned to committed | runs that found nothing | runs while idle | batches retried | pipelines exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mine in sorted(ours, key=lambda r: (r["n"], list(ENGINE_LABEL).index(r.get("engine", "local")))):
        lines.append(
            f"| {mine['n']} | {ENGINE_LABEL[mine.get('engine', 'local')]} | {mine['to_queued'][0]:.1f} / {mine['to_queued'][1]:.1f} s | "
            f"{mine['to_planned'][0]:.1f} / {mine['to_planned'][1]:.1f} s | {mine['to_committed'][0]:.1f} / "
            f"{mine['to_committed'][1]:.1f} s | {mine['empty_runs'] if mine['empty_runs'] >= 0 else 'n/a'} | {mine['idle_runs']} | "
            f"{_retried_cell(mine)} | {_exact_cell(mine)} |"
        )
    lines += _parts_table(ours, args)
    lines += [
        "",
        "Parsing (`dags/microbatch_pipelines.py` and `dags/microbatch_spec_errors.py` in Airflow's DagBag, a fresh process):",
        "",
        "| specs | parse time | DAGs listed | import errors |",
        "|---|---|---|---|",
    ]
    for label, parse in parses.items():
        lines.append(f"| {label} | {parse['seconds']:.2f} s | {parse['dags']} | {parse['errors']} |")
    if _plotted(args, ours, anchor):
        lines += ["", f"![latency from a file landing to its batch committed, and cores busy]({args.plot.name})"]
    lines.append("")
    if not DOC.exists():
        DOC.write_text("# A fleet of pipelines on one Airflow (issue 36)\n\nFigures from `bench/` scripts, each from one run.\n")
    replace_section(DOC, args.section, lines)
    print("\n".join(lines))


def _plotted(args: argparse.Namespace, ours: list[dict], anchor: list[dict]) -> bool:
    """Whether to draw the plot: where there is one to draw to, and two
    sizes at least (one size's figures are in the tables)."""
    return args.plot is not None and len({r["n"] for r in ours + anchor}) > 1


def plot(ours: list[dict], anchor: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    series = [([r for r in ours if r.get("engine", "local") == engine], ENGINE_LABEL[engine], marker)
              for engine, marker in (("local", "o"), ("connect", "^"), ("celery", "D"))]
    series.append((anchor, "Structured Streaming, N queries in one driver", "s"))
    for rows, label, marker in series:
        rows = sorted(rows, key=lambda r: r["n"])
        if not rows:
            continue
        sizes = [r["n"] for r in rows]
        line = left.plot(sizes, [r["p50"] for r in rows], marker=marker, label=f"{label}, p50")[0]
        left.plot(sizes, [r["p95"] for r in rows], marker=marker, linestyle="--", color=line.get_color(), label=f"{label}, p95")
        right.plot(sizes, [r["busy"] * os.cpu_count() for r in rows], marker=marker, label=label)
    left.set_xlabel("pipelines (N)")
    left.set_ylabel("file landed to committed (s)")
    left.legend(fontsize=7)
    right.set_xlabel("pipelines (N)")
    right.set_ylabel("cores busy while files land")
    right.axhline(os.cpu_count(), color="grey", linewidth=0.8)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def earlier_results(log: Path) -> tuple[list[dict], list[dict]]:
    """The results an earlier run of this script printed (`project {...}`,
    `anchor {...}` lines), to report beside this run's: sizes or engines
    measured apart, each still in one run with its anchor."""
    found: dict[tuple[str, int, str], dict] = {}  # the newest result per (kind, N, engine)
    for line in log.read_text().splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("project", "anchor") and rest.startswith("{"):
            try:
                result = json.loads(rest)
            except ValueError:  # printed as a Python dict, before results were JSON
                result = eval(rest, {"__builtins__": {}}, {"nan": float("nan"), "inf": float("inf")})
            found[(kind, result["n"], result.get("engine", "local"))] = result
    return ([r for (kind, _, _), r in found.items() if kind == "project"],
            [r for (kind, _, _), r in found.items() if kind == "anchor"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,50,100,200")
    parser.add_argument("--interval", type=float, default=300)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--idle", type=float, default=45)
    parser.add_argument("--drain", type=float, default=200)
    parser.add_argument("--poll", type=float, default=10)
    parser.add_argument("--parse-interval", type=int, default=300,
                        help="the dag-processor's min_file_process_interval, s (the fleet setting of docs/fleet.md; Airflow's default: 30)")
    parser.add_argument("--idle-sleep", type=float, default=None,
                        help="the scheduler's scheduler_idle_sleep_time, s (default: Airflow's 1)")
    parser.add_argument("--idle-share", type=float, default=0.1)
    parser.add_argument("--warm", type=int, default=0,
                        help="before the idle window, a file for this many active pipelines, committed (seen by the anchor) "
                             "before anything is measured: the steady state of a fleet that has run a while (0: a cold start)")
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--engines", default="local,connect",
                        help="the project's engines: local (a JVM a task), connect (one server), celery (one server, "
                             "the CeleryExecutor's two workers, one SIGKILLed halfway through the landings)")
    parser.add_argument("--heartbeat-timeout", type=float, default=90,
                        help="celery: seconds of missed heartbeats before the killed worker's tasks are retried")
    parser.add_argument("--no-anchor", action="store_true")
    parser.add_argument("--merge-log", type=Path, action="append", default=[],
                        help="report an earlier run's results (its printed lines) beside this run's; it must have had the same "
                             "settings (repeatable; the newest result per size and engine wins)")
    parser.add_argument("--section", default=SECTION,
                        help="the heading of docs/fleet.md's section to write: a run of some sizes or engines apart "
                             "writes its own, leaving the full sweep's")
    parser.add_argument("--plot", type=Path, help=f"where to draw the latency plot (the full sweep's section: {PLOT.relative_to(ROOT)}; "
                             "a --section of its own draws none unless given one)")
    parser.add_argument("--report-only", action="store_true", help="measure nothing: report the --merge-log results")
    args = parser.parse_args()
    if args.plot is None and args.section == SECTION:
        args.plot = PLOT  # a section of its own draws no plot unless given one: the sweep's is not drawn over
    ours, anchor = [], []
    for log in args.merge_log:
        earlier = earlier_results(log)
        ours = [r for r in ours if (r["n"], r.get("engine", "local")) not in {(e["n"], e.get("engine", "local")) for e in earlier[0]}]
        anchor = [r for r in anchor if r["n"] not in {e["n"] for e in earlier[1]}]
        ours, anchor = ours + earlier[0], anchor + earlier[1]
    sizes = [] if args.report_only else [int(s) for s in args.sizes.split(",")]
    parses: dict[str, dict] = {}
    for n in sizes:
        runs = [("project", lambda n, a, w, e=engine: run_project(n, a, w, e), ours) for engine in args.engines.split(",") if engine]
        if not args.no_anchor:
            runs.append(("anchor", run_anchor, anchor))
        for kind, runner, out in runs:
            work = Path(tempfile.mkdtemp(prefix=f"microbatch-fleet-{kind}-{n}-"))
            try:
                result = runner(n, args, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            out.append(result)
            print(kind, json.dumps({k: v for k, v in result.items() if k != "latencies"}), flush=True)
    work = Path(tempfile.mkdtemp(prefix="microbatch-fleet-parse-"))
    try:
        for n in sorted({r["n"] for r in ours + anchor}):
            parses[str(n)] = parse_time(n, work, broken=False)
        parses["1000, one broken"] = parse_time(1000, work, broken=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_doc(args, ours, anchor, parses)
    if _plotted(args, ours, anchor):
        plot(ours, anchor, args.plot)


if __name__ == "__main__":
    main()
