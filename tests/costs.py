"""Where the suite's CPU goes: a pytest plugin that measures each test's cost.

`pytest -p tests.costs --costs FILE` (`make test-costs`) appends one JSON
line per test to FILE: its wall time, the CPU time of the test process and
of every process it started (a CLI run, its JVM, a live Airflow's
components, a PostgreSQL server, ...), the processes it started by kind,
and the seconds it slept in `time.sleep` (its polls). `python -m
tests.costs FILE` prints the tables docs/testing.md holds. The Spark jobs
counted are those of the test process's own session (the in-process
tests'); a CLI run's or a Connect server's are in their CPU, not counted.

How a process is known to be the test's: pytest marks its environment
(`MICROBATCH_TEST_COSTS=<worker>`), which every process it starts inherits
(Airflow's components and the JVMs included, whatever they rename
themselves to). A thread samples those processes' CPU every
`SAMPLE_SECONDS`; a test's CPU is what they used between the samples taken
when it started and when it ended. A process that ends between two samples
loses what it used after the last one (at most a quarter of a second), so
the figures are a floor. A process running across tests (a session's Spark
or live Airflow) is charged to the test that was running when it used the
CPU, which is what a test that starts or uses it costs.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MARK_ENV = "MICROBATCH_TEST_COSTS"
SAMPLE_SECONDS = 0.25
_TICK = os.sysconf("SC_CLK_TCK")


def kind_of(cmdline: list[str]) -> str:
    """What a process is, from its command line: the kinds the tables count."""
    text = " ".join(cmdline)
    program = os.path.basename(cmdline[0]) if cmdline else ""
    if program == "java" or program.startswith("java "):
        return "jvm"
    if "spark_jobs" in text and "-m" in cmdline or program == "microbatch":
        return "cli"
    if "db migrate" in text:
        return "airflow-migrate"
    if text.startswith("airflow ") or "/airflow " in text or program == "airflow":
        for component in ("api-server", "scheduler", "dag-processor", "triggerer", "celery"):
            if component in text:
                return f"airflow-{component}"
        return "airflow-other"
    if program in ("postgres", "initdb", "pg_ctl") or "postgres" in program:
        return "postgres"
    if program.startswith("redis"):
        return "redis"
    if "python" in program:
        return "python"
    return "other"


@dataclass
class _Proc:
    kind: str
    cpu: float  # seconds, as last sampled
    start_ticks: int


@dataclass
class _Sampler:
    mark: bytes
    procs: dict[int, _Proc] = field(default_factory=dict)
    #: Pids looked at and found not ours (keyed with their start time: pids are reused).
    others: set[tuple[int, int]] = field(default_factory=set)
    #: CPU of processes that ended, and the processes started, since `take`.
    ended_cpu: float = 0.0
    started: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self) -> None:
        seen: set[int] = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            start, cpu = int(stat[19]), (int(stat[11]) + int(stat[12])) / _TICK
            if (pid, start) in self.others:
                continue
            with self.lock:
                known = self.procs.get(pid)
                if known is not None and known.start_ticks == start:
                    known.cpu = cpu
                    seen.add(pid)
                    continue
            try:
                ours = pid == os.getpid() or self.mark in Path(f"/proc/{pid}/environ").read_bytes()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if not ours:
                self.others.add((pid, start))
                continue
            kind = "pytest" if pid == os.getpid() else kind_of([part for part in cmdline if part])
            with self.lock:
                if known is not None:  # the pid was reused
                    self.ended_cpu += known.cpu
                self.procs[pid] = _Proc(kind, cpu, start)
                self.started[kind] += 1
                seen.add(pid)
        with self.lock:
            for pid in [p for p in self.procs if p not in seen]:
                self.ended_cpu += self.procs.pop(pid).cpu

    def take(self) -> tuple[float, Counter]:
        """CPU seconds used so far by every process seen (ended or running), and the starts counted since the last take."""
        self.sample()
        with self.lock:
            total = self.ended_cpu + sum(p.cpu for p in self.procs.values())
            started, self.started = self.started, Counter()
        return total, started


class CostRecorder:
    """The plugin: samples in a thread, writes a JSON line per test."""

    def __init__(self, out: Path, worker: str) -> None:
        self.out = out
        self.worker = worker
        mark = f"{worker}-{os.getpid()}"
        os.environ[MARK_ENV] = mark
        self.sampler = _Sampler(f"{MARK_ENV}={mark}".encode())
        self.sampler.take()  # the pytest process itself, counted before any test
        self.slept = 0.0
        self._sleep = time.sleep
        time.sleep = self._counting_sleep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-costs", daemon=True)
        self._thread.start()

    def _counting_sleep(self, seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            self.slept += max(seconds, 0)
        self._sleep(seconds)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.sampler.sample()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        cpu0, _ = self.sampler.take()
        wall0, slept0, jobs0 = time.monotonic(), self.slept, _spark_jobs()
        yield
        cpu1, started = self.sampler.take()
        line = {
            "test": item.nodeid,
            "worker": self.worker,
            "wall": round(time.monotonic() - wall0, 2),
            "cpu": round(cpu1 - cpu0, 2),
            "slept": round(self.slept - slept0, 2),
            "spark_jobs": max(_spark_jobs() - jobs0, 0),
            "started": dict(started),
            "slow": item.get_closest_marker("slow") is not None,
        }
        with self.out.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        time.sleep = self._sleep


def _spark_jobs() -> int:
    """How many jobs this process's Spark session has run (0: no session)."""
    import sys

    if "pyspark" not in sys.modules:
        return 0
    from pyspark import SparkContext

    context = SparkContext._active_spark_context
    if context is None:
        return 0
    try:
        ids = context.statusTracker().getJobIdsForGroup()
    except Exception:  # noqa: BLE001 - a session stopping: nothing to count
        return 0
    return max(ids) + 1 if ids else 0


def pytest_addoption(parser):
    parser.addoption("--costs", metavar="FILE", help="append each test's wall time, CPU and processes started to FILE (tests/costs.py)")


def pytest_configure(config):
    out = config.getoption("--costs")
    if out:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        if worker or not getattr(config.option, "numprocesses", None):  # not xdist's controller: it runs no test
            config.pluginmanager.register(CostRecorder(Path(out).resolve(), worker or "main"), "microbatch-costs")


def pytest_unconfigure(config):
    recorder = config.pluginmanager.get_plugin("microbatch-costs")
    if recorder is not None:
        recorder.close()


# -- the tables -----------------------------------------------------------------


def _file_of(test: str) -> str:
    return test.split("::")[0]


def tables(lines: list[dict]) -> str:
    """The markdown tables docs/testing.md holds: by file, then the costliest tests."""
    by_file: dict[str, dict] = defaultdict(lambda: {"tests": 0, "wall": 0.0, "cpu": 0.0, "slept": 0.0, "jobs": 0, "started": Counter()})
    for line in lines:
        row = by_file[_file_of(line["test"])]
        row["tests"] += 1
        for key in ("wall", "cpu", "slept"):
            row[key] += line[key]
        row["jobs"] += line.get("spark_jobs", 0)
        row["started"].update(line["started"])
    total = {"tests": 0, "wall": 0.0, "cpu": 0.0, "slept": 0.0, "jobs": 0, "started": Counter()}
    for row in by_file.values():
        for key in ("tests", "wall", "cpu", "slept", "jobs"):
            total[key] += row[key]
        total["started"].update(row["started"])
    kinds = ("jvm", "cli", "airflow-scheduler", "airflow-migrate", "postgres")

    def cells(name: str, row: dict) -> str:
        started = row["started"]
        counts = " | ".join(str(started.get(kind, 0)) for kind in kinds)
        return f"| {name} | {row['tests']} | {row['wall'] / 60:.1f} | {row['cpu'] / 60:.1f} | {row['slept'] / 60:.1f} | {row['jobs']} | {counts} |"

    head = (
        "| file | tests | wall min | CPU min | slept min | Spark jobs in process | JVMs | CLI runs | Airflow stacks | migrations | PostgreSQL processes |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [cells(name, row) for name, row in sorted(by_file.items(), key=lambda kv: -kv[1]["cpu"])]
    out = [head, *rows, cells("**all**", total), ""]
    out.append("| test | wall s | CPU s | slept s | JVMs | CLI runs |\n|---|---:|---:|---:|---:|---:|")
    for line in sorted(lines, key=lambda item: -item["cpu"])[:40]:
        started = line["started"]
        out.append(
            f"| `{line['test']}` | {line['wall']:.0f} | {line['cpu']:.0f} | {line['slept']:.0f} | "
            f"{started.get('jvm', 0)} | {started.get('cli', 0)} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the cost tables of a `--costs` file (docs/testing.md).")
    parser.add_argument("file", type=Path)
    args = parser.parse_args()
    lines = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    print(tables(lines))


if __name__ == "__main__":
    main()
