"""A fleet of pipelines on one live Airflow, beside Structured Streaming (issue 36).

For each fleet size N (`--sizes`), in one run:

1. **The project.** N pipelines of distinct specs and folders, each with
   `airflow.run_on_data` (the fleet default: no run until data waits), on a
   live Airflow (`tests/plugins/live_airflow.py`: api-server, scheduler,
   dag-processor, triggerer, LocalExecutor with 4 task slots, PostgreSQL;
   Airflow's default loops but the DAG files parsed every `--parse-interval`
   seconds, 300 by default, the fleet setting docs/fleet.md advises), all
   unpaused and parsed at once (`airflow dags reserialize`, as docs/fleet.md
   tells a fleet to). Once per `--engines`: `local`, a driver JVM in each
   task; `connect`, one shared Spark Connect server whose thin clients the
   tasks are (`make airflow ENGINE=connect`); `celery`, that server with the
   CeleryExecutor's two workers (Redis), one of which is SIGKILLed, whole,
   halfway through the landings: its batches are retried on the other once
   their heartbeats are missed, and every pipeline is checked by the
   exactly-once oracle (`tests/conftest.py`'s `assert_exact`).
2. **The anchor.** Structured Streaming with N queries in one driver over
   the same kind of folders and the same landing schedule
   (`anchors/structured_streaming.py --landings`: `ProcessingTime` at the
   watchers' `--poll` interval, RocksDB state, a sink that writes nothing).

Each: once every watcher (query) runs, `--idle` seconds with nothing
arriving, then `--duration` seconds in which each active pipeline (90% of
them) gets a file every `--interval` seconds, the landings spread evenly,
then up to `--drain` seconds for the last files. Measured: latency from a
file landing (its rename) to its batch committed (the ledger row's
`committed_at`; for the anchor, the end of the `foreachBatch` that saw the
file's probe record), and for the project where that time goes; the
machine's CPU over both windows and the project's by part; the cores busy,
peak memory (PSS), batches a minute and the files still waiting when the
window ends; and, apart, the dag-processor's parse of N specs and of 1,000
specs one of which is broken.

Writes docs/fleet.md's "The fleet benchmark" section (or `--section`) and,
for that section, docs/fleet_latency.png.

    .venv/bin/python bench/fleet.py [--sizes 10,50,100,200] [--interval 300] [--duration 300] [--poll 10] [--parse-interval 300]
        [--engines local,connect,celery] [--warm 20] [--no-anchor] [--section HEADING]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from harness import ANCHORS, ROOT, machine_busy, measured_by, numbers, pct, processes, pyplot, save_plot, scratch
from harness import TICK, cpu_s, session_cpu, session_pss, write_section
from tests.plugins.live_airflow import LiveAirflow, session_pids

SECTION = "## The fleet benchmark"
RECORDS_PER_FILE = 200
IDLE_SHARE = 0.1  # of the pipelines get no file
SLOTS = 4  # Airflow's task slots (`[core] parallelism`)
HEARTBEAT_TIMEOUT = 90  # Celery: seconds of missed heartbeats before a killed worker's tasks are retried
ENGINE_LABEL = {
    "local": "project, a JVM a task",
    "connect": "project, one Connect server",
    "celery": "project, one Connect server, Celery (2 workers, one SIGKILLed)",
}


def engines(text: str) -> list[str]:
    """`--engines`: known names, comma-separated (a stray comma is no engine)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ENGINE_LABEL]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'none given'}: use {', '.join(ENGINE_LABEL)}")
    return names


PARTS = ("tasks", "celery-worker-1", "celery-worker-2", "Connect server")  # the CPU table's columns, in order
PARTS += ("scheduler", "api-server", "triggerer", "dag-processor")
Landed = dict[tuple[str, str], float]  # (pipeline, file name): when it landed
Done = dict[tuple[str, str], tuple]  # (pipeline, file name): (committed at, ...)


# -- landings and the windows measured -------------------------------------------------------


def land(folder: Path, wave: int) -> tuple[str, float]:
    """One file of clicks ending with a probe record `probe-<wave>`, written
    under a temporary name and renamed; (its name, the time of the rename)."""
    rng = random.Random(f"{folder.name}-{wave}")
    rows = [
        (f"r{r}", f"user{rng.randrange(50):03d}", round(rng.uniform(0, 100), 2)) for r in range(RECORDS_PER_FILE - 1)
    ]
    rows.append(("probe", f"probe-{wave:05d}", 0.0))
    ts = "2026-11-26T00:00:00Z"
    lines = [
        json.dumps({"event_id": f"{folder.name}-w{wave}-{r}", "user_id": u, "amount": a, "ts": ts}) for r, u, a in rows
    ]
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
    through = sum(landed(name, file) for name, file in files.items())
    print(f"warm-up: {through} of {len(files)} files through", flush=True)


class Sampler(threading.Thread):
    """Peak PSS of the processes of `sessions`, every 2 s."""

    def __init__(self, sessions: set[int]) -> None:
        super().__init__(daemon=True)
        self.sessions, self.peak = sessions, 0
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.wait(2):
            self.peak = max(self.peak, session_pss(self.sessions))

    def stop(self) -> int:
        self._done.set()
        self.join(5)
        return self.peak


class Windows:
    """A fleet run's measured windows, the machine's CPU at their edges (CPU is counted for the whole machine: an
    engine's processes cannot all be followed, a task's JVM outlives it and what init reaps leaves no trace, and the
    metadata database is Airflow's cost too; nothing else runs meanwhile): `--idle` seconds with nothing arriving
    (from now), the landings (`land`), then up to `--drain` seconds for the last files (`drain`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.busy = [machine_busy()]
        time.sleep(args.idle)
        self.busy.append(machine_busy())

    def land(self, landings: Path, active: list[str], sessions: set[int]) -> Landed:
        """Land the plan's files on time, sampling the memory of `sessions`."""
        self.sampler = Sampler(sessions)
        plan = schedule(active, self.args.interval, self.args.duration, first_wave=1 if self.args.warm else 0)
        self.start, self.landed = time.time(), {}
        for offset, name, wave in plan:
            time.sleep(max(0.0, self.start + offset - time.time()))
            file, at = land(landings / name, wave)
            self.landed[name, file] = at
        self.end = time.time()
        self.busy.append(machine_busy())
        return self.landed

    def drain(self, committed: Callable[[], Done], every: float) -> Done:
        """Wait for every landed file's commit, asking `committed()` every `every` seconds."""
        done = committed()
        self.waiting_at_end = sum(1 for key in self.landed if key not in done)
        deadline = time.time() + self.args.drain
        while time.time() < deadline and not all(key in done for key in self.landed):
            time.sleep(every)
            done = committed()
        self.peak = self.sampler.stop()
        return done

    def result(self, n: int, done: Done) -> dict[str, Any]:
        latencies = [done[key][0] - at for key, at in self.landed.items() if key in done]
        (busy0, total0), (busy1, total1), (busy2, total2) = self.busy
        return {
            "n": n,
            "files": len(self.landed),
            "missing": len(self.landed) - len(latencies),
            "p50": pct(latencies, 0.5),
            "p95": pct(latencies, 0.95),
            "max": max(latencies, default=float("nan")),
            "busy_idle": (busy1 - busy0) / (total1 - total0),
            "busy": (busy2 - busy1) / (total2 - total1),
            "cpu_idle_s": (busy1 - busy0) / TICK,
            "idle_s": self.args.idle,
            "cpu_window_s": (busy2 - busy1) / TICK,
            "window_s": self.end - self.start,
            "files_per_minute": len(self.landed) / (self.args.duration / 60),
            "waiting_at_end": self.waiting_at_end,
            "peak_gb": self.peak / 1e9,
            "latencies": latencies,
        }


# -- the project -----------------------------------------------------------------------------


def make_specs(folder: Path, n: int, poll: float) -> list[str]:
    from tests.conftest import oracle_spec_dict, write_spec

    names = [f"fleet_{i:03d}" for i in range(n)]
    for name in names:
        spec = oracle_spec_dict(
            name=name, airflow={"run_on_data": {"poll_seconds": poll}}, checkpoint=f"lake/_checkpoints/{name}"
        )
        spec["source"]["path"], spec["state"]["path"] = f"landing/{name}", f"lake/{name}"
        write_spec(folder, spec, f"{name}.yaml")
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
    home: Path, folder: Path, parse_interval: int, idle_sleep: float | None = None, **executor: Any
) -> LiveAirflow:
    """A live Airflow (not started) over the specs in `folder`, with Airflow's
    default loops rather than the live tests' quick ones: a fleet's settings.
    `parse_interval`: the dag-processor's ``min_file_process_interval``
    (Airflow's default: 30 s; docs/fleet.md tells a fleet to set 300, as `make
    airflow PARSE_INTERVAL=300` does). `idle_sleep`: the scheduler's
    ``scheduler_idle_sleep_time`` (None: Airflow's 1 s). `executor`:
    LiveAirflow's executor keywords (the LocalExecutor by default)."""
    live = LiveAirflow(home, folder, **executor)
    for key in (
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC",
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL",
    ):
        live.env.pop(key, None)
    live.env["AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL"] = str(parse_interval)
    if idle_sleep is not None:
        live.env["AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"] = f"{idle_sleep:g}"
    return live


def running_watchers(live: LiveAirflow) -> int:
    """How many `NewDataEventTrigger`s a triggerer has taken (read from the metadata DB)."""
    import psycopg2

    with psycopg2.connect(live.database.url("airflow")) as connection, connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM trigger WHERE classpath LIKE %s AND triggerer_id IS NOT NULL",
            ("%NewDataEventTrigger",),
        )
        return cursor.fetchone()[0]


def start_watching(live: LiveAirflow, names: list[str], poll: float) -> None:
    """Start `live`, unpause every pipeline and wait until each one's watcher
    runs in the triggerer and has polled twice (its first, full checks done)."""
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


def part_cpu(live: LiveAirflow, server: subprocess.Popen | None) -> dict[str, float]:
    """CPU seconds so far of each part of the project, by session: each
    Airflow component's (a LocalExecutor's workers, the task supervisors and
    the tasks are in the scheduler's session, split off from the scheduler's
    own process as "tasks"; a Celery worker's are in its own session), and
    the Connect server's. Reaped processes count in the process that reaped
    them."""
    parts = {name: session_cpu(proc.pid) for name, proc in zip(live.components, live.procs)}
    if live.executor == "local":
        own = cpu_s(processes().get(live.procs[live.components.index("scheduler")].pid, ["0"] * 15))
        parts["tasks"], parts["scheduler"] = parts["scheduler"] - own, own
    if server is not None:
        parts["Connect server"] = session_cpu(server.pid)
    return parts


def run_project(n: int, args: argparse.Namespace, work: Path, engine: str = "local") -> dict[str, Any]:
    """`engine`: "local", a driver JVM in each task; "connect", one Spark
    Connect server (`dev/airflow.py`'s, as `make airflow ENGINE=connect`
    starts it) whose thin clients the tasks are; "celery", the same server
    with the CeleryExecutor's two workers (the slots between them) running
    the tasks, one of which is SIGKILLed, whole, halfway through the
    landings (`WorkerKill`)."""
    from dev.airflow import _signal_sessions, _start_connect
    from tests.plugins.live_airflow import free_port

    folder = work / "pipelines"
    names = make_specs(folder, n, args.poll)
    spec_of = {name: folder / f"{name}.yaml" for name in names}
    active = names[: max(1, round(n * (1 - IDLE_SHARE)))]
    executor = {"executor": "celery", "workers": 2, "worker_concurrency": SLOTS // 2} if engine == "celery" else {}
    live = fleet_airflow(work / "airflow", folder, args.parse_interval, **executor)
    if engine == "celery":  # the killed worker's tasks are found by their missed heartbeats (Airflow's default: 300 s)
        live.env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"] = str(HEARTBEAT_TIMEOUT)
    live.env["AIRFLOW__CORE__PARALLELISM"] = str(SLOTS)
    live.env["AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG"] = "1"
    server, killer = None, None

    def committed() -> Done:
        return {(name, file): row for name in active for file, row in committed_files(spec_of[name]).items()}

    def through(name: str, file: str) -> bool:
        return file in committed_files(spec_of[name])

    try:
        if engine in ("connect", "celery"):
            server, url = _start_connect(work, free_port())
            live.env["MICROBATCH_SPARK_MASTER"] = url
        start_watching(live, names, args.poll)
        if args.warm:
            warm_up(folder / "landing", active[: args.warm], through, args.drain)
        runs_before = sum(len(live.runs(name)) for name in names)
        windows = Windows(args)
        parts1 = part_cpu(live, server)
        idle_runs = sum(len(live.runs(name)) for name in names) - runs_before
        if engine == "celery":
            killer = WorkerKill(live, "celery-worker-1", args.duration / 2, give_up=max(0.0, args.duration / 2 - 10))
        sessions = {p.pid for p in live.procs} | ({server.pid} if server is not None else set())
        landed = windows.land(folder / "landing", active, sessions)
        parts2 = part_cpu(live, server)
        if killer is not None and killer.cpu is not None:
            parts2["celery-worker-1"] = killer.cpu
        done = windows.drain(committed, every=5)
        runs = {r["dag_run_id"]: r for name in active for r in live.runs(name)}
        # Where a file's time goes: landed to its run queued (the watcher's
        # poll, the triggerer, the scheduler making the run), queued to the
        # batch planned (the scheduler starting the task, the task process
        # and its imports), planned to committed (the batch, JVM included).
        steps: dict[str, list[float]] = {"to_queued": [], "to_planned": [], "to_committed": []}
        for key, at in landed.items():
            committed_at, _, run_id, planned = done.get(key, (None, None, None, None))
            run = runs.get(run_id or "")
            if committed_at is None or run is None or planned is None or not run.get("queued_at"):
                continue
            queued = datetime.fromisoformat(run["queued_at"].replace("Z", "+00:00")).timestamp()
            for step, seconds in zip(steps, (queued - at, planned - queued, committed_at - planned)):
                steps[step].append(seconds)
        committing = {row[2] for row in done.values()}
        in_window = {(name, row[1]) for (name, _), row in done.items() if windows.start <= row[0] <= windows.end}
        # A pipeline with files still waiting is checked as far as it went.
        waiting = {name for name, file in landed if (name, file) not in done}
        exact = sum(1 for name in names if is_exact(spec_of[name], drained=name not in waiting))
        retried = sum(
            1
            for name, run_id in {(name, row[2]) for (name, _), row in done.items()}
            if any(ti["try_number"] > 1 for ti in live.task_instances(name, run_id))
        )
    finally:
        if killer is not None:
            killer.stop()
        live.stop()
        if server is not None:
            _signal_sessions([server.pid], 9)
            server.wait()
    return {
        **windows.result(n, done),
        **{step: (pct(values, 0.5), pct(values, 0.95)) for step, values in steps.items()},
        "engine": engine,
        "idle_runs": idle_runs,
        "empty_runs": sum(1 for run_id, r in runs.items() if r["state"] == "success" and run_id not in committing),
        "exact": exact,
        "retried": retried,
        "killed": killer.killed if killer is not None else 0,
        "killed_mid_task": killer.mid_task if killer is not None else False,
        # The landing window's CPU by part (the rest, PostgreSQL and this script's landings included, is the machine's less these).
        "cpu_parts": {name: parts2[name] - parts1.get(name, 0.0) for name in parts2},
        "batches_per_minute": len(in_window) / (args.duration / 60),
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


def is_exact(spec_path: Path, drained: bool) -> bool:
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


# -- the anchor ------------------------------------------------------------------------------


def run_anchor(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    names = [f"fleet_{i:03d}" for i in range(n)]
    active = names[: max(1, round(n * (1 - IDLE_SHARE)))]
    landings = work / "landing"
    for name in names:
        (landings / name).mkdir(parents=True)
    stop = work / "stop"
    log = open(work / "anchor.log", "w")  # noqa: SIM115 (closed below)
    script = [sys.executable, str(ANCHORS / "structured_streaming.py"), "--interval", str(args.poll)]
    options = ["--landings", landings, "--checkpoint", work / "checkpoints", "--stop-file", stop]
    process = subprocess.Popen(
        [*script, *map(str, options)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
        cwd=ANCHORS,
    )
    seen: dict[tuple[str, str], float] = {}  # (query, probe): when the batch that held it ended
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

    def committed() -> Done:
        probes = {(name, file): (name, f"probe-{int(file[8:13]):05d}") for name, file in windows.landed}
        return {key: (seen[probe],) for key, probe in probes.items() if probe in seen}

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(900):
            raise RuntimeError(f"the anchor's {n} queries did not start: {(work / 'anchor.log').read_text()[-3000:]}")
        time.sleep(args.poll * 2)
        if args.warm:
            warm_up(landings, active[: args.warm], lambda name, file: (name, "probe-00000") in seen, args.drain)
        windows = Windows(args)
        windows.land(landings, active, {process.pid})
        done = windows.drain(committed, every=2)
        if failures:
            raise RuntimeError(f"the anchor failed: {failures[:3]}\n{(work / 'anchor.log').read_text()[-3000:]}")
    finally:
        stop.touch()
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
        log.close()
    return {**windows.result(n, done), "engine": "anchor"}


# -- parsing ---------------------------------------------------------------------------------


PARSE = """
import json, os, sys, time
sys.path[:0] = [{root!r}, {plugins!r}]
os.environ["MICROBATCH_PIPELINES_DIR"] = {folder!r}
from airflow.dag_processing.dagbag import DagBag
started = time.perf_counter()
bag = DagBag(dag_folder={dags!r})
seconds = time.perf_counter() - started
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


# -- report ----------------------------------------------------------------------------------


def machine_cpu(result: dict) -> tuple[float, float]:
    """(CPU-s per file landed, CPU-s per hour while idle), the machine's."""
    return result["cpu_window_s"] / max(result["files"], 1), result["cpu_idle_s"] * 3600 / result["idle_s"]


def order(result: dict) -> tuple[int, int]:
    """By N, then the project's engines, then the anchor."""
    return result["n"], [*ENGINE_LABEL, "anchor"].index(result["engine"])


def retried(result: dict) -> str:
    """Batches retried, and for Celery whether the worker was killed while it ran a task."""
    if result["engine"] != "celery":
        return str(result["retried"])
    killed = (
        f"a worker killed {'mid-task' if result['killed_mid_task'] else 'idle'}"
        if result["killed"]
        else "no worker killed"
    )
    return f"{result['retried']} ({killed})"


def parts_table(ours: list[dict]) -> list[str]:
    """Where the landing window's CPU went, a file's share by part."""
    present = [part for part in PARTS if any(part in r["cpu_parts"] for r in ours)]
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
    for r in sorted(ours, key=order):
        files = max(r["files"], 1)
        cells = [f"{r['cpu_parts'][part] / files:.2f}" if part in r["cpu_parts"] else "" for part in present]
        machine = machine_cpu(r)[0]
        rest = machine - sum(r["cpu_parts"].values()) / files
        lines.append(
            f"| {r['n']} | {ENGINE_LABEL[r['engine']]} | " + " | ".join(cells) + f" | {rest:.2f} | {machine:.2f} |"
        )
    return lines


def write_doc(args: argparse.Namespace, ours: list[dict], anchor: list[dict], parses: dict[str, dict]) -> None:
    cores = os.cpu_count()
    lines = [
        args.section,
        "",
        f"{measured_by('`bench/fleet.py`')}. Each active pipeline ({100 - IDLE_SHARE * 100:.0f}% of N; the rest stay idle) "
        f"got a file of {RECORDS_PER_FILE} clicks every {args.interval:.0f} s for {args.duration:.0f} s, the landings spread evenly"
        + (
            f", after a warm-up: a file each for {args.warm} of the pipelines, landed at once and committed (seen by the anchor) "
            "before the idle window, so that neither engine's first batches (its JIT, its first compiled code) fall in "
            "the measured windows"
            if args.warm
            else ""
        )
        + ". "
        f"The project: `run_on_data` polling every {args.poll:.0f} s, a live Airflow (LocalExecutor, {SLOTS} task "
        f"slots, PostgreSQL, Airflow's default loop settings but the DAG files parsed every {args.parse_interval} s, "
        "the fleet setting), a task per batch, its Spark either a driver JVM in the task "
        "or one shared Spark Connect server (`make airflow ENGINE=connect`). With Celery: that server, and the "
        f"CeleryExecutor's two workers ({SLOTS // 2} slots each, Redis), one of which is SIGKILLed, whole, "
        f"from halfway through the landings as soon as a task has run on it for 1.5 s; its tasks are retried once {HEARTBEAT_TIMEOUT} s of heartbeats are missed "
        "(Airflow's default: 300 s), and every pipeline is checked by the exactly-once oracle. The anchor: Structured "
        f"Streaming, N queries in one driver (`ProcessingTime` every {args.poll:.0f} s, RocksDB, a sink that writes nothing).",
        "",
        "| N | engine | files landed | latency p50 | p95 | max | waiting at window's end | batches/min | CPU-s per file | cores busy | CPU-s per hour while idle (N pipelines; per pipeline) | peak memory (PSS) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(ours + anchor, key=order):
        mine = r["engine"] != "anchor"
        per_file, idle = machine_cpu(r)
        engine, batches = (
            (ENGINE_LABEL[r["engine"]], f"{r['batches_per_minute']:.1f}") if mine else ("Structured Streaming", "")
        )
        lines.append(
            f"| {r['n']} | {engine} | {r['files']} ({r['missing']} {'not committed' if mine else 'not seen'}) | {r['p50']:.1f} s "
            f"| {r['p95']:.1f} s | {r['max']:.1f} s | {r['waiting_at_end']} | {batches} | {per_file:.1f} | "
            f"{r['busy'] * cores:.2f} | {idle:.0f}; {idle / r['n']:.1f} | {r['peak_gb']:.1f} GB |"
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
    for r in sorted(ours, key=order):
        steps = " | ".join(
            f"{r[step][0]:.1f} / {r[step][1]:.1f} s" for step in ("to_queued", "to_planned", "to_committed")
        )
        lines.append(
            f"| {r['n']} | {ENGINE_LABEL[r['engine']]} | {steps} | {r['empty_runs']} | {r['idle_runs']} | {retried(r)} "
            f"| {r['exact']} of {r['n']} |"
        )
    lines += [
        *(parts_table(ours) if ours else []),
        "",
        "Parsing (`dags/microbatch_pipelines.py` and `dags/microbatch_spec_errors.py` in Airflow's DagBag, a fresh process):",
        "",
        "| specs | parse time | DAGs listed | import errors |",
        "|---|---|---|---|",
        *(f"| {label} | {p['seconds']:.2f} s | {p['dags']} | {p['errors']} |" for label, p in parses.items()),
    ]
    if plotted(args, ours + anchor):
        lines += ["", "![latency from a file landing to its batch committed, and cores busy](fleet_latency.png)"]
    write_section("fleet.md", [*lines, ""])


def plotted(args: argparse.Namespace, results: list[dict]) -> bool:
    """Whether to draw the plot: for the full sweep's section (a run of its own, `--section`, draws none over it),
    with two sizes at least (one size's figures are in the tables)."""
    return args.section == SECTION and len({r["n"] for r in results}) > 1


def plot(ours: list[dict], anchor: list[dict]) -> None:
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    series = [
        ([r for r in ours if r["engine"] == engine], ENGINE_LABEL[engine], marker)
        for engine, marker in zip(ENGINE_LABEL, "o^D")
    ]
    series.append((anchor, "Structured Streaming, N queries in one driver", "s"))
    for rows, label, marker in series:
        rows = sorted(rows, key=lambda r: r["n"])
        if not rows:
            continue
        sizes = [r["n"] for r in rows]
        line = left.plot(sizes, [r["p50"] for r in rows], marker=marker, label=f"{label}, p50")[0]
        left.plot(
            sizes,
            [r["p95"] for r in rows],
            marker=marker,
            linestyle="--",
            color=line.get_color(),
            label=f"{label}, p95",
        )
        right.plot(sizes, [r["busy"] * os.cpu_count() for r in rows], marker=marker, label=label)
    left.set_xlabel("pipelines (N)")
    left.set_ylabel("file landed to committed (s)")
    left.legend(fontsize=7)
    right.set_xlabel("pipelines (N)")
    right.set_ylabel("cores busy while files land")
    right.axhline(os.cpu_count(), color="grey", linewidth=0.8)
    right.legend(fontsize=7)
    save_plot(fig, "fleet_latency.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,50,100,200")
    parser.add_argument("--interval", type=float, default=300)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--idle", type=float, default=45)
    parser.add_argument("--drain", type=float, default=200)
    parser.add_argument("--poll", type=float, default=10)
    parser.add_argument(
        "--parse-interval",
        type=int,
        default=300,
        help="the dag-processor's min_file_process_interval, s (the fleet setting of docs/fleet.md; Airflow's default: 30)",
    )
    parser.add_argument(
        "--warm",
        type=int,
        default=0,
        help="before the idle window, a file for this many active pipelines, committed (seen by the anchor) "
        "before anything is measured: the steady state of a fleet that has run a while (0: a cold start)",
    )
    parser.add_argument(
        "--engines",
        type=engines,
        default="local,connect",
        help="the project's engines: local (a JVM a task), connect (one server), celery (one server, "
        "the CeleryExecutor's two workers, one SIGKILLed halfway through the landings)",
    )
    parser.add_argument("--no-anchor", action="store_true")
    parser.add_argument(
        "--section",
        default=SECTION,
        help="the heading of docs/fleet.md's section to write: a run of some sizes or engines apart "
        "writes its own, leaving the full sweep's (and its plot)",
    )
    args = parser.parse_args()
    ours: list[dict] = []
    anchor: list[dict] = []
    for n in numbers(args.sizes):
        runs = [
            (f"project {engine}", lambda n, a, w, e=engine: run_project(n, a, w, e), ours) for engine in args.engines
        ]
        for kind, runner, out in runs + ([] if args.no_anchor else [("anchor", run_anchor, anchor)]):
            with scratch(f"fleet-{kind.replace(' ', '-')}-{n}") as work:
                out.append(runner(n, args, work))
            print(kind, json.dumps({k: v for k, v in out[-1].items() if k != "latencies"}), flush=True)
    with scratch("fleet-parse") as work:
        parses = {str(n): parse_time(n, work, broken=False) for n in sorted(numbers(args.sizes))}
        parses["1000, one broken"] = parse_time(1000, work, broken=True)
    write_doc(args, ours, anchor, parses)
    if plotted(args, ours + anchor):
        plot(ours, anchor)


if __name__ == "__main__":
    main()
