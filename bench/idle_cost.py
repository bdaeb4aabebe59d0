"""What an idle pipeline costs on a live Airflow (issue 36).

A fleet's pipelines mostly find nothing new. Two ways to wait for data
without a task process, measured on a live Airflow
(`tests/plugins/live_airflow.py`: api-server, scheduler, dag-processor and
triggerer, LocalExecutor, metadata on PostgreSQL), in one run:

* `airflow.run_on_data`: no DAG run at all until data waits; a watcher in
  the triggerer (`NewDataEventTrigger`) polls the source's fingerprint.
* `airflow.wait_for_data`, deferrable: a run's sensor waits in the
  triggerer (`NewDataTrigger`), its DAG run open meanwhile.

Steps:

1. `--pipelines` N pipelines of each kind, each with its own landing folder
   and one committed batch (so its ledger and state exist, as a fleet's
   do), polling every `--poll` seconds.
2. Baseline: every DAG paused; each component's CPU (every process of its
   process group and the children it reaped, from /proc) over `--window`
   seconds.
3. Watched: the `run_on_data` DAGs unpaused; once every watcher runs in the
   triggerer, the same window.
4. Deferred: besides, one run of each sensor DAG triggered; once every
   sensor is deferred, the same window.
5. Each step's extra CPU over the one before, per pipeline and hour; and,
   beside it, the CPU of one poll measured in this process.

The anchor of a run that polls by schedule instead (a task process every
interval) is the idle CLI run in docs/benchmarks.md ("Figures behind the
code's choices"): its Python process alone costs about a CPU-second.
Results go to docs/fleet.md, section "An idle pipeline".

    .venv/bin/python bench/idle_cost.py [--pipelines 20] [--poll 30] [--window 240]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402
from tests.plugins.live_airflow import COMPONENTS, LiveAirflow  # noqa: E402

DOC = ROOT / "docs" / "fleet.md"
SECTION = "## An idle pipeline"
TICK = os.sysconf("SC_CLK_TCK")


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes in process group
    `pgid`, and of the children they reaped: the dag-processor's parses run
    in processes that are gone by the time the window ends."""
    return _cpu_where(2, pgid)


def session_cpu(sid: int) -> float:
    """The same for the processes of session `sid` (a server's, say)."""
    return _cpu_where(3, sid)


def _cpu_where(field: int, value: int) -> float:
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value:  # fields after the name: state, ppid, pgrp, session, ...
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    return total / TICK


def make_pipelines(folder: Path, count: int, airflow: dict, prefix: str) -> list[str]:
    """`count` specs named `prefix`_NNN with this `airflow:` block, each with one committed batch."""
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import write_wave
    from spark_jobs.engine.session import default_session
    from spark_jobs.engine.spark_compute import SparkCompute
    from tests.conftest import oracle_spec_dict, write_spec

    spark = default_session("local[2]", short_lived=False)
    names = []
    try:
        for i in range(count):
            name = f"{prefix}_{i:03d}"
            spec_dict = oracle_spec_dict(
                name=name,
                source={**oracle_spec_dict()["source"], "path": f"landing/{name}"},
                state={**oracle_spec_dict()["state"], "path": f"lake/{name}"},
                checkpoint=f"lake/_checkpoints/{name}",
                airflow=airflow,
            )
            spec_path = write_spec(folder, spec_dict, f"{name}.yaml")
            write_wave(folder / "landing" / name, 0, files=1, records_per_file=50, users=5)
            outcome = run_batch(load_spec(spec_path), RunOptions(run_id="seed"), compute_factory=lambda: SparkCompute(session=spark))
            assert outcome.status == "committed", outcome
            names.append(name)
    finally:
        spark.stop()
    return names


def running_watchers(live) -> int:
    """How many `NewDataEventTrigger`s a triggerer has taken (read from the metadata DB)."""
    import psycopg2

    with psycopg2.connect(live.database.url("airflow")) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM trigger WHERE classpath LIKE %s AND triggerer_id IS NOT NULL", ("%NewDataEventTrigger",))
        return cursor.fetchone()[0]


def poll_cpu_s(spec_path: Path, repeat: int = 20) -> tuple[float, float]:
    """CPU seconds of a trigger's full check (`waiting()`) and of its idle
    poll (the fingerprint, `_fingerprint()`), medians of `repeat`."""
    from microbatch_airflow.triggers import _fingerprint, waiting

    def median(call) -> float:
        call()  # imports and first opens
        times = []
        for _ in range(repeat):
            started = time.process_time()
            call()
            times.append(time.process_time() - started)
        return sorted(times)[len(times) // 2]

    assert waiting(str(spec_path)) == 0 and _fingerprint(str(spec_path)) is not None
    return median(lambda: waiting(str(spec_path))), median(lambda: _fingerprint(str(spec_path)))


def window_cpu(live, seconds: float) -> dict[str, float]:
    before = {c: group_cpu(p.pid) for c, p in zip(COMPONENTS, live.procs)}
    time.sleep(seconds)
    return {c: group_cpu(p.pid) - before[c] for c, p in zip(COMPONENTS, live.procs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=20)
    parser.add_argument("--poll", type=float, default=30)
    parser.add_argument("--window", type=float, default=240)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "plugins"))
    work = Path(tempfile.mkdtemp(prefix="microbatch-idle-"))
    folder = work / "pipelines"
    live = None
    try:
        watched = make_pipelines(folder, args.pipelines, {"run_on_data": {"poll_seconds": args.poll}}, "watched")
        sensed = make_pipelines(
            folder, args.pipelines, {"wait_for_data": {"poll_seconds": args.poll, "deferrable": True, "timeout_seconds": 86400}}, "sensed"
        )
        per_poll = poll_cpu_s(folder / f"{watched[0]}.yaml")
        print(f"a full check: {per_poll[0] * 1000:.2f} ms CPU, an idle poll: {per_poll[1] * 1000:.2f} ms", flush=True)
        live = LiveAirflow(work / "airflow", folder).start()
        for name in watched + sensed:
            live.wait_for_dag(name)
        windows = {"paused": window_cpu(live, args.window)}
        print("paused", windows["paused"], flush=True)
        for name in watched:
            live.unpause(name)
        live.wait(lambda: running_watchers(live) == len(watched), 600, "every watcher to run in the triggerer")
        time.sleep(args.poll)  # past the watchers' first, full checks
        windows["watched"] = window_cpu(live, args.window)
        assert all(live.runs(name) == [] for name in watched), "a watched pipeline ran with nothing new"
        print("watched", windows["watched"], flush=True)
        runs = {}
        for name in sensed:
            live.unpause(name)
            runs[name] = live.trigger(name, {})

        def deferred() -> bool:
            states = [next((t["state"] for t in live.task_instances(n, r) if t["task_id"] == "wait_for_data"), None) for n, r in runs.items()]
            return all(s == "deferred" for s in states)

        live.wait(deferred, 600, "every sensor to defer")
        time.sleep(args.poll)  # past the deferral's own start-up
        windows["deferred"] = window_cpu(live, args.window)
        print("deferred", windows["deferred"], flush=True)
    finally:
        if live is not None:
            live.stop()
        shutil.rmtree(work, ignore_errors=True)
    write_doc(args, per_poll, windows)


def write_doc(args, per_poll: tuple[float, float], windows: dict[str, dict[str, float]]) -> None:
    hour = 3600 / args.window
    per_pipeline = {  # CPU-s per pipeline-hour each step added, by component
        step: {c: (windows[step][c] - windows[before][c]) * hour / args.pipelines for c in COMPONENTS}
        for step, before in (("watched", "paused"), ("deferred", "watched"))
    }
    total = {step: sum(costs.values()) for step, costs in per_pipeline.items()}
    polls = 3600 / args.poll
    lines = [
        SECTION,
        "",
        f"Measured by `bench/idle_cost.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}: a live Airflow 3 (api-server, scheduler, "
        f"dag-processor, triggerer; LocalExecutor; PostgreSQL; the live tests' scheduler heartbeat of 2 s, "
        f"Airflow's default is 5 s). {args.pipelines} pipelines of each kind, each with one committed batch, "
        f"polling every {args.poll:.0f} s, nothing arriving: `run_on_data` (no run until data waits, a watcher in "
        "the triggerer) and a deferrable `wait_for_data` sensor (a run open, its sensor deferred). Each "
        f"component's CPU (its process group and the children it reaped, from /proc) over {args.window:.0f} s: every DAG paused, then the "
        "watched DAGs unpaused, then the sensors' runs deferred besides.",
        "",
        "| component | CPU-s per hour, all paused | + watchers | + deferred sensors | per idle pipeline-hour, `run_on_data` | per idle pipeline-hour, deferred sensor |",
        "|---|---|---|---|---|---|",
    ]
    for c in COMPONENTS:
        lines.append(
            f"| {c} | {windows['paused'][c] * hour:.1f} | {windows['watched'][c] * hour:.1f} | "
            f"{windows['deferred'][c] * hour:.1f} | {per_pipeline['watched'][c]:.2f} | {per_pipeline['deferred'][c]:.2f} |"
        )
    lines.append(f"| **all of Airflow** | | | | **{total['watched']:.2f}** | **{total['deferred']:.2f}** |")
    met = "met" if total["watched"] <= 2 else "not met"
    noise = " (a difference between two windows: below zero is noise, nothing measurable)" if total["watched"] < 0 else ""
    lines += [
        "",
        f"**With `run_on_data` an idle pipeline cost {total['watched']:.2f} CPU-s an hour over all of Airflow**{noise}, "
        f"{per_pipeline['watched']['triggerer']:.2f} of them in the triggerer; the goal is at most 2: {met}. The watched "
        "DAGs had no run in the window: no task, no JVM. "
        f"With the deferrable sensor it cost {total['deferred']:.2f}, {per_pipeline['deferred']['scheduler']:.2f} "
        "of them in the scheduler's loop over the open DAG run that holds the sensor, whatever the sensor "
        "waits on. So `run_on_data` is the default for fleets; `wait_for_data` stays for pipelines that run on "
        "a clock and should skip a tick with nothing new.",
        "",
        f"In this process, a watcher's full check (`waiting()`: the spec parsed, the ledger's head, the folder's "
        f"listing) took {per_poll[0] * 1000:.2f} ms of CPU, {per_poll[0] * polls:.2f} CPU-s for the {polls:.0f} "
        f"polls of an hour had every poll been one; an idle poll (the spec file's time and the source's "
        f"fingerprint, `triggers._fingerprint`) took {per_poll[1] * 1000:.2f} ms, {per_poll[1] * polls:.3f} CPU-s "
        "an hour. The rest of the triggerer's share is Airflow's own per-trigger work. Sources on S3 and Kafka "
        "have no fingerprint: each of their polls is a full check (a listing or the watermarks, over the network).",
        "",
        "Against polling by schedule: a task process every interval costs about a CPU-second of the job's own "
        "Python alone, before Airflow's task supervisor (docs/benchmarks.md, \"Figures behind the code's "
        "choices\"), so at one run a minute an idle pipeline costs on the order of a CPU-minute an hour.",
        "",
    ]
    if not DOC.exists():
        DOC.write_text("# A fleet of pipelines on one Airflow (issue 36)\n\nFigures from `bench/` scripts, each from one run.\n")
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
