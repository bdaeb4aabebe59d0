"""Where a fleet's CPU goes, process by process (issue 48, item 3).

A live Airflow over N pipelines (`bench/fleet.py`'s: LocalExecutor,
PostgreSQL, `run_on_data` watchers, Airflow's default loops) with one shared
Spark Connect server, and a file landed for `--files` of them, spread over
`--window` seconds. Meanwhile py-spy samples every Python process of
Airflow's four components and every process they start (the LocalExecutor's
workers, each task's supervisor and the task itself) without stopping them;
/proc gives the CPU of what py-spy cannot see (the Connect server's JVM,
PostgreSQL). Prints, for each kind of process, its CPU-s per committed file
and the functions it spent them in (inclusive, and where the CPU itself went),
and writes them to `--out` as JSON. With `--files 0` nothing lands: the
fleet at rest is sampled for `--window` seconds (issue 48's idle goal; add
`--parse-interval 300`, the fleet setting).

py-spy is a profiler, not part of the project: install it apart
(`python3 -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy`) and
pass `--py-spy /tmp/pyspy/bin/py-spy`. It samples at `--rate` a second and
costs CPU of its own on the same cores, so the figures are shares, not
timings: timings are `bench/fleet.py`'s.

    .venv/bin/python bench/task_profile.py --py-spy /tmp/pyspy/bin/py-spy [--pipelines 200] [--files 60] [--window 240]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "plugins"))

from fleet import TICK, committed_files, fleet_airflow, land, machine_busy, make_specs, start_watching  # noqa: E402
from idle_cost import session_cpu  # noqa: E402


def kind_of(frames: list[str], component: str) -> str:
    """A sample's kind of process, from its stack: a task process runs
    Airflow's task runner (in a child the LocalExecutor's worker forked), its
    supervisor the supervisor's loop in that worker; else the component."""
    if any("execution_time/task_runner.py" in frame for frame in frames):
        return "task process"
    if any("execution_time/supervisor.py" in frame for frame in frames):
        return "task supervisor"
    if any("executors/local_executor.py" in frame for frame in frames):
        return "LocalExecutor worker (idle loop)"
    return component


def postgres_session(live) -> int:
    """The session of the metadata database's server (its postmaster's)."""
    pid = int((live.database.folder / "data" / "postmaster.pid").read_text().split()[0])
    return os.getsid(pid)


def parse_raw(path: Path, component: str, rate: float, kinds: dict[str, dict]) -> None:
    """Add py-spy's raw (collapsed) stacks of `component` to `kinds`: by kind
    of process, CPU-s and seconds by function, inclusive, where spent, and by
    the module a process was importing."""
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        kind = kinds.setdefault(kind_of(frames, component), {
            "cpu_s": 0.0, "inclusive": collections.Counter(), "self": collections.Counter(), "imports": collections.Counter()})
        seconds = int(count) / rate
        kind["cpu_s"] += seconds
        # Frames look like "function (path/to/file.py:line)": keep function and file.
        names = [re.sub(r":\d+\)$", ")", frame) for frame in frames[1:] if not frame.startswith(("thread ", "process "))]
        for name in set(names):
            kind["inclusive"][name] += seconds
        if names:
            kind["self"][names[-1]] += seconds
        # The outermost import below the entry point's own module (`airflow`'s
        # main): what a process paid to import, by what it imported.
        modules = [name for name in names if name.startswith("<module> (")]
        if len(modules) > 1:
            kind["imports"][modules[1]] += seconds


def short(frame: str) -> str:
    """`function (…/site-packages/pkg/mod.py)` as `function (pkg/mod.py)`."""
    return re.sub(r"\((?:[^()]*/(?:site-packages|lib/python3\.\d+)/|" + re.escape(str(ROOT)) + "/)", "(", frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="the py-spy binary")
    parser.add_argument("--pipelines", type=int, default=200)
    parser.add_argument("--files", type=int, default=60, help="files landed, one a pipeline (0: the fleet at rest for --window)")
    parser.add_argument("--window", type=float, default=240, help="seconds the landings are spread over")
    parser.add_argument("--drain", type=float, default=240)
    parser.add_argument("--poll", type=float, default=10)
    parser.add_argument("--rate", type=int, default=50, help="py-spy's samples a second")
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--parse-interval", type=int, help="the dag-processor's min_file_process_interval (default Airflow's 30 s)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("task_profile.json"))
    args = parser.parse_args()
    if not args.py_spy or not Path(args.py_spy).exists():
        sys.exit("py-spy not found: python3 -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy, "
                 "then pass --py-spy /tmp/pyspy/bin/py-spy")

    from dev.airflow import _signal_sessions, _start_connect
    from tests.plugins.live_airflow import COMPONENTS, free_port

    work = Path(tempfile.mkdtemp(prefix="task-profile-"))
    folder = work / "pipelines"
    names = make_specs(folder, args.pipelines, args.poll)
    live = fleet_airflow(work / "airflow", folder, args.parse_interval)
    live.env["AIRFLOW__CORE__PARALLELISM"] = str(args.parallelism)
    live.env["AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG"] = "1"
    server, url = _start_connect(work, free_port())
    live.env["MICROBATCH_SPARK_MASTER"] = url
    recorders: list[tuple[str, subprocess.Popen, Path]] = []
    try:
        start_watching(live, names, args.poll)
        for component, process in zip(COMPONENTS, live.procs):
            out = work / f"{component}.txt"
            recorder = subprocess.Popen(
                [args.py_spy, "record", "--pid", str(process.pid), "--subprocesses", "--nonblocking", "--format", "raw",
                 "--rate", str(args.rate), "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=open(work / f"{component}.py-spy.log", "wb"))
            recorders.append((component, recorder, out))
        time.sleep(2)
        busy0, jvm0, database0 = machine_busy(), session_cpu(server.pid), session_cpu(postgres_session(live))
        started = time.time()
        landed = {}
        for k, name in enumerate(names[: args.files]):
            time.sleep(max(0.0, started + k * args.window / args.files - time.time()))
            landed[name] = land(folder / "landing" / name, 0)[0]
        if not args.files:  # the fleet at rest: nothing lands, the window is sampled as it is
            time.sleep(args.window)
        deadline = time.time() + args.drain
        while time.time() < deadline and not all(file in committed_files(folder / f"{name}.yaml") for name, file in landed.items()):
            time.sleep(5)
        busy1, jvm1, database1 = machine_busy(), session_cpu(server.pid), session_cpu(postgres_session(live))
        committed = sum(file in committed_files(folder / f"{name}.yaml") for name, file in landed.items())
        for _, recorder, _ in recorders:
            recorder.send_signal(signal.SIGINT)
        for _, recorder, _ in recorders:
            recorder.wait(120)
    finally:
        for _, recorder, _ in recorders:
            if recorder.poll() is None:
                recorder.kill()
        live.stop()
        _signal_sessions([server.pid], 9)
        server.wait()

    kinds: dict[str, dict] = {}
    for component, _, out in recorders:
        parse_raw(out, component, args.rate, kinds)
    machine = (busy1[0] - busy0[0]) / TICK
    per_file = max(committed, 1)
    report = {
        "pipelines": args.pipelines, "files": len(landed), "committed": committed, "seconds": round(time.time() - started),
        "rate": args.rate, "machine_cpu_s": machine, "connect_server_cpu_s": jvm1 - jvm0,
        "postgres_cpu_s": database1 - database0, "kinds": {},
    }
    print(f"{args.pipelines} pipelines, {committed} of {len(landed)} files committed; the machine: {machine:.1f} CPU-s "
          f"({machine / per_file:.2f} a file); the Connect server {jvm1 - jvm0:.1f}, PostgreSQL {database1 - database0:.1f}")
    for kind, found in sorted(kinds.items(), key=lambda item: -item[1]["cpu_s"]):
        # Frames in (nearly) every sample of the kind (the process's entry point) say nothing.
        telling = [(f, s) for f, s in found["inclusive"].most_common() if s < 0.9 * found["cpu_s"]][: args.top]
        report["kinds"][kind] = {
            "cpu_s": round(found["cpu_s"], 2), "per_file": round(found["cpu_s"] / per_file, 3),
            "inclusive": [(short(f), round(s, 2)) for f, s in telling],
            "self": [(short(f), round(s, 2)) for f, s in found["self"].most_common(args.top)],
            "imports": [(short(f), round(s, 2)) for f, s in found["imports"].most_common(args.top)],
        }
        print(f"\n== {kind}: {found['cpu_s']:.1f} CPU-s sampled, {found['cpu_s'] / per_file:.2f} a file")
        for title, rows in (("inclusive", telling), ("where spent", found["self"].most_common(12)),
                            ("imports", found["imports"].most_common(12))):
            print(f"  -- {title}:")
            for frame, seconds in rows:
                print(f"  {seconds:7.2f}  {short(frame)[:150]}")
    args.out.write_text(json.dumps(report, indent=1))
    kept = args.out.with_suffix(".stacks")
    kept.mkdir(exist_ok=True)
    for component, _, out in recorders:
        shutil.copy(out, kept / out.name)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
