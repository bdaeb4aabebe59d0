"""Faults at every protocol boundary, SIGTERM, a zombie run, and runs started at once.

Everything here goes through the real CLI in new processes, as an Airflow
task would run. Each crash run must print the fault marker (proof the point
was reached); the pipeline must then end exactly equal to the oracle.

The fault points and the races are the protocol's, in the job's Python
process (where every commit is made): their runs are thin clients of the
test process's shared Spark Connect server (`on_connect`), as a fleet on a
shared engine runs. A SIGTERM's handling is the process's own, during
Spark's start too, and `mid_executor_write` kills the run's own executors
with it: those runs start Spark themselves, as on `local[*]`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.core.faults import MARKER, POINTS
from spark_jobs.core.inspect import history
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from tests.conftest import assert_exact, reach, run_cli, start_cli

SEEDS = (3, 7, 11)
#: The fault matrix: every point with every seed in `make soak`; in `make
#: test` every point with one seed, the seeds taken in turn, so each
#: seed's input (1, 2 or 3 files a wave) still meets several points. The
#: soak's seeds run on the run's own Spark, `make test`'s on a shared server.
FAULT_MATRIX = [
    pytest.param(point, seed, marks=() if seed == SEEDS[i % len(SEEDS)] else pytest.mark.slow)
    for i, point in enumerate(POINTS)
    for seed in SEEDS
]


def _drain(spec_path: Path, max_runs: int = 5) -> list[dict]:
    """Run the CLI until it reports no new data; every run must succeed."""
    outcomes = []
    for _ in range(max_runs):
        result = run_cli("run", str(spec_path), "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        outcomes.append(json.loads(result.stdout))
        if outcomes[-1]["status"] == "no_new_data":
            return outcomes
    raise AssertionError(f"not drained after {max_runs} runs: {outcomes}")


#: The fault matrix of a state merged on read (`state.deletion_vectors`):
#: every point in `make soak`; in `make test` the kill amid its own commit's
#: files (the data file, the change file, the vectors written, no entry yet).
VECTOR_MATRIX = [pytest.param(point, marks=() if point == "mid_state_merge" else pytest.mark.slow) for point in POINTS]


@pytest.mark.parametrize(("point", "seed"), FAULT_MATRIX)
def test_sigkill_at_each_point_then_rerun_is_exact(spec_path, compute, request, point, seed):
    """The fault matrix: every protocol boundary x three seeds of generated
    input (in `make test`, one seed per boundary: `FAULT_MATRIX`). In `make
    test` the runs are the shared Connect server's clients (a kill there
    leaves the server's executors running on: what a fleet on a shared
    engine meets), but at `mid_executor_write`. There, and in `make soak`'s
    other seeds at every point, the run starts Spark itself: its death takes
    its driver JVM, and the local executors at work, with it."""
    _kill_then_rerun(spec_path, compute, request, point, seed)


@pytest.mark.parametrize("point", VECTOR_MATRIX)
def test_sigkill_at_each_point_merged_on_read_then_rerun_is_exact(spec_path, compute, request, point):
    """The same kills with the state merged on read (issue 64, part 2): the
    recovery's batches are the job's own commits of deletion vectors."""
    spec = yaml.safe_load(spec_path.read_text())
    spec["state"]["deletion_vectors"] = True
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    # A first batch of many users, then batches of few: a state whose batches merge on read (`merge_on_read._pays`).
    _kill_then_rerun(spec_path, compute, request, point, 7, first=(1500, 1000), later=60)
    log = (spec_path.parent / "lake" / "state" / "_delta_log").glob("*.json")
    assert any('"merge-on-read"' in entry.read_text() for entry in log), "no batch was merged on read"


@pytest.mark.parametrize("point", VECTOR_MATRIX)
def test_sigkill_at_each_point_merged_with_changes_by_the_executors_then_rerun_is_exact(spec_path, compute, request, point):
    """The same kills with a change-feed state whose batches the executors'
    join merges, writing the change data the job commits (issue 64,
    `state_write: executors`): at `mid_state_merge` the join's data and
    change files are written, the entry not. The change feed of every kept
    version then nets, key by key, to the state (no lost attempt's change
    file is read as a change)."""
    from spark_jobs.core.delta_io import arrow, open_table, read_all

    spec = yaml.safe_load(spec_path.read_text())
    spec["state"]["change_feed"] = True
    spec["engine"] = {"state_write": "executors"}
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    _kill_then_rerun(spec_path, compute, request, point, 7)
    state = spec_path.parent / "lake" / "state"
    assert any("executors' join" in entry.read_text() for entry in (state / "_delta_log").glob("*.json")), "no batch was joined"
    table = open_table(str(state))
    netted: dict[str, int] = {}
    for row in arrow(table.load_cdf(starting_version=0).read_all()).to_pylist():
        sign = {"insert": 1, "update_postimage": 1, "update_preimage": -1, "delete": -1}[row["_change_type"]]
        netted[row["user_id"]] = netted.get(row["user_id"], 0) + sign * row["events"]
    assert {k: v for k, v in netted.items() if v} == {r["user_id"]: r["events"] for r in read_all(table).to_pylist()}


def _kill_then_rerun(
    spec_path: Path, compute, request, point: str, seed: int, first: tuple[int, int] = (150, 30), later: int = 150
) -> None:
    """Batch 1 committed (`first`: records a file, users); batch 2's run
    killed at `point`; a new run and a drain then leave the state exact, one
    committed row per batch. Waves after the first: `later` records a file."""
    fast = not request.node.get_closest_marker("slow")
    if point != "mid_executor_write" and fast:
        request.getfixturevalue("on_connect")
    # At `mid_executor_write` the crashed run is the subject; the run that
    # recovers is the shared server's client, as at every other point.
    recovery_env = {"MICROBATCH_SPARK_MASTER": request.getfixturevalue("shared_connect")} if fast else None
    landing = spec_path.parent / "landing"
    files = 1 + seed % 3
    reach(point, spec_path)
    # Batch 1 lands normally (in-process: only the crash and the recovery need new processes).
    write_wave(landing, 0, files=files, records_per_file=first[0], users=first[1], seed=seed, bad_every=37)
    assert run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status == "committed"
    write_wave(landing, 1, files=files, records_per_file=later, users=first[1], seed=seed, bad_every=41)
    crashed = run_cli("run", str(spec_path), env={"MICROBATCH_FAULT_POINT": point})
    assert f"{MARKER} {point}" in crashed.stderr, crashed.stderr[-2000:]
    assert crashed.returncode == -signal.SIGKILL
    write_wave(landing, 2, files=1, records_per_file=later, users=first[1], seed=seed)

    # Recovery in a new process, as the Airflow retry or the next run would do it.
    recovered = run_cli("run", str(spec_path), "--json", env=recovery_env)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    assert json.loads(recovered.stdout)["status"] == "committed"  # redoes or completes the batch
    while run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status != "no_new_data":
        pass
    lineage = assert_exact(spec_path)
    assert 2 <= len(lineage) <= 3
    committed = [r for r in history(load_spec(spec_path)) if r.status == "committed"]
    assert [r.batch_id for r in committed] == [r.batch_id for r in lineage]  # one committed row per batch
    assert sum(r.records_in for r in committed) == files * first[0] + (files + 1) * later


#: Where SIGTERM lands: before the CLI's handler, mid-batch, near its end.
#: `make test` keeps the first two; the third, a later moment of the same
#: batch, is in `make soak`.
@pytest.mark.parametrize("delay", [0.3, 2.5, pytest.param(6.0, marks=pytest.mark.slow)])
def test_sigterm_either_finishes_or_leaves_nothing_half_done(spec_path, compute, delay):
    """The terminated run starts Spark itself: SIGTERM reaches its driver JVM
    too. The runs after it, whose subject is what it left, run in process."""
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=2, records_per_file=400, users=40, bad_every=50)
    proc = start_cli("run", str(spec_path), "--json")
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        assert json.loads(out)["status"] == "committed"  # it had finished
    elif proc.returncode == -signal.SIGTERM:
        pass  # still starting: terminated before the CLI installed its handler, nothing done yet
    else:
        assert proc.returncode == 1, err[-2000:]
        assert "terminated (SIGTERM)" in err, err[-2000:]
        assert "Traceback" not in err
    outcomes = [run_batch(load_spec(spec_path), RunOptions(run_id=f"after-{n}"), compute_factory=compute).status for n in range(3)]
    # A run that finished left nothing to do; else the next run does (or completes) the batch, once.
    assert outcomes[1:] == ["no_new_data", "no_new_data"], outcomes
    assert proc.returncode != 0 or outcomes[0] == "no_new_data", outcomes
    assert len(assert_exact(spec_path)) == 1


def _wait_for_marker(log: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if MARKER in log.read_text():
            return
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)
    raise AssertionError("the zombie never reached its fault point")


def test_zombie_frozen_after_reading_cannot_commit_after_others_moved_on(spec_path, tmp_path, on_connect):
    """SIGSTOP a run after it read batch 1; others commit 1 and 2; SIGCONT: it must not commit."""
    import os
    import sys

    from tests.conftest import ROOT

    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=2, records_per_file=300, users=40)
    log = tmp_path / "zombie.log"
    with open(log, "w") as handle:
        zombie = subprocess.Popen(
            [sys.executable, "-m", "spark_jobs", "run", str(spec_path), "--json"],
            stdout=subprocess.PIPE,
            stderr=handle,
            text=True,
            cwd=ROOT,
            env={**os.environ, "MICROBATCH_FAULT_POINT": "after_read", "MICROBATCH_FAULT_ACTION": "stop"},
        )
        try:
            _wait_for_marker(log, zombie)
            time.sleep(0.5)  # let SIGSTOP land
            assert open(f"/proc/{zombie.pid}/stat").read().split()[2] == "T"  # stopped

            first = json.loads(run_cli("run", str(spec_path), "--json").stdout)
            assert (first["status"], first["batch_id"]) == ("committed", 1)  # replays the zombie's plan
            write_wave(landing, 1, files=1, records_per_file=300, users=40)
            second = json.loads(run_cli("run", str(spec_path), "--json").stdout)
            assert (second["status"], second["batch_id"]) == ("committed", 2)
        finally:
            zombie.send_signal(signal.SIGCONT)
        out, _ = zombie.communicate(timeout=120)
    assert zombie.returncode == 0, log.read_text()[-2000:]
    assert json.loads(out)["status"] == "already_committed"
    lineage = assert_exact(spec_path)
    assert [r.batch_id for r in lineage] == [1, 2]
    history = json.loads(run_cli("history", str(spec_path), "--json").stdout)
    assert sorted(r["batch_id"] for r in history if r["status"] == "committed") == [1, 2]


def test_two_runs_at_once_one_commits_the_other_is_a_noop(spec_path, on_connect):
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


def _race_rounds(spec_path: Path, rounds: int, runners: int = 8) -> None:
    """`runners` runs of the pipeline started together, `rounds` times, new data each round."""
    landing = spec_path.parent / "landing"
    for round_ in range(rounds):
        write_wave(landing, round_, files=2, records_per_file=200, users=50, seed=round_, bad_every=70)
        procs = [start_cli("run", str(spec_path), "--json") for _ in range(runners)]
        outcomes = []
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-2000:]
            outcomes.append(json.loads(out))
        committed = [o for o in outcomes if o["status"] == "committed"]
        assert len(committed) == 1, outcomes  # one commit for the round's batch...
        assert {o["status"] for o in outcomes} <= {"committed", "already_committed", "no_new_data"}, outcomes
        assert all(o["batch_id"] == round_ + 1 for o in outcomes if o["status"] != "no_new_data")
    lineage = assert_exact(spec_path)
    assert len(lineage) == rounds  # ...and one batch per round


@pytest.mark.slow  # 2.4 min; `test_four_runs_at_once_over_a_backlog` and the chaos test race runs in `make test`
def test_eight_runs_at_once(spec_path, on_connect):
    _race_rounds(spec_path, rounds=2)


@pytest.mark.slow
def test_eight_runs_at_once_twenty_rounds(spec_path, on_connect):
    _race_rounds(spec_path, rounds=20)


def test_four_runs_at_once_over_a_backlog(spec_path, on_connect):
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=6, records_per_file=100, users=30)
    procs = [start_cli("run", str(spec_path), "--max-files", "2", "--json") for _ in range(4)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    _drain(spec_path)
    assert_exact(spec_path)
