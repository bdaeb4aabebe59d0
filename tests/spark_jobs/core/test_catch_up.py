"""Batches back to back (`catch_up`): each exactly once, the next two read while one commits.

The read ahead is only an early read: these tests make it right, wrong (a
file lands between its plan and the batch's own) and fail, and crash the
run while it is in flight; the state must equal the oracle every time.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from spark_jobs.core import faults, shutdown
from spark_jobs.core.catch_up import catch_up
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import Terminated
from tests.conftest import assert_exact, run_cli


class _Watched:
    """A compute that calls `on_process(n)` before its n-th `process` (1-based),
    or `on_process(batch)` with `with_batch`; one read at a time.
    `alongside` lists, call by call, whether `process` was told other reads run beside it."""

    def __init__(self, inner, on_process, *, with_batch: bool = False) -> None:
        self._inner = inner
        self._on_process = on_process
        self._with_batch = with_batch
        self._lock = threading.Lock()
        self.calls = 0
        self.alongside: list[bool] = []

    reads_at_once = 1

    def start(self) -> None:
        self._inner.start()

    def close(self) -> None:
        self._inner.close()

    def check(self, spec, batch, **options) -> None:
        self._inner.check(spec, batch, **options)

    def process(self, spec, batch, **options):
        with self._lock:
            self.calls += 1
            calls = self.calls
            self.alongside.append(options.get("alongside", False))
        self._on_process(batch if self._with_batch else calls)
        return self._inner.process(spec, batch, **options)


class _TwoAtOnce(_Watched):
    """`_Watched` on an engine that runs two reads at once, as Spark does."""

    reads_at_once = 2


def _first_file(batch) -> str:
    return batch.manifest.files[0].uri.rsplit("/", 1)[-1]


def test_two_batches_are_read_ahead_at_once_each_as_planned(spec_path, compute):
    """While batch 1 commits, batches 2 and 3 are read, at the same time:
    each read waits at a barrier for the other to begin, so reads one after
    the other would fail (and batches 2 and 3 read their ranges themselves)."""
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=6, records_per_file=100, users=30, bad_every=37)
    both_begun = threading.Barrier(2, timeout=60)
    reads: list[str] = []

    def meet_the_other_read(batch) -> None:
        reads.append(_first_file(batch))
        if len(reads) in (2, 3):  # batch 1's own read is the first
            both_begun.wait()

    watched = _TwoAtOnce(compute(), meet_the_other_read, with_batch=True)
    outcomes = catch_up(spec, RunOptions(run_id="catch-up", max_files=2), lambda: watched)
    assert [o.status for o in outcomes] == ["committed"] * 3 + ["no_new_data"]
    assert all("read_ahead" in o.steps_ms for o in outcomes[1:3])
    assert len(reads) == 3  # each batch read once
    # The engine is told its reads overlap, the first batch's included.
    assert watched.alongside == [True, True, True]
    assert len(assert_exact(spec_path)) == 3


def test_a_file_landing_after_two_reads_ahead_drops_only_the_read_it_changes(spec_path, compute):
    """Batches 2 (files 3-4) and 3 (file 5 alone) are read ahead; a sixth
    file lands as batch 3's read begins, so batch 3 plans files 5 and 6:
    batch 2's read stands in, batch 3's does not."""
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=5, records_per_file=100, users=20)
    fifth = sorted(path.name for path in Path(spec.source_path).iterdir())[4]

    def land_during_batch_3s_read(batch) -> None:
        if _first_file(batch) == fifth and not list(Path(spec.source_path).glob("*w00001*")):
            write_wave(spec.source_path, 1, files=1, records_per_file=100, users=20)

    watched = _TwoAtOnce(compute(), land_during_batch_3s_read, with_batch=True)
    outcomes = catch_up(spec, RunOptions(run_id="catch-up", max_files=2), lambda: watched)
    assert [o.status for o in outcomes] == ["committed"] * 3 + ["no_new_data"]
    assert [len(o.inputs) for o in outcomes[:3]] == [2, 2, 2]
    assert "read_ahead" in outcomes[1].steps_ms and "read_ahead" not in outcomes[2].steps_ms
    # Batch 1, the reads ahead of 2 and 3, batch 3 as planned; and perhaps a
    # read of the sixth file alone, planned after batch 3's stale range and
    # dropped with it.
    assert watched.calls in (4, 5)
    assert len(assert_exact(spec_path)) == 3


def test_a_backlog_commits_batch_after_batch_each_read_once(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=5, records_per_file=200, users=40, bad_every=53)
    seen = []
    outcomes = catch_up(spec, RunOptions(run_id="catch-up", max_files=2), compute, on_outcome=seen.append)
    assert [o.status for o in outcomes] == ["committed", "committed", "committed", "no_new_data"]
    assert seen == outcomes
    assert [len(o.inputs) for o in outcomes[:3]] == [2, 2, 1]
    assert [o.batch_id for o in outcomes[:3]] == [1, 2, 3]
    # Batches 2 and 3 were read while the one before committed, and used.
    assert "read_ahead" not in outcomes[0].steps_ms
    assert all("read_ahead" in o.steps_ms for o in outcomes[1:3])
    assert sum(o.records_quarantined for o in outcomes[:3]) == 5 * (200 // 53)
    assert len(assert_exact(spec_path)) == 3


def test_max_batches_stops_after_that_many_commits(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=4, records_per_file=50)
    outcomes = catch_up(spec, RunOptions(run_id="catch-up", max_files=1), compute, max_batches=2)
    assert [o.status for o in outcomes] == ["committed", "committed"]
    assert_exact(spec_path, drained=False)
    # What is left is there for the next run, nothing read ahead was lost.
    rest = catch_up(spec, RunOptions(run_id="catch-up", max_files=1), compute)
    assert [o.status for o in rest] == ["committed", "committed", "no_new_data"]
    assert len(assert_exact(spec_path)) == 4


def test_a_file_landing_after_the_read_ahead_planned_drops_it(spec_path, compute):
    """Batch 2 is read ahead as file 3 alone; a fourth file lands during that
    read, so step 2 plans files 3 and 4: the early read must not stand in."""
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=3, records_per_file=100, users=20)

    def land_during_read_ahead(n: int) -> None:
        if n == 2:
            write_wave(spec.source_path, 1, files=1, records_per_file=100, users=20)

    watched = _Watched(compute(), land_during_read_ahead)
    outcomes = catch_up(spec, RunOptions(run_id="catch-up", max_files=2), lambda: watched)
    assert [o.status for o in outcomes] == ["committed", "committed", "no_new_data"]
    assert [len(o.inputs) for o in outcomes[:2]] == [2, 2]
    assert "read_ahead" not in outcomes[1].steps_ms
    assert watched.calls == 3  # batch 1, the dropped read ahead, batch 2 as planned
    assert len(assert_exact(spec_path)) == 2


def test_a_read_ahead_that_fails_costs_only_its_time(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=2, records_per_file=100)

    def fail_the_read_ahead(n: int) -> None:
        if n == 2:
            raise RuntimeError("executor lost")

    watched = _Watched(compute(), fail_the_read_ahead)
    outcomes = catch_up(spec, RunOptions(run_id="catch-up", max_files=1), lambda: watched)
    assert [o.status for o in outcomes] == ["committed", "committed", "no_new_data"]
    assert "read_ahead" not in outcomes[1].steps_ms
    assert len(assert_exact(spec_path)) == 2


#: `after_ledger_commit` is `after_state_commit`'s next boundary, with the
#: same read ahead in flight: in `make soak`.
@pytest.mark.parametrize("point", ["after_state_commit", pytest.param("after_ledger_commit", marks=pytest.mark.slow), "after_plan"])
def test_a_crash_while_reading_ahead_loses_and_repeats_nothing(spec_path, compute, point):
    """The run dies at `point` of batch 2: in its commit, while batch 3 is
    read ahead, or after its plan, with its own read ahead in hand. A plain
    run and another catch-up then finish the backlog, exactly."""
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=5, records_per_file=100, users=30, bad_every=41)
    reached = []

    def crash(name: str) -> None:
        if name == point:
            reached.append(name)
            if len(reached) == 2:
                raise RuntimeError(f"crash at {name}")

    faults.set_hook(crash)
    try:
        with pytest.raises(RuntimeError, match="crash at"):
            catch_up(spec, RunOptions(run_id="catch-up", max_files=1), compute)
    finally:
        faults.set_hook(None)
    # A plain run first: it records a ledger row the crash left out, if any.
    assert run_batch(spec, RunOptions(run_id="after", max_files=1), compute_factory=compute).status == "committed"
    assert_exact(spec_path, drained=False)
    rest = catch_up(spec, RunOptions(run_id="after", max_files=1), compute)
    assert rest[-1].status == "no_new_data"
    assert len(assert_exact(spec_path)) == 5


def test_a_stop_asked_during_a_commit_ends_the_run_after_it(spec_path, compute):
    """SIGTERM while batch 1 commits (and batch 2 is read ahead): batch 1
    finishes and is reported, the read ahead finishes as any step does, and
    the run stops at batch 2's first boundary with nothing of it written."""
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=3, records_per_file=50)
    faults.set_hook(lambda point: shutdown.request() if point == "after_state_commit" else None)
    watched = _Watched(compute(), lambda n: None)
    seen = []
    try:
        with pytest.raises(Terminated, match="stopped after reconcile"):
            catch_up(spec, RunOptions(run_id="catch-up", max_files=1), lambda: watched, on_outcome=seen.append)
    finally:
        faults.set_hook(None)
        shutdown._requested.clear()
    assert [o.status for o in seen] == ["committed"]
    assert watched.calls == 2  # batch 1, and batch 2 read ahead
    assert len(assert_exact(spec_path, drained=False)) == 1


def test_cli_catch_up_prints_one_json_line_per_batch(spec_path, on_connect):
    write_wave(spec_path.parent / "landing", 0, files=3, records_per_file=50)
    done = run_cli("-q", "run", str(spec_path), "--catch-up", "--max-files", "1", "--json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["status"] for line in lines] == ["committed"] * 3 + ["no_new_data"]
    assert [line["batch_id"] for line in lines[:3]] == [1, 2, 3]
    assert len(assert_exact(spec_path)) == 3
    refused = run_cli("run", str(spec_path), "--max-batches", "2")
    assert refused.returncode != 0 and "--max-batches needs --catch-up" in refused.stderr
