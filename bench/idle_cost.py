"""What an idle pipeline costs on a live Airflow, waiting in the triggerer (issue 36).

A fleet's pipelines mostly find nothing new. With `airflow.wait_for_data`
deferrable, a run's sensor waits in the triggerer (`NewDataTrigger`: the
ledger read and the folder listing, no Spark, in a thread) and no worker
slot or process is held. This measures what that costs, on a live Airflow
(`tests/plugins/live_airflow.py`: api-server, scheduler, dag-processor and
triggerer, LocalExecutor, metadata on PostgreSQL), in one run:

1. `--pipelines` N pipelines, each with its own landing folder and one
   committed batch (so its ledger and state exist, as a fleet's do), with a
   deferrable `wait_for_data` sensor polling every `--poll` seconds.
2. Baseline: the DAGs paused, nothing deferred; each component's CPU
   (every process of its process group, from /proc) over `--window`
   seconds.
3. Idle: one run of each DAG triggered; once every sensor is deferred, the
   same window again.
4. The triggerer's extra CPU over the baseline, per deferred pipeline and
   hour; and, beside it, the CPU of one poll measured in this process
   (`waiting()`, what the trigger's thread calls), times the polls in an hour.

The anchor of a run that polls by schedule instead (a task process every
interval) is the idle CLI run in docs/benchmarks.md ("Figures behind the
code's choices"): its Python process alone costs about a CPU-second.
Results go to docs/fleet.md, section "An idle pipeline".

    .venv/bin/python bench/idle_cost.py [--pipelines 20] [--poll 30] [--window 300]
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
    """CPU seconds (user + system) of the live processes in process group `pgid`."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def make_pipelines(folder: Path, count: int, poll: float) -> list[str]:
    """`count` specs, each with one committed batch, and a deferrable sensor."""
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
            name = f"idle_{i:03d}"
            spec_dict = oracle_spec_dict(
                name=name,
                source={**oracle_spec_dict()["source"], "path": f"landing/{name}"},
                state={**oracle_spec_dict()["state"], "path": f"lake/{name}"},
                checkpoint=f"lake/_checkpoints/{name}",
                airflow={"wait_for_data": {"poll_seconds": poll, "deferrable": True, "timeout_seconds": 86400}},
            )
            spec_path = write_spec(folder, spec_dict, f"{name}.yaml")
            write_wave(folder / "landing" / name, 0, files=1, records_per_file=50, users=5)
            outcome = run_batch(load_spec(spec_path), RunOptions(run_id="seed"), compute_factory=lambda: SparkCompute(session=spark))
            assert outcome.status == "committed", outcome
            names.append(name)
    finally:
        spark.stop()
    return names


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
    parser.add_argument("--window", type=float, default=300)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "plugins"))
    work = Path(tempfile.mkdtemp(prefix="microbatch-idle-"))
    live = None
    try:
        names = make_pipelines(work / "pipelines", args.pipelines, args.poll)
        per_poll = poll_cpu_s(work / "pipelines" / f"{names[0]}.yaml")
        print(f"a full check: {per_poll[0] * 1000:.2f} ms CPU, an idle poll: {per_poll[1] * 1000:.2f} ms", flush=True)
        live = LiveAirflow(work / "airflow", work / "pipelines").start()
        for name in names:
            live.wait_for_dag(name)
        baseline = window_cpu(live, args.window)
        print("baseline", baseline, flush=True)
        runs = {}
        for name in names:
            live.unpause(name)
            runs[name] = live.trigger(name, {})

        def deferred() -> bool:
            states = [next((t["state"] for t in live.task_instances(n, r) if t["task_id"] == "wait_for_data"), None) for n, r in runs.items()]
            return all(s == "deferred" for s in states)

        live.wait(deferred, 600, "every sensor to defer")
        time.sleep(args.poll)  # past the deferral's own start-up
        idle = window_cpu(live, args.window)
        print("idle", idle, flush=True)
    finally:
        if live is not None:
            live.stop()
        shutil.rmtree(work, ignore_errors=True)
    write_doc(args, per_poll, baseline, idle)


def write_doc(args, per_poll: tuple[float, float], baseline: dict[str, float], idle: dict[str, float]) -> None:
    hour = 3600 / args.window
    extra = (idle["triggerer"] - baseline["triggerer"]) * hour / args.pipelines
    scheduler = (idle["scheduler"] - baseline["scheduler"]) * hour / args.pipelines
    total = sum(idle[c] - baseline[c] for c in COMPONENTS) * hour / args.pipelines
    polls = 3600 / args.poll
    lines = [
        SECTION,
        "",
        f"Measured by `bench/idle_cost.py` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {date.today().isoformat()}: a live Airflow 3 (api-server, scheduler, "
        f"dag-processor, triggerer; LocalExecutor; PostgreSQL), {args.pipelines} pipelines each with one committed "
        f"batch and a deferrable `wait_for_data` sensor polling every {args.poll:.0f} s. Each component's CPU (its "
        f"process group, from /proc) over {args.window:.0f} s, first with the DAGs paused, then with every sensor "
        "deferred and nothing arriving.",
        "",
        "| component | CPU-s per hour, paused | CPU-s per hour, all sensors deferred | extra per idle pipeline-hour |",
        "|---|---|---|---|",
    ]
    for component in COMPONENTS:
        b, i = baseline[component] * hour, idle[component] * hour
        lines.append(f"| {component} | {b:.1f} | {i:.1f} | {(i - b) / args.pipelines:.2f} |")
    lines += [
        "",
        f"An idle pipeline waiting in the triggerer cost **{extra:.2f} CPU-s an hour** of the triggerer's time "
        f"(the goal: at most 2). In this process, a trigger's full check (`waiting()`: the spec parsed, the ledger's "
        f"head, the folder's listing) took {per_poll[0] * 1000:.2f} ms of CPU, {per_poll[0] * polls:.2f} CPU-s for "
        f"the {polls:.0f} polls of an hour had every poll been one; an idle poll (the spec file's time and the "
        f"source's fingerprint, `triggers._fingerprint`) took {per_poll[1] * 1000:.2f} ms, "
        f"{per_poll[1] * polls:.3f} CPU-s an hour. The rest of the triggerer's share is Airflow's own per-trigger "
        "work.",
        "",
        f"**Counted over all of Airflow, an idle pipeline cost {total:.1f} CPU-s an hour, and the goal is not met**: "
        f"the scheduler's loop spent {scheduler:.1f} of them on the running DAG run that holds the deferred sensor, "
        "whatever the sensor waits on (this Airflow runs the live tests' scheduler heartbeat of 2 s; Airflow's "
        "default is 5 s). A waiting sensor keeps a DAG run running; what would not is no run at all until data "
        "arrives (an asset or event-driven schedule): the next step for fleets. Against polling by schedule it "
        "still wins: a task process every interval costs about a CPU-second of the job's own Python alone, before "
        "Airflow's task supervisor (docs/benchmarks.md, \"Figures behind the code's choices\"), so at one run a "
        "minute an idle pipeline costs on the order of a CPU-minute an hour; for a fleet, the deferrable sensor "
        "is the default to pick until then.",
        "",
    ]
    if not DOC.exists():
        DOC.write_text("# A fleet of pipelines on one Airflow (issue 36)\n\nFigures from `bench/` scripts, each from one run.\n")
    replace_section(DOC, SECTION, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
