"""SIGKILL at every protocol boundary, and runs started at once, via the real CLI.

Each crash run must print the fault marker (proof the point was reached);
the next run must complete the pipeline so that state equals the oracle.
"""

from __future__ import annotations

import json

import pytest

from spark_jobs.clickstream import write_wave
from spark_jobs.faults import MARKER, POINTS
from tests.conftest import assert_exact, run_cli, start_cli


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_each_point_then_rerun_is_exact(spec_path, point):
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=2, records_per_file=200, users=40, bad_every=50)
    assert run_cli("run", str(spec_path)).returncode == 0  # batch 1 lands normally
    write_wave(landing, 1, files=2, records_per_file=200, users=40, bad_every=50)
    crashed = run_cli("run", str(spec_path), env={"MICROBATCH_FAULT_POINT": point})
    assert f"{MARKER} {point}" in crashed.stderr, crashed.stderr[-2000:]
    assert crashed.returncode == -9  # SIGKILL
    write_wave(landing, 2, files=1, records_per_file=200, users=40)
    # Re-run until drained: each run must succeed.
    for _ in range(4):
        result = run_cli("run", str(spec_path), "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        if json.loads(result.stdout)["status"] == "no_new_data":
            break
    lineage = assert_exact(spec_path)
    assert 2 <= len(lineage) <= 3
    history = json.loads(run_cli("history", str(spec_path), "--json").stdout)
    committed = [r for r in history if r["status"] == "committed"]
    assert len(committed) == len(lineage)
    assert sum(r["records_in"] for r in committed) == 1000
    assert sum(r["records_quarantined"] for r in committed) == 16


def test_two_runs_at_once_one_commits_the_other_is_a_noop(spec_path):
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=500, users=60)
    procs = [start_cli("run", str(spec_path), "--json") for _ in range(2)]
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        outcomes.append(json.loads(out))
    statuses = sorted(o["status"] for o in outcomes)
    assert statuses == ["already_committed", "committed"], outcomes
    assert all(o["batch_id"] == 1 for o in outcomes)
    lineage = assert_exact(spec_path)
    assert len(lineage) == 1


def test_four_runs_at_once_over_a_backlog(spec_path):
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=6, records_per_file=100, users=30)
    procs = [start_cli("run", str(spec_path), "--max-files", "2", "--json") for _ in range(4)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    while json.loads(run_cli("run", str(spec_path), "--json").stdout)["status"] != "no_new_data":
        pass
    assert_exact(spec_path)
