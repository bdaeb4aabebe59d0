"""Micro-batches against continuous snapshots, measured on one stream.

The same click stream goes through the project (a micro-batch per scheduled
run, offsets and state committed together in Delta) and through a Flink job
(continuous processing, barrier snapshots every N seconds, an exactly-once
file sink). Files land in a folder at a steady rate, each ending with a probe
record for a user of its own (`probe-<n>`), so "visible" means the same for
both: the probe, and therefore the whole file before it, is in what a reader
can query (the project's Delta state table; the Flink sink's committed part
files). A poller looks every 0.1 s.

Measured, in order:

1. latency from a file landing to its records being queryable, the project at
   several schedule intervals (a new process per run, as an Airflow task, and
   once on a warm Spark Connect server), Flink at several checkpoint intervals;
   CPU-seconds of each phase (whole process trees, reaped as a subreaper), and
   the size and duration of each commit or checkpoint;
2. what each costs while idle: a run that finds nothing new, and a running
   Flink job with nothing to read;
3. throughput and CPU over a backlog of a million records (one batch; a
   bounded Flink run);
4. recovery after `kill -9` in the middle of the work: time to be caught up
   again, and how much work is done twice;
5. after every phase, the same oracle (`spark_jobs.demo.clickstream.fold` of
   the landed files) against the project's state and Flink's folded output.

Writes docs/micro-batch-vs-continuous.md's "Measured" section and plots
(docs/continuous_*.png).

    .venv/bin/python bench/continuous.py [--window 90] [--intervals 10,20,40] [--checkpoints 1,5,10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import FLINK_PYTHON, ROOT, become_subreaper, children_cpu, event_at, flink_args, flink_bounded
from harness import (
    measured_by,
    microbatch,
    pct,
    pyplot,
    reap_orphans,
    save_plot,
    scratch,
    tree_cpu,
    write_section,
    write_spec,
)

from flink_state import Tail, fold_output  # (anchors/: plain Python, no Flink import)
from spark_jobs.demo.clickstream import ORACLE_MERGE, ORACLE_TRANSFORM, Totals, differences, fold, write_wave

RECORDS_PER_FILE = 5_000
LAND_EVERY_S = 2.0
USERS = 100_000
Look = Callable[[list[str]], set[str]]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# -- the stream ------------------------------------------------------------------------------


class Stream:
    """Lands a file of click records every `every` seconds (atomically: a hidden
    temp name, then a rename), its last line a probe for a user of its own."""

    def __init__(self, folder: Path, seed: int, every: float = LAND_EVERY_S) -> None:
        self.landing, self.staging, self.seed, self.every = folder / "landing", folder / "staging", seed, every
        self.landed: dict[str, float] = {}  # probe user -> time its file landed
        self.records = 0  # landed, probes included
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.landing.mkdir(parents=True, exist_ok=True)

    def land(self, n: int, records: int = RECORDS_PER_FILE) -> str:
        [made] = write_wave(self.staging, n, files=1, records_per_file=records, users=USERS, seed=self.seed)
        probe = f"probe-{self.seed}-{n:05d}"
        line = json.dumps({"event_id": probe, "user_id": probe, "amount": 1.0, "ts": "2026-01-01T00:00:00Z"})
        text = made.read_text(encoding="utf-8") + line + "\n"
        made.unlink()
        target = self.landing / f"clicks-{self.seed}-{n:05d}.json"
        temp = self.landing / f".{target.name}.tmp"
        temp.write_text(text, encoding="utf-8")
        os.replace(temp, target)
        self.landed[probe] = time.time()
        self.records += records + 1
        return probe

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        n, next_at = len(self.landed), time.monotonic()
        while not self._stop.is_set():
            self.land(n)
            n += 1
            next_at += self.every
            self._stop.wait(max(0.0, next_at - time.monotonic()))


def backlog(folder: Path, files: int, seed: int) -> Stream:
    stream = Stream(folder, seed=seed)
    for n in range(files):
        stream.land(n, records=50_000)
    return stream


class Visibility:
    """Polls what a reader can query every 0.1 s and notes when each probe first shows."""

    def __init__(self, probes: dict[str, float], look: Look) -> None:
        self.probes, self.look = probes, look
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pending = [p for p in list(self.probes) if p not in self.seen]
            if pending:
                now = time.time()
                for probe in self.look(pending):
                    self.seen.setdefault(probe, now)
            self._stop.wait(0.1)

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p in self.seen for p in list(self.probes)):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def latencies(self) -> list[float]:
        return [self.seen[p] - t for p, t in self.probes.items() if p in self.seen]


def delta_probes(state_path: Path) -> Look:
    """A `look` for the project: probes present in the state table (read only when its version moved)."""
    from spark_jobs.core.delta_io import open_table, read_all

    last: dict[str, Any] = {"version": -1, "keys": set()}

    def look(pending: list[str]) -> set[str]:
        table = open_table(str(state_path))
        if table is None:
            return set()
        if table.version() != last["version"]:
            rows = read_all(table, where="user_id LIKE 'probe-%'", columns=("user_id",))
            last["version"], last["keys"] = table.version(), set(rows.column("user_id").to_pylist())
        return last["keys"] & set(pending)

    return look


def flink_probes(out: Path) -> Look:
    tail = Tail(out)

    def look(pending: list[str]) -> set[str]:
        tail.poll()
        return {p for p in pending if p in tail.state}

    return look


def oracle_check(landing: Path, actual: dict[str, Totals]) -> list[str]:
    return differences(fold(sorted(landing.glob("*.json"))), actual)


def flink_totals(out: Path) -> dict[str, Totals]:
    return {u: Totals(a.events, a.amount, a.idhash, a.last_seen) for u, a in fold_output(out).items()}


# -- the project -----------------------------------------------------------------------------


def project_spec(folder: Path) -> Path:
    state = {"path": "lake/state", "keys": ["user_id"], "merge": ORACLE_MERGE}
    return write_spec(folder, "continuous_clicks", transform=ORACLE_TRANSFORM, state=state)


def project_totals(spec: Path) -> dict[str, Totals]:
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import state_totals

    return state_totals(load_spec(spec))


def project_run(spec: Path, remote: str | None = None) -> dict[str, Any]:
    """`microbatch run` in a new process: its outcome, wall seconds and the bytes it added to the lake."""
    before = dir_bytes(spec.parent / "lake")
    took, stdout = microbatch(spec, *(["--master", remote] if remote else []))
    return {**json.loads(stdout), "wall_s": took, "bytes": dir_bytes(spec.parent / "lake") - before}


def killed_run(spec: Path, after: float) -> float:
    """`microbatch run` SIGKILLed, its whole process group, `after` seconds into it; when, from its start."""
    started = time.time()
    command = [sys.executable, "-m", "spark_jobs", "-q", "run", str(spec), "--json"]
    child = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True
    )
    try:
        child.wait(after)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return time.time() - started
    raise RuntimeError(f"the run ended before the kill at {after} s")


def project_latency(
    work: Path, interval: float, window: float, remote: str | None = None, server: int = 0
) -> dict[str, Any]:
    """Runs started every `interval` s (one at a time, as `max_active_runs=1`) while files land for `window` s.
    With `remote`, the Spark Connect server's process (`server`) is counted too, idle time included."""
    folder = work / f"project-{interval:g}{'-connect' if remote else ''}"
    spec = project_spec(folder)
    stream = Stream(folder, seed=int(interval * 10) + (1 if remote else 0))
    visible = Visibility(stream.landed, delta_probes(folder / "lake" / "state"))
    reap_orphans()
    cpu0 = children_cpu() - (tree_cpu(server) if server else 0.0)
    runs: list[dict[str, Any]] = []
    stream.start()
    begun = time.monotonic()
    stopped = False
    try:
        next_run = begun + interval
        while True:
            time.sleep(max(0.0, next_run - time.monotonic()))
            if not stopped and time.monotonic() - begun >= window:
                stream.stop()
                stopped = True
            runs.append(project_run(spec, remote))
            reap_orphans()
            if stopped and runs[-1]["status"] == "no_new_data":
                break
            next_run = max(next_run + interval, time.monotonic())
    finally:
        if not stopped:
            stream.stop()
    visible.wait_all(10)
    visible.stop()
    reap_orphans(5)
    cpu = children_cpu() + (tree_cpu(server) if server else 0.0) - cpu0
    committed = [r for r in runs if r["status"] == "committed"]
    problems = oracle_check(stream.landing, project_totals(spec))
    return {
        "engine": "project" + (" (warm Spark Connect)" if remote else ""),
        "setting": f"every {interval:g} s",
        "latencies": visible.latencies(),
        "files": len(stream.landed),
        "records": stream.records,
        "cpu_s": cpu,
        "commits": len(committed),
        "commit_ms": [r["steps_ms"].get("commit", 0) for r in committed],
        "commit_bytes": [r["bytes"] for r in committed],
        "run_s": [r["wall_s"] for r in committed],
        "oracle": problems[:5],
        "oracle_ok": not problems and len(visible.seen) == len(stream.landed),
    }


def project_idle(work: Path, runs: int = 3) -> dict[str, Any]:
    """Runs that find nothing new, after one that commits: CPU-seconds and wall each."""
    folder = work / "idle-project"
    Stream(folder, seed=8001).land(0)
    spec = project_spec(folder)
    project_run(spec)
    reap_orphans(5)
    cpu, wall = [], []
    for _ in range(runs):
        cpu0 = children_cpu()
        run = project_run(spec)
        reap_orphans(5)
        assert run["status"] == "no_new_data", run
        cpu.append(children_cpu() - cpu0)
        wall.append(run["wall_s"])
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}


def project_recovery(work: Path, kill_after: float) -> dict[str, Any]:
    """kill -9 a run in the middle of its batch (2 x 50k records), then the next run."""
    folder = work / "recovery-project"
    backlog(folder, 2, seed=9001)
    spec = project_spec(folder)
    killed_at = killed_run(spec, kill_after)
    reap_orphans(5)
    rerun = project_run(spec)
    exact = not oracle_check(folder / "landing", project_totals(spec)) and rerun["status"] == "committed"
    return {
        "killed_at_s": killed_at,
        "recovered_s": rerun["wall_s"],
        "replayed_records": rerun["records_in"],
        "lost_s": killed_at,
        "oracle_ok": exact,
    }


# -- Flink -----------------------------------------------------------------------------------


class FlinkJob:
    """`flink_clicks.py` unbounded, in its own process group; events from its metrics file."""

    def __init__(self, landing: Path, folder: Path, checkpoint_ms: int, restore: bool = False) -> None:
        self.folder, self.out, self.metrics = folder, folder / "out", folder / f"metrics-{time.time_ns()}.jsonl"
        folder.mkdir(parents=True, exist_ok=True)
        self.log = open(folder / "flink.stderr", "a")  # noqa: SIM115 (closed in wait)
        self.started = time.time()
        args = ["--monitor-interval-ms", "500", "--checkpoint-interval-ms", str(checkpoint_ms)]
        args += ["--restore", "latest"] if restore else []
        command = flink_args(landing, folder, self.metrics, *args)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=self.log, cwd=ROOT, start_new_session=True)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        events = [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]
        return [e for e in events if kind is None or e["event"] == kind]

    def wait_for(self, kind: str, timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(kind)
            if found:
                return found[0]
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"Flink exited ({self.process.returncode}) before {kind}: see {self.folder / 'flink.stderr'}"
                )
            time.sleep(0.1)
        raise TimeoutError(f"no {kind} from Flink in {timeout} s")

    def stop(self) -> None:
        """SIGTERM to the Python process: a savepoint, then everything read is committed."""
        self.process.send_signal(signal.SIGTERM)
        self.wait()

    def kill(self) -> float:
        os.killpg(self.process.pid, signal.SIGKILL)
        killed = time.time()
        self.wait()
        return killed

    def wait(self) -> None:
        self.process.wait(300)
        self.log.close()


def flink_latency(work: Path, checkpoint_s: float, window: float, idle_s: float) -> dict[str, Any]:
    """A running job (started before the stream: its start-up is reported apart), files landing for `window` s."""
    folder = work / f"flink-{checkpoint_s:g}"
    stream = Stream(folder, seed=1000 + int(checkpoint_s * 10))
    reap_orphans()
    cpu0 = children_cpu()
    job = FlinkJob(stream.landing, folder, int(checkpoint_s * 1000))
    running = job.wait_for("job_running")
    tree0, t0 = tree_cpu(job.process.pid), time.time()
    visible = Visibility(stream.landed, flink_probes(job.out))
    stream.start()
    time.sleep(window)
    stream.stop()
    caught_up = visible.wait_all(120)
    tree1 = tree_cpu(job.process.pid)
    time.sleep(idle_s)  # nothing new lands: what the job costs while idle
    idle_cpu = tree_cpu(job.process.pid) - tree1
    job.stop()
    visible.stop()
    reap_orphans(10)
    cpu = children_cpu() - cpu0
    checkpoints = [e for e in job.events("checkpoint") if not e.get("savepoint") and e["t"] >= t0]
    problems = oracle_check(stream.landing, flink_totals(job.out))
    return {
        "engine": "flink",
        "setting": f"checkpoint every {checkpoint_s:g} s",
        "latencies": visible.latencies(),
        "files": len(stream.landed),
        "records": stream.records,
        "startup_s": running["t"] - job.started,
        "stream_cpu_s": tree1 - tree0,
        "idle_cpu_s": idle_cpu,
        "idle_s": idle_s,
        "cpu_s": cpu,
        "commits": len(checkpoints),
        "commit_ms": [c["duration_ms"] for c in checkpoints],
        "commit_bytes": [c.get("checkpointed_size") or 0 for c in checkpoints],
        "state_bytes": [c.get("state_size") or 0 for c in checkpoints],
        "oracle": problems[:5],
        "oracle_ok": caught_up and not problems,
    }


def flink_recovery(work: Path, files: int, kill_after: float, checkpoint_s: float) -> dict[str, Any]:
    """kill -9 a running job `kill_after` s after its first record, over a backlog; restore from its latest checkpoint."""
    folder = work / "recovery-flink"
    stream = backlog(folder, files, seed=9101)
    job = FlinkJob(stream.landing, folder, int(checkpoint_s * 1000))
    first = job.wait_for("first_record")
    time.sleep(max(0.0, first["t"] + kill_after - time.time()))
    killed = job.kill()
    done = [c for c in job.events("checkpoint") if c["t"] <= killed]
    last = max(done, key=lambda c: c["id"]) if done else None
    reap_orphans(10)
    visible = Visibility(stream.landed, flink_probes(folder / "out"))
    restored = FlinkJob(stream.landing, folder, int(checkpoint_s * 1000), restore=True)
    caught_up = visible.wait_all(600)
    recovered = max(visible.seen.values()) - restored.started if caught_up else None
    restart_first = restored.wait_for("first_record")["t"] - restored.started
    restored.stop()
    visible.stop()
    reap_orphans(10)
    problems = oracle_check(stream.landing, flink_totals(folder / "out"))
    return {
        "killed_at_s": killed - first["t"],
        "last_checkpoint_age_s": killed - (last["trigger_t"] if last else first["t"]),
        "checkpoints_before_kill": len(done),
        "recovered_s": recovered,
        "restart_to_first_record_s": restart_first,
        "records": stream.records,
        "oracle_ok": caught_up and not problems,
    }


# -- throughput ------------------------------------------------------------------------------


def throughput(work: Path, files: int) -> list[dict[str, Any]]:
    """A backlog of `files` x 50k records: the project in one batch (a new process), Flink bounded."""
    folder = work / "throughput-project"
    stream = backlog(folder, files, seed=7001)
    spec = project_spec(folder)
    reap_orphans()
    cpu0 = children_cpu()
    run = project_run(spec)
    reap_orphans(5)
    exact = not oracle_check(stream.landing, project_totals(spec)) and run["records_in"] == stream.records
    out = [
        {
            "engine": "project",
            "records": stream.records,
            "wall_s": run["wall_s"],
            "cpu_s": children_cpu() - cpu0,
            "oracle_ok": exact,
            "steps_ms": run["steps_ms"],
        }
    ]
    folder = work / "throughput-flink"
    shutil.copytree(stream.landing, folder / "landing")
    cpu0 = children_cpu()
    wall, events = flink_bounded(folder / "landing", folder)
    reap_orphans(10)
    exact = not oracle_check(folder / "landing", flink_totals(folder / "out"))
    out.append(
        {
            "engine": "flink",
            "records": stream.records,
            "wall_s": wall,
            "cpu_s": children_cpu() - cpu0,
            "processing_s": event_at(events, "job_finished") - event_at(events, "first_record"),
            "oracle_ok": exact,
        }
    )
    return out


# -- report ----------------------------------------------------------------------------------


def setting(p: dict[str, Any]) -> str:
    """A phase's setting: `every 10 s`, `every 5 s (Connect)`, `checkpoint every 1 s`."""
    return p["setting"] + (" (Connect)" if "Connect" in p["engine"] else "")


def label(p: dict[str, Any], sep: str = "\n") -> str:
    """A phase's name in the plots: `project` or `Flink`, then its setting."""
    return ("project" if p["engine"].startswith("project") else "Flink") + sep + setting(p)


def write_doc(
    phases: list[dict], idle: dict, through: list[dict], recovery: dict, minutes: float, window: float
) -> None:
    plot(phases, through)
    rate = RECORDS_PER_FILE / LAND_EVERY_S
    exact = {True: "exact", False: "NOT EXACT"}
    lines = [
        "## Measured",
        "",
        f"{measured_by('`make bench-full` (`bench/continuous.py`)', minutes)}.",
        "",
        f"**Stream**: a file of {RECORDS_PER_FILE:,} click records every {LAND_EVERY_S:g} s ({rate:,.0f} records/s) for "
        f"at least {window:g} s per setting (the project's: until its first run after that), each file ending with a probe record; per user count, sum, hash-sum and max "
        "(`ORACLE_TRANSFORM`). Latency: from a file's rename into the landing folder to its probe being readable "
        "(project: in the Delta state table; Flink: in a committed part file of its exactly-once sink), polled every 0.1 s.",
        "",
        "### Latency, CPU and commits",
        "",
        "| engine | setting | files | latency p50 | p90 | max | CPU-s / M records | commits | commit or checkpoint: p50 duration | p50 bytes written | exactly-once (oracle) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        lat, cpu = p["latencies"], p.get("stream_cpu_s", p["cpu_s"])
        oracle = "exact" if p["oracle_ok"] else "NOT EXACT: " + "; ".join(p["oracle"])
        lines.append(
            f"| {p['engine']} | {p['setting']} | {p['files']} | {pct(lat, 0.5):.1f} s | {pct(lat, 0.9):.1f} s | {pct(lat, 1):.1f} s | "
            f"{cpu / p['records'] * 1e6:,.0f} | {p['commits']} | {statistics.median(p['commit_ms'] or [0]) / 1000:.2f} s | "
            f"{statistics.median(p['commit_bytes'] or [0]) / 1e6:.2f} MB | {oracle} |"
        )
    flink = [p for p in phases if p["engine"] == "flink"]
    run_s = "; ".join(f"{setting(p)}: {statistics.median(p['run_s']):.1f} s" for p in phases if "run_s" in p)
    lines += [
        "",
        "* Project runs are new processes, as Airflow tasks: each pays Python's start, a JVM's start and the plan "
        "(on the warm Spark Connect server, no JVM start; the server's CPU counts, its idle time included). "
        "A run started while the previous one was still going waits for it (`max_active_runs=1`), so an interval "
        f"shorter than a run's duration degrades to back-to-back runs. Run durations (median): {run_s}.",
        "* Project commit: the state MERGE and the ledger's commit (`commit` step); bytes: what the batch added to the "
        "lake (state files rewritten by the MERGE, the ledger row, the Delta log entries).",
        "* Flink's CPU is counted from its job running to the last probe's visibility (its start-up, "
        + ", ".join(f"{p['startup_s']:.1f} s" for p in flink)
        + ", is not in the latency figures: the job was running before "
        "the first file landed). Checkpoint bytes: what each incremental RocksDB checkpoint wrote (full state: "
        + ", ".join(f"{statistics.median(p['state_bytes'] or [0]) / 1e6:.1f} MB" for p in flink)
        + ").",
        "* Flink's mini-batch aggregation (1 s bundles) and its source's 0.5 s file discovery are part of its latency; "
        "its sink makes a part file visible when the checkpoint covering it completes.",
        "",
        "### While nothing arrives",
        "",
        f"* The project, a run that finds nothing new (a new process that reads the ledger and lists the folder, and stops the driver JVM it launched ahead of need): "
        f"{idle['cpu_s']:.2f} CPU-s and {idle['wall_s']:.2f} s wall. Scheduled every minute: {idle['cpu_s'] * 60:.0f} CPU-s an hour.",
    ]
    for p in flink:
        lines.append(
            f"* Flink ({p['setting']}), running with nothing to read for {p['idle_s']:.0f} s: {p['idle_cpu_s']:.1f} CPU-s, "
            f"{p['idle_cpu_s'] / p['idle_s'] * 3600:,.0f} CPU-s an hour, and its JVM's memory held all the while."
        )
    lines += [
        "",
        "### Throughput over a backlog",
        "",
        "| engine | records | wall | records/s | CPU-s | CPU-s / M records | exactly-once (oracle) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in through:
        lines.append(
            f"| {t['engine']} | {t['records']:,} | {t['wall_s']:.1f} s | {t['records'] / t['wall_s']:,.0f} | {t['cpu_s']:.1f} | "
            f"{t['cpu_s'] / t['records'] * 1e6:.1f} | {exact[t['oracle_ok']]} |"
        )
    pt, ft = through
    lines += [
        "",
        "* The project did the backlog in one batch (one new process): "
        + ", ".join(f"{k} {v / 1000:.1f} s" for k, v in pt["steps_ms"].items())
        + ".",
        f"* Flink, bounded: {ft['processing_s']:.1f} s from its first record to its end "
        f"({ft['records'] / ft['processing_s']:,.0f} records/s once running); the rest is its start-up.",
    ]
    pr, fr = recovery["project"], recovery["flink"]
    lines += [
        "",
        "### Recovery after kill -9",
        "",
        f"* The project: a run killed {pr['killed_at_s']:.1f} s after it started, on a batch of {pr['replayed_records']:,} records. The next run replays the "
        f"planned range (the same files, recorded in the ledger before the read): {pr['replayed_records']:,} records read again, "
        f"caught up {pr['recovered_s']:.1f} s after it started. Work done twice: the killed run's {pr['lost_s']:.1f} s. "
        f"Oracle: {exact[pr['oracle_ok']]}.",
        f"* Flink: a job over {fr['records']:,} records killed {fr['killed_at_s']:.1f} s after its first record, "
        f"{fr['last_checkpoint_age_s']:.1f} s after its last completed checkpoint was triggered (of {fr['checkpoints_before_kill']}). "
        f"Restored from it: first record {fr['restart_to_first_record_s']:.1f} s after the restart, everything visible "
        + (f"{fr['recovered_s']:.1f} s after it" if fr["recovered_s"] is not None else "never (timed out)")
        + f". Work done twice: what the job did since that checkpoint's barrier. Oracle: {exact[fr['oracle_ok']]}.",
        "",
        "![latency](continuous_latency.png)",
        "",
        "![cpu](continuous_cpu.png)",
        "",
    ]
    write_section("micro-batch-vs-continuous.md", lines)


def plot(phases: list[dict[str, Any]], through: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.4, 3.8))
    box = ax.boxplot([p["latencies"] for p in phases], patch_artist=True, whis=(0, 100))
    for patch, p in zip(box["boxes"], phases):
        patch.set_facecolor(
            "#2f6f9f" if p["engine"] == "project" else "#6c9bc2" if p["engine"].startswith("project") else "#c9a26b"
        )
    ax.set_xticks(range(1, len(phases) + 1), [label(p) for p in phases], fontsize=7)
    ax.set_ylabel("seconds, landing to queryable")
    ax.set_yscale("log")
    ax.set_title("Latency by schedule interval (project) and checkpoint interval (Flink)", fontsize=10)
    save_plot(fig, "continuous_latency.png")

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    colours = ["#2f6f9f" if p["engine"].startswith("project") else "#c9a26b" for p in phases]
    left.barh(
        [label(p, " ").replace("checkpoint ", "ckpt ") for p in phases],
        [p.get("stream_cpu_s", p["cpu_s"]) / p["records"] * 1e6 for p in phases],
        color=colours,
    )
    left.set_xlabel(f"CPU-s per million records at {RECORDS_PER_FILE / LAND_EVERY_S:,.0f} records/s")
    left.tick_params(axis="y", labelsize=7)
    right.bar(
        [t["engine"] for t in through], [t["cpu_s"] / t["records"] * 1e6 for t in through], color=["#2f6f9f", "#c9a26b"]
    )
    right.set_ylabel("CPU-s per million records")
    right.set_title(f"a backlog of {through[0]['records']:,} records", fontsize=9)
    save_plot(fig, "continuous_cpu.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=90, help="seconds files land for, per setting (default 90)")
    parser.add_argument("--intervals", default="10,20,40", help="the project's schedule intervals, seconds")
    parser.add_argument("--checkpoints", default="1,5,10", help="Flink's checkpoint intervals, seconds")
    parser.add_argument(
        "--connect-interval", type=float, default=5, help="schedule interval on a warm Spark Connect server (0: skip)"
    )
    parser.add_argument(
        "--backlog-files", type=int, default=20, help="files of 50k records for throughput (default 20: a million)"
    )
    args = parser.parse_args()
    if not FLINK_PYTHON.exists():
        sys.exit(f"no Flink virtualenv at {FLINK_PYTHON.parents[1]}: `make bench-full` creates it")
    become_subreaper()
    started = time.time()
    phases: list[dict[str, Any]] = []
    with scratch("continuous") as work:
        intervals = [float(s) for s in args.intervals.split(",")]
        checkpoints = [float(s) for s in args.checkpoints.split(",")]
        for i in range(max(len(intervals), len(checkpoints))):  # interleaved, so load hits both alike
            if i < len(intervals):
                print(f"project, a run every {intervals[i]:g} s...", flush=True)
                phases.append(project_latency(work, intervals[i], args.window))
            if i < len(checkpoints):
                print(f"Flink, a checkpoint every {checkpoints[i]:g} s...", flush=True)
                phases.append(flink_latency(work, checkpoints[i], args.window, idle_s=30))
        if args.connect_interval:
            from tests.spark_servers import start_connect

            print(f"project on a warm Spark Connect server, a run every {args.connect_interval:g} s...", flush=True)
            server, url = start_connect(work / "connect-server")
            try:
                phases.append(project_latency(work, args.connect_interval, args.window, url, server.procs[0].pid))
            finally:
                server.stop()
                reap_orphans(10)
        print("idle...", flush=True)
        idle = project_idle(work)
        print("throughput over a backlog...", flush=True)
        through = throughput(work, args.backlog_files)
        print("recovery after kill -9...", flush=True)
        recovery = {
            "project": project_recovery(work, kill_after=4.0),
            "flink": flink_recovery(work, args.backlog_files, kill_after=8.0, checkpoint_s=5.0),
        }
    write_doc(phases, idle, through, recovery, (time.time() - started) / 60, args.window)
    bad = [p["setting"] for p in phases if not p["oracle_ok"]] + [t["engine"] for t in through if not t["oracle_ok"]]
    bad += [k for k, r in recovery.items() if not r["oracle_ok"]]
    if bad:
        sys.exit(f"not exactly-once: {', '.join(bad)}")


if __name__ == "__main__":
    main()
