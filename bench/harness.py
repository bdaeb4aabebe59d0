"""What the benchmarks share: a new process timed, the anchors run, CPU read from /proc, the click pipeline's spec,
the machine described, plots, and a section of docs/ written.

Importing it puts the project, its Airflow plugins and anchors/ on `sys.path`, so a script imports `spark_jobs`,
`tests` and `flink_state` after it. `BENCH_DOCS=DIR` writes the sections and plots into DIR instead of docs/ (a copy of it, for a smoke run).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
ANCHORS = ROOT / "bench" / "anchors"
sys.path[:0] = [str(ROOT), str(ROOT / "plugins"), str(ANCHORS)]
DOCS = Path(os.environ.get("BENCH_DOCS", ROOT / "docs"))
FLINK_PYTHON = ROOT / ".venv-flink" / "bin" / "python"
TICK = os.sysconf("SC_CLK_TCK")
SCHEMA = "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"
TRANSFORM = (
    "SELECT user_id, count(*) AS events, sum(amount) AS amount, max(ts) AS last_seen FROM batch GROUP BY user_id"
)
MERGE = {"events": "sum", "amount": "sum", "last_seen": "max"}


# -- processes -------------------------------------------------------------------------------


def timed(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> tuple[float, str]:
    """Wall seconds of a new process from its start to its exit, and its stdout.

    Output goes to files, not pipes: a pipe is read until every process
    holding it has closed it, so a JVM child still shutting down would count.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        environ = {**os.environ, **(env or {})}
        code = subprocess.run(args, stdout=out, stderr=err, env=environ, timeout=timeout, cwd=ROOT).returncode
        took = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout = out.read()
        if code != 0:
            raise RuntimeError(f"{' '.join(args[:3])} ... failed ({code}):\n{stdout[-3000:]}\n{err.read()[-3000:]}")
    return took, stdout


def last_json(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


def microbatch(spec: Path, *args: str, timeout: float = 900) -> tuple[float, str]:
    """`microbatch run SPEC --json ARGS` in a new process, as an Airflow task runs it: its seconds and stdout."""
    return timed([sys.executable, "-m", "spark_jobs", "-q", "run", str(spec), "--json", *args], timeout=timeout)


def ss_anchor(*args: object, timeout: float = 900) -> tuple[float, dict[str, Any]]:
    """The Structured Streaming anchor (`anchors/structured_streaming.py ARGS`) in a new process: its seconds from
    start to exit, and its report (each batch's progress)."""
    took, stdout = timed([sys.executable, str(ANCHORS / "structured_streaming.py"), *map(str, args)], timeout=timeout)
    return took, last_json(stdout)


def flink_args(landing: Path, folder: Path, metrics: Path, *args: str) -> list[str]:
    """The Flink anchor's command line (`anchors/flink_clicks.py`, its own virtualenv): `landing` aggregated into
    `folder`'s out/ and checkpoints/ with RocksDB state, its progress events to `metrics`."""
    return [
        *(str(FLINK_PYTHON), str(ANCHORS / "flink_clicks.py"), "--landing", str(landing), "--out", str(folder / "out")),
        *("--checkpoints", str(folder / "checkpoints"), "--backend", "rocksdb", "--metrics-file", str(metrics), *args),
    ]


def flink_bounded(landing: Path, folder: Path) -> tuple[float, list[dict[str, Any]]]:
    """A bounded Flink run over `landing` (checkpoints every second): its seconds from start to exit, its events."""
    metrics = folder / "metrics.jsonl"
    took, _ = timed(flink_args(landing, folder, metrics, "--bounded", "--checkpoint-interval-ms", "1000"), timeout=1800)
    return took, [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def event_at(events: list[dict[str, Any]], kind: str) -> float:
    """When the Flink anchor reported its first event of `kind` (`process_start`, `first_record`, ...)."""
    return next(e["t"] for e in events if e["event"] == kind)


# -- CPU, from /proc -------------------------------------------------------------------------


def processes() -> dict[int, list[str]]:
    """Every live process's /proc/PID/stat fields after its name: [1] ppid, [2] process group, [3] session,
    [11:15] utime, stime, cutime, cstime (the last two: the children it reaped), in ticks."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            found[int(pid)] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return found


def cpu_s(fields: list[str]) -> float:
    """CPU seconds of a process and of the children it reaped (a dag-processor's parses, a task's JVM)."""
    return sum(int(v) for v in fields[11:15]) / TICK


def group_cpu(pgid: int) -> float:
    """CPU seconds so far of process group `pgid`: its live processes and the children they reaped."""
    return sum(cpu_s(f) for f in processes().values() if int(f[2]) == pgid)


def session_cpu(sid: int) -> float:
    """The same for session `sid` (a process keeps its session when orphaned: a JVM outliving its task counts)."""
    return sum(cpu_s(f) for f in processes().values() if int(f[3]) == sid)


def tree_cpu(root: int) -> float:
    """CPU seconds so far of `root` and its live descendants (their own, not the reaped children's)."""
    procs = processes()
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, f in procs.items() if int(f[1]) == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(int(procs[pid][11]) + int(procs[pid][12]) for pid in tree if pid in procs) / TICK


def session_pss(sessions: set[int]) -> int:
    """Proportional set size, bytes (shared pages split among their sharers), of every process of `sessions`."""
    total = 0
    for pid, fields in processes().items():
        if int(fields[3]) in sessions:
            with contextlib.suppress(OSError):
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                total += next((int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:")), 0)
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot: the machine's CPU, whatever process spent it."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def become_subreaper() -> None:
    """Orphans of this process's children (a JVM whose Python parent exited first) are re-parented to it, so
    reaping them adds their CPU to `children_cpu`: every process of a run is counted."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap_orphans(wait_s: float = 0.0) -> None:
    """Reap exited orphans; wait up to `wait_s` for the ones still exiting."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (and, as a subreaper, of their orphans)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- figures and reports ---------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank); nan for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def numbers(text: str) -> list[int]:
    """`1000,20000` -> [1000, 20000]; "" -> []."""
    return [int(s) for s in text.split(",") if s]


@contextlib.contextmanager
def scratch(name: str) -> Iterator[Path]:
    """A temporary folder for one run's files, removed after it."""
    work = Path(tempfile.mkdtemp(prefix=f"microbatch-{name}-"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_spec(folder: Path, name: str, **fields: Any) -> Path:
    """`folder`/`name`.yaml, the benchmarks' click pipeline (JSON files from `landing/`, made here; per user
    count, sum and max merged into `lake/state`), `fields` in place of its top-level fields."""
    spec = {
        "name": name,
        "source": {"type": "files", "path": "landing", "format": "json", "schema": SCHEMA},
        "transform": TRANSFORM,
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": MERGE},
        "checkpoint": f"lake/_checkpoints/{name}",
        **fields,
    }
    (folder / "landing").mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def machine() -> str:
    memory = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line)
    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[0]
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {int(memory) / 1024**2:.0f} GB, Python "
        f"{platform.python_version()}, {java}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    )


def measured_by(by: str, minutes: float | None = None) -> str:
    """A section's first line: what measured it, on what machine, when."""
    return f"Measured by {by}{'' if minutes is None else f' in one run of {minutes:.0f} minutes'} on {machine()}"


def write_section(doc: str, lines: list[str]) -> None:
    """Print `lines` (a ``## `` heading first) and put them in docs/`doc` in place of the section that heading opens,
    up to the next ``## `` heading; append them if there is none yet. The other sections stay as they are."""
    print("\n".join(lines), flush=True)
    path, heading = DOCS / doc, lines[0]
    text = path.read_text()
    if heading in text:
        head, _, rest = text.partition(heading)
        tail = rest.split("\n## ", 1)
        text = head + "\n".join(lines) + ("\n## " + tail[1] if len(tail) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    path.write_text(text)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, name: str) -> None:
    """Save a figure as docs/`name` (beside the sections, `BENCH_DOCS` too) and free it."""
    fig.tight_layout()
    fig.savefig(DOCS / name, dpi=110)
    pyplot().close(fig)
