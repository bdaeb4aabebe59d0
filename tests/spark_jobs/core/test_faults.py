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
