"""What a batch's task process pays before its batch, beside another commit (issue 48, item 3).

Airflow's LocalExecutor forks each task from a worker that its forkserver
started after importing `microbatch_airflow.task_imports` (a Celery worker
imports it before forking its pool). The task then parses the DAG file to
find its DAG (`airflow.sdk.execution_time.task_runner.parse`: Airflow's
DagBag over `dags/microbatch_pipelines.py`, one DAG built, named by the
parsing context), and only then runs the batch.

This script does the same: a process of each tree imports Airflow, that
tree's `task_imports` and the LocalExecutor (as a worker has), then forks
`--repeat` tasks one after the other, and each task times (CPU seconds,
`time.process_time`) what the task runner's parse costs it: DagBag's
import, where the preload lacks it, and the parse of the DAG file over N
specs: `bench/fleet.py`'s, each a `run_on_data` pipeline, so that its DAG
is scheduled on a source asset with a watcher, as in a fleet (the first
asset of a scheme other than ``file`` has Airflow discover its providers'
URI handlers, where the preload has not).
The anchor is the code of `--anchor`, checked out beside this tree, run on
the same specs; the trees alternate `--rounds` times. Medians. Results:
docs/fleet.md, "What a task pays before its batch".

    .venv/bin/python bench/task_start.py [--specs 200] [--anchor fde01f3]
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
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from fleet import make_specs  # noqa: E402
from doc_sections import replace_section  # noqa: E402
from worktrees import checked_out  # noqa: E402

DOC = ROOT / "docs" / "fleet.md"
SECTION = "## What a task pays before its batch (issue 48, item 3)"
DAG_ID = "fleet_007"  # the task's DAG, one of fleet.make_specs'

# Run by each tree's interpreter with that tree's plugins first on the path:
# the preload as the forkserver's, then the tasks forked from it in turn.
_TASKS = """
import json, logging, os, sys, time
tree, repeat = sys.argv[1], int(sys.argv[2])
sys.path[:0] = [tree + "/plugins", tree]
import airflow
import microbatch_airflow.task_imports
import airflow.executors.local_executor  # the worker's own loop, which forks the tasks
logging.disable(logging.INFO)
times = []
for _ in range(repeat):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        started = time.process_time()
        from airflow.dag_processing.dagbag import BundleDagBag
        bag = BundleDagBag(dag_folder=tree + "/dags/microbatch_pipelines.py", safe_mode=False,
                           load_op_links=False, bundle_path=tree + "/dags", bundle_name="dags-folder")
        spent = time.process_time() - started
        os.write(write, json.dumps({"cpu_s": spent, "dags": list(bag.dags)}).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    times.append(json.loads(os.read(read, 65536)))
print(json.dumps(times))
"""


def tasks(tree: Path, folder: Path, home: Path, repeat: int) -> list[float]:
    """CPU seconds of each forked task's parse (its DAG checked: the one named)."""
    env = {**os.environ, "MICROBATCH_PIPELINES_DIR": str(folder), "AIRFLOW_HOME": str(home),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "PYTHONPATH": "",
           "_AIRFLOW_PARSING_CONTEXT_DAG_ID": DAG_ID, "_AIRFLOW_PARSING_CONTEXT_TASK_ID": "run_batch"}
    out = subprocess.run([sys.executable, "-c", _TASKS, str(tree), str(repeat)], env=env, capture_output=True,
                         text=True, check=True, cwd=tree)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(task["dags"] == [DAG_ID] for task in found), found
    return [task["cpu_s"] for task in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", type=int, default=200)
    parser.add_argument("--anchor", default="2b7f3ef", help="the commit to compare with")
    parser.add_argument("--repeat", type=int, default=7, help="tasks forked in a row from one preloaded process")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="microbatch-task-start-"))
    try:
        with checked_out(args.anchor, work / "anchor") as anchor:
            # Both trees' bytecode compiled ahead, as `make setup` does this one's:
            # what differs is the code, not whether Python compiles it at import.
            for tree in (anchor, ROOT):
                subprocess.run([sys.executable, "-m", "compileall", "-q", "plugins", "dags", "spark_jobs"], cwd=tree,
                               check=True, capture_output=True)
            folder = work / "specs"
            make_specs(folder, args.specs, poll=10)
            samples: dict[str, list[float]] = {"anchor": [], "now": []}
            for _ in range(args.rounds):
                for label, tree in (("anchor", anchor), ("now", ROOT)):
                    samples[label] += tasks(tree, folder, work / f"home-{label}", args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {label: statistics.median(values) for label, values in samples.items()}
    print(json.dumps({"specs": args.specs, **medians, "samples": samples}), flush=True)
    replace_section(DOC, SECTION, [
        SECTION,
        "",
        f"{date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores: CPU seconds a task forked after "
        f"the preload spends in the task runner's parse of the DAG file (DagBag's import included), over "
        f"{args.specs:,} `run_on_data` specs (`bench/fleet.py`'s); medians of {args.rounds * args.repeat} tasks, the trees alternating; the anchor is "
        f"commit `{args.anchor}`.",
        "",
        "| anchor | now | now / anchor |",
        "|---|---|---|",
        f"| {medians['anchor']:.3f} s | {medians['now']:.3f} s | **{medians['now'] / medians['anchor']:.2f}** |",
        "",
    ])


if __name__ == "__main__":
    main()
