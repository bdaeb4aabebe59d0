"""The fault points' own behaviour (the crash tests rely on it)."""

from __future__ import annotations

import signal

from spark_jobs.core import faults


def test_a_point_a_run_passes_twice_stops_it_once(monkeypatch):
    """`MICROBATCH_FAULT_ACTION=stop` at `mid_state_merge` on the executors'
    join: the file watch fires amid the join's files, then the point itself
    before the commit (found by a review: two SIGSTOPs, so one SIGCONT did
    not resume the run). The process stops once; a kill stays a kill."""
    sent: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(faults, "_stopped", set())
    monkeypatch.setenv(faults.ACTION_ENV, "stop")
    faults._die("mid_state_merge")
    faults._die("mid_state_merge")
    faults._die("after_state_commit")
    assert sent == [signal.SIGSTOP, signal.SIGSTOP]
    monkeypatch.delenv(faults.ACTION_ENV)
    faults._die("after_plan")
    assert sent[-1] == signal.SIGKILL


def test_an_armed_watch_leaves_the_arm_until_a_file_appears(monkeypatch, tmp_path):
    """An armed `mid_state_merge` watch over a folder no new file comes to
    (a batch whose files were written before: the executors') leaves the arm
    to the point itself (found by the chaos test: the watch took the arm at
    its start, the point then found none, and no run died); a file that
    appears takes it and kills."""
    import time

    sent: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    arm = tmp_path / "armed"
    arm.touch()
    folder = tmp_path / "state"
    folder.mkdir()
    monkeypatch.setenv(faults.ENV, "mid_state_merge")
    monkeypatch.setenv(faults.ARM_FILE_ENV, str(arm))
    faults.watch_for_new_files("mid_state_merge", str(folder))
    time.sleep(0.2)
    assert arm.exists() and not sent, "the watch alone took the arm"
    faults.fault_point("mid_state_merge")
    assert not arm.exists() and sent == [signal.SIGKILL]
    arm.touch()
    faults.watch_for_new_files("mid_state_merge", str(folder))
    (folder / "part-0.parquet").touch()
    deadline = time.monotonic() + 10
    while arm.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert not arm.exists() and sent == [signal.SIGKILL, signal.SIGKILL]
