"""Named fault points for crash testing the commit protocol.

Set ``MICROBATCH_FAULT_POINT=<name>`` and the run kills itself with SIGKILL
when it reaches that point, after printing a marker line to stderr so a test
can prove the point was actually reached (a crash test whose fault never
fired proves nothing). Unset, every call is a dictionary lookup.

With ``MICROBATCH_FAULT_ARM_FILE=<path>`` also set, the point fires only if
it can delete that file: a test arms one crash by creating the file, and
exactly one process (the first to reach the point) dies. That is how an
Airflow retry test kills the first attempt and lets the retry through. A
watched point (below) takes the arm when its file appears, not when the
watch starts: a write that puts no new file there leaves it to the point.

``mid_state_merge`` and ``mid_quarantine_write`` cannot be hooked inside
delta-rs, so a watcher thread kills the process as soon as the write has
put its first new data file into the table's folder, which is after data is
written and before (or, when the write is very fast, just after) the commit
lands. Tests check exactness either way. ``mid_executor_write`` is the same
watch over the folder Spark's executors write a batch's rows into
(`spark_jobs.core.staged`): the job's process dies while the tasks write
(its driver JVM, and with it local executors, dies with it). Where the
executors wrote a batch's files already, ``mid_state_merge`` and
``mid_quarantine_write`` are plain points just before the commit.

``MICROBATCH_HOLD_POINT=<name>`` with ``MICROBATCH_HOLD_FILE=<path>`` pauses
a run at that point for as long as the file exists, or until a stop is
requested (SIGTERM, Airflow's `on_kill`): a test holds a task there, stops
it from outside, and sees where it stopped.

In-process tests (the protocol state machine) cannot SIGKILL themselves, so
`set_hook` installs a callable that every point calls first, with the point's
name: it may raise to simulate a crash there, or block to pause a run there
while another run goes ahead. Production code never sets it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "ACTION_ENV",
    "ARM_FILE_ENV",
    "CONDITIONAL_POINTS",
    "ENV",
    "HOLD_FILE_ENV",
    "HOLD_POINT_ENV",
    "MARKER",
    "POINTS",
    "WINDOW_POINTS",
    "fault_point",
    "set_hook",
    "watch_for_new_files",
]

ENV = "MICROBATCH_FAULT_POINT"
ARM_FILE_ENV = "MICROBATCH_FAULT_ARM_FILE"
#: ``kill`` (default): SIGKILL at the point. ``stop``: SIGSTOP at the point,
#: so a test can freeze a run there (a zombie) and SIGCONT it later.
ACTION_ENV = "MICROBATCH_FAULT_ACTION"
MARKER = "MICROBATCH-FAULT-POINT-HIT"
HOLD_POINT_ENV = "MICROBATCH_HOLD_POINT"
HOLD_FILE_ENV = "MICROBATCH_HOLD_FILE"
#: A hold never outlasts this, whatever happens to the file.
MAX_HOLD_SECONDS = 600
POINTS = (
    "after_reconcile",
    "after_plan",
    "mid_executor_write",
    "after_read",
    "mid_quarantine_write",
    "after_quarantine",
    "mid_state_merge",
    "after_state_commit",
    "after_ledger_commit",
)
#: Points on the path of some batches only: the quarantine write happens
#: only when a batch has bad records, and the executors write a batch's
#: rows only on an engine that writes files (Spark, not a test's in-memory compute).
CONDITIONAL_POINTS = ("mid_quarantine_write", "mid_executor_write")
#: Points of a pipeline with event-time windows only (`spark_jobs.core.windows`):
#: between the final rows' append and the state's expiry.
WINDOW_POINTS = ("after_final_rows",)

#: Test hook called with the point's name at every point (see `set_hook`).
_hook: Callable[[str], None] | None = None


#: The points this process stopped at (`ACTION_ENV` ``stop``).
_stopped: set[str] = set()


def set_hook(hook: Callable[[str], None] | None) -> None:
    """Install (or, with None, remove) the in-process hook called at every point."""
    global _hook
    _hook = hook


def _armed() -> bool:
    arm_file = os.environ.get(ARM_FILE_ENV)
    if not arm_file:
        return True
    try:
        os.remove(arm_file)  # atomic: only one process can win it
    except FileNotFoundError:
        return False
    return True


def _die(point: str) -> None:
    if point in _stopped:
        return  # a point a run passes twice (a file watch, then the point itself) stops it once
    sys.stderr.write(f"{MARKER} {point} pid={os.getpid()}\n")
    sys.stderr.flush()
    if os.environ.get(ACTION_ENV) == "stop":
        _stopped.add(point)
        os.kill(os.getpid(), signal.SIGSTOP)  # returns after SIGCONT; the run goes on
        return
    os.kill(os.getpid(), signal.SIGKILL)


def fault_point(point: str) -> None:
    """Die here if this is the configured fault point; wait here while a hold says so."""
    if _hook is not None:
        _hook(point)
    if os.environ.get(ENV) == point and _armed():
        _die(point)
    if os.environ.get(HOLD_POINT_ENV) == point:
        _hold(point)


def _hold(point: str) -> None:
    from spark_jobs.core import shutdown

    hold_file = os.environ.get(HOLD_FILE_ENV)
    if not hold_file or not os.path.exists(hold_file):
        return
    sys.stderr.write(f"{MARKER} hold {point} pid={os.getpid()}\n")
    sys.stderr.flush()
    deadline = time.monotonic() + MAX_HOLD_SECONDS
    while os.path.exists(hold_file) and not shutdown.requested() and time.monotonic() < deadline:
        time.sleep(0.1)


def watch_for_new_files(point: str, folder: str) -> None:
    """For `mid_*` points: die once a new data file appears in `folder`.

    The in-process hook is called here, just before the merge starts writing.
    """
    if _hook is not None:
        _hook(point)
    arm_file = os.environ.get(ARM_FILE_ENV)
    if os.environ.get(ENV) != point or "://" in folder or (arm_file and not os.path.exists(arm_file)):
        return

    def data_files() -> set[str]:
        try:
            return {n for n in os.listdir(folder) if n.endswith(".parquet")}
        except FileNotFoundError:
            return set()

    before = data_files()

    def watch() -> None:
        while True:
            if data_files() - before:
                # Armed once: taken only now, so that a run whose write puts no
                # new file here leaves the arm to the point itself, or to another run.
                if _armed():
                    _die(point)
                return
            time.sleep(0.0005)

    threading.Thread(target=watch, name="fault-watch", daemon=True).start()
