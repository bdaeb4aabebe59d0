"""The commit protocol as a Hypothesis state machine, checked after every step.

Rules: land a wave of files, land *late* files (in a subfolder, with an mtime
older than anything consumed), run one batch, crash a run at a named fault
point, interleave two runs (run A paused at a point while run B runs or
rewinds, then A resumes), rewind to a random committed batch, OPTIMIZE and
VACUUM the state (must not be taken for tampering), RESTORE the state behind
the job's back (the next run must refuse; a rewind repairs it), and drain.
After every step the invariant checks exactly-once against the oracle:

* the effective lineage (the ledger's, plus the one state commit the ledger
  may lag by after a crash between steps 4 and 5) has contiguous batch ids
  whose offsets join end to end from the origin, and no file twice;
* the state table equals `clickstream.fold` of exactly the lineage's files;
* the live quarantine (rows of lineage batches) holds each bad line of those
  files exactly once.

Compute is `ArrowCompute` (no JVM), so a step costs milliseconds of Delta
I/O and the machine can explore hundreds of steps in CI.

Why an in-process crash is a faithful stand-in for SIGKILL at that point
------------------------------------------------------------------------
`faults.set_hook` lets the test raise `SimulatedCrash` at a fault point.
It derives from BaseException, so every ``except Exception`` on the way
out lets it pass; the protocol's modules have no bare ``except:`` and no
``except BaseException``, and their only ``finally`` is run_batch's
``compute.close()``, which releases the engine and writes no table
(`test_no_cleanup_writes_on_unwind` checks both by parsing the source, so
the argument fails loudly if someone adds such a handler). Fault points sit
between delta-rs calls, which are synchronous: whatever a call wrote is
complete when it returns, as it would be when a kill lands at the same line.
So the tables after the unwind are exactly what a kill there leaves. The
next step starts from fresh `Pipeline` objects and re-reads every table, as
a new process would; nothing in `spark_jobs` caches table state across runs.
For ``mid_state_merge`` (inside delta-rs, which has no hook) the crash lands
just before the merge and leaves a truncated Parquet file in the state
folder, which is what a merge killed after writing data and before its log
entry leaves behind; a kill after the log entry is the
``after_state_commit`` point.
"""

from __future__ import annotations

import ast
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from spark_jobs.core import faults
from spark_jobs.demo.clickstream import differences, fold, state_totals, write_wave
from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.errors import ConcurrentRunError, StateChangedOutsideError
from spark_jobs.core.faults import POINTS
from spark_jobs.core.fencing import Position
from spark_jobs.core.ledger import LedgerRow, LedgerView, OffsetLedger
from spark_jobs.core.outcome import Outcome
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import PipelineSpec, load_spec
from spark_jobs.core.state import StateTable
from tests.conftest import oracle_spec_dict, write_spec
from tests.spark_jobs.arrow_compute import ArrowCompute

ROOT = Path(__file__).resolve().parents[3]
#: The modules a run or rewind executes (see `test_no_cleanup_writes_on_unwind`).
PROTOCOL_MODULES = (
    "core/protocol.py",
    "core/agreement.py",
    "core/catch_up.py",
    "core/rewind.py",
    "core/maintain.py",
    "core/pipeline.py",
    "core/commits.py",
    "core/state.py",
    "core/ledger.py",
    "core/quarantine.py",
    "core/fencing.py",
    "core/delta_io.py",
    "core/compute.py",
    "core/faults.py",
    "sources/files.py",
    "sources/s3.py",
    "sources/base.py",
)
#: How long a paused or resumed run may take before the test calls it hung.
THREAD_TIMEOUT_S = 60.0
#: An mtime for late files: older than any file the machine lands normally.
LATE_MTIME = 946_684_800  # 2000-01-01

#: What the machines did, summed over every example of a test (reported by it).
STATS: Counter[str] = Counter()


class SimulatedCrash(BaseException):
    """A kill at a fault point, raised in process (see the module docstring)."""


class ProtocolMachine(RuleBasedStateMachine):
    """One pipeline in a fresh folder; rules drive it, the invariant audits it."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="microbatch-machine-"))
        self.spec_path = write_spec(self.root, oracle_spec_dict())
        self.spec: PipelineSpec = load_spec(self.spec_path)
        self.landing = Path(self.spec.source_path)
        self.wave = 0
        STATS["examples"] += 1

    def teardown(self) -> None:
        faults.set_hook(None)
        try:
            # What this example committed, all epochs, as the ledger records it.
            rows = OffsetLedger(self.spec.ledger_path, self.spec.name).load().rows
            committed = [r for r in rows if r.status == "committed"]
            STATS["batches_committed"] += len(committed)
            STATS["records_committed"] += sum(r.records_in or 0 for r in committed)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------

    def _run(self, max_files: int | None = None):
        return run_batch(self.spec, RunOptions(run_id="test", max_files=max_files), compute_factory=ArrowCompute)

    def _effective(self) -> tuple[LedgerView, Position]:
        """The ledger as the next run's reconcile will see it, and the state's position.

        After a crash between the state commit and the ledger row, the state
        is one event ahead of the ledger; that commit's metadata is the row
        reconcile will append. The protocol promises the lag is at most one
        event and that the event continues from the ledger's head.
        """
        view = OffsetLedger(self.spec.ledger_path, self.spec.name).load()
        state = StateTable(self.spec)
        table = state.open()
        state_at = state.position(table)
        if state_at == view.position:
            return view, state_at
        assert state_at > view.position, f"state at {state_at} is behind the ledger at {view.position}"
        commit = state.find_commit(table, state_at)
        assert commit is not None, f"no state commit carries the fence at {state_at}"
        pending = LedgerRow.from_commit(commit)
        head_end = view.head.end_offsets if view.head else {"files": 0}
        assert pending.start_offsets == head_end, "the unprojected state commit does not continue the ledger"
        if pending.status == "committed":
            assert pending.position == view.position.next(), "the state is more than one batch ahead of the ledger"
        else:
            assert pending.epoch == view.position.epoch + 1, "the state is more than one rewind ahead of the ledger"
        return LedgerView.of_rows(view.table, view.ledger, [*view.rows, pending]), state_at

    def _pending_files(self) -> list[str]:
        view, _ = self._effective()
        consumed = {name for row in view.lineage() for name in Pipeline(self.spec).batch(row).manifest.inputs()}
        return [f for f in self._ready_files() if f not in consumed]

    def _ready_files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.landing))
            for p in self.landing.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )

    def _leave_partial_merge_file(self) -> None:
        """What a merge killed after writing data and before committing leaves: a part file no log entry names."""
        path = Path(self.spec.state_path) / f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
        path.write_bytes(b"PAR1\x15\x00\x15")  # a truncated Parquet file

    # -- rules -----------------------------------------------------------------

    @rule(
        files=st.integers(1, 3),
        records=st.integers(1, 12),
        users=st.integers(1, 6),
        bad_every=st.sampled_from([0, 0, 3, 5]),
    )
    def produce(self, files: int, records: int, users: int, bad_every: int) -> None:
        write_wave(self.landing, self.wave, files=files, records_per_file=records, users=users, bad_every=bad_every)
        self.wave += 1
        STATS["steps"] += 1
        STATS["files"] += files

    @rule(records=st.integers(1, 12), bad_every=st.sampled_from([0, 2]))
    def late_file(self, records: int, bad_every: int) -> None:
        """A file that arrives now but carries an mtime older than every consumed file."""
        (path,) = write_wave(self.landing / "late", self.wave, files=1, records_per_file=records, users=4, bad_every=bad_every)
        os.utime(path, (LATE_MTIME + self.wave, LATE_MTIME + self.wave))
        self.wave += 1
        STATS["steps"] += 1
        STATS["files"] += 1
        STATS["late_files"] += 1

    @rule(max_files=st.none() | st.integers(1, 2))
    def run(self, max_files: int | None) -> None:
        pending = set(self._pending_files())
        outcome = self._run(max_files)
        STATS["steps"] += 1
        if not pending:
            assert outcome.status == Outcome.NO_NEW_DATA, outcome
            return
        assert outcome.status == Outcome.COMMITTED, outcome
        assert outcome.inputs and set(outcome.inputs) <= pending, "a batch took a file that was not pending"

    @precondition(lambda self: self._pending_files())
    @rule(point=st.sampled_from(POINTS))
    def crash(self, point: str) -> None:
        """A run killed at `point`; with data pending, every point is reached."""
        fired: list[str] = []

        def hook(at: str) -> None:
            if at == point:
                fired.append(at)
                if at == "mid_state_merge":
                    self._leave_partial_merge_file()
                raise SimulatedCrash(at)

        faults.set_hook(hook)
        try:
            self._run()
        except SimulatedCrash:
            pass
        finally:
            faults.set_hook(None)
        if not fired and point in faults.CONDITIONAL_POINTS:
            # The batch had no bad records, so it wrote no quarantine: it ran to the end.
            STATS["steps"] += 1
            return
        assert fired == [point], f"the run did not reach {point}"
        STATS["steps"] += 1
        STATS["crashes"] += 1

    @precondition(lambda self: self._pending_files())
    @rule(point=st.sampled_from(POINTS), other=st.sampled_from(["run", "rewind"]), data=st.data())
    def concurrent(self, point: str, other: str, data: st.DataObject) -> None:
        """Run A pauses at `point`; run B runs (or rewinds) to the end; A resumes.

        A must not commit what B committed: its outcome is a commit of its
        own batch, a no-op, or a retryable conflict; the invariant then
        checks the tables.
        """
        paused, resume = threading.Event(), threading.Event()
        result: dict[str, object] = {}

        def hook(at: str) -> None:
            if at == point and threading.current_thread() is run_a and not paused.is_set():
                paused.set()
                if not resume.wait(THREAD_TIMEOUT_S):
                    raise AssertionError(f"run A was never resumed at {at}")

        def run_a_body() -> None:
            try:
                result["outcome"] = self._run()
            except BaseException as exc:  # handed to the main thread, which judges it
                result["error"] = exc

        run_a = threading.Thread(target=run_a_body, name="run-A")
        faults.set_hook(hook)
        try:
            run_a.start()
            deadline = time.monotonic() + THREAD_TIMEOUT_S
            while not paused.wait(0.005) and run_a.is_alive():
                assert time.monotonic() < deadline, "run A neither paused nor finished"
            if not paused.is_set() and point in faults.CONDITIONAL_POINTS:
                # A's batch wrote no quarantine, so it ran to the end; nothing to interleave.
                return
            assert paused.is_set(), f"run A did not reach {point}: {result}"
            # Run B, in this thread (the hook ignores it).
            _, state_at = self._effective()
            if other == "rewind" and state_at.batch_id >= 1:
                to_batch = data.draw(st.integers(0, state_at.batch_id - 1), label="B rewinds to")
                outcome_b = rewind(self.spec, to_batch, run_id="test-rewind")
                STATS["concurrent_rewinds"] += 1
            else:
                outcome_b = self._run()
                STATS["concurrent_runs"] += 1
        finally:
            resume.set()
            run_a.join(THREAD_TIMEOUT_S)
            faults.set_hook(None)
        assert not run_a.is_alive(), "run A hung after resuming"
        error = result.get("error")
        if error is not None:
            # Losing a race may end a run with a retryable error; anything else is a bug.
            assert isinstance(error, ConcurrentRunError), repr(error)
            STATS["a_conflicts"] += 1
        else:
            outcome_a = result["outcome"]
            assert outcome_a.status in (Outcome.COMMITTED, Outcome.ALREADY_COMMITTED, Outcome.NO_NEW_DATA), outcome_a
            if outcome_a.status == Outcome.COMMITTED and outcome_b.status == Outcome.COMMITTED:
                assert (outcome_a.epoch, outcome_a.batch_id) != (outcome_b.epoch, outcome_b.batch_id), "double commit"
            STATS[f"a_{outcome_a.status}"] += 1
        STATS["steps"] += 1
        STATS["interleavings"] += 1

    @precondition(lambda self: self._effective()[1].batch_id >= 1)
    @rule(data=st.data())
    def rewind_to_random_batch(self, data: st.DataObject) -> None:
        _, state_at = self._effective()
        STATS["steps"] += 1
        to_batch = data.draw(st.integers(0, state_at.batch_id - 1), label="rewind to")
        outcome = rewind(self.spec, to_batch, run_id="test-rewind")
        assert (outcome.epoch, outcome.batch_id) == (state_at.epoch + 1, to_batch), outcome
        STATS["rewinds"] += 1

    @rule()
    def maintenance(self) -> None:
        """OPTIMIZE and VACUUM on the state: the job must not take them for tampering."""
        table = open_table(self.spec.state_path)
        if table is None:
            return
        table.optimize.compact()
        table.vacuum(dry_run=False)  # the default retention keeps every file a rewind may restore
        STATS["steps"] += 1
        STATS["maintenance"] += 1

    @precondition(lambda self: self._effective()[1].batch_id >= 1)
    @rule(data=st.data())
    def outside_restore_is_refused_then_rewound(self, data: st.DataObject) -> None:
        """A Delta RESTORE of the state behind the job's back (the fence stays):
        the next run must refuse, and a rewind to the ledger's head repairs it."""
        table = open_table(self.spec.state_path)
        table.restore(data.draw(st.integers(0, table.version() - 1), label="RESTORE to version"))
        with pytest.raises(StateChangedOutsideError):
            self._run()
        head = OffsetLedger(self.spec.ledger_path, self.spec.name).load().position
        rewind(self.spec, head.batch_id, run_id="test-rewind")
        STATS["steps"] += 1
        STATS["outside_restores"] += 1

    @rule()
    def drain(self) -> None:
        """Liveness: runs until no new data consume every ready file."""
        for _ in range(len(self._ready_files()) + 2):
            if self._run().status == Outcome.NO_NEW_DATA:
                break
        assert not self._pending_files(), "drained, yet files are still pending"
        STATS["steps"] += 1

    # -- the invariant --------------------------------------------------------------

    @invariant()
    def exactly_once(self) -> None:
        STATS["invariant_checks"] += 1
        view, _ = self._effective()
        lineage: list[LedgerRow] = view.lineage()
        assert [r.batch_id for r in lineage] == list(range(1, len(lineage) + 1)), "batch ids not contiguous"
        if lineage:
            assert lineage[0].start_offsets == {"files": 0}
        for previous, row in zip(lineage, lineage[1:]):
            assert row.start_offsets == previous.end_offsets, f"gap or overlap before batch {row.batch_id}"
        files = [f["name"] for r in lineage for f in r.manifest["files"]]
        assert len(files) == len(set(files)), "a file was consumed twice"
        if lineage:
            assert lineage[-1].end_offsets == {"files": len(files)}, "offsets do not count the consumed files"
        paths = [self.landing / f for f in files]
        expected = fold(paths)
        problems = differences(expected, state_totals(self.spec))
        assert not problems, "state differs from the oracle:\n" + "\n".join(problems[:20])
        self._check_quarantine(lineage, paths, expected)

    def _check_quarantine(self, lineage: list[LedgerRow], paths: list[Path], expected: dict) -> None:
        """Each bad line of the consumed files is quarantined once, by a lineage batch."""
        live = {(r.epoch, r.batch_id) for r in lineage}
        table = open_table(self.spec.quarantine_path)
        rows = read_all(table).to_pylist() if table is not None else []
        quarantined = [(r["file"], r["line"]) for r in rows if (r["epoch"], r["batch_id"]) in live]
        assert len(quarantined) == len(set(quarantined)), "a bad record was quarantined twice"
        lines = sum(1 for p in paths for line in p.read_text(encoding="utf-8").splitlines() if line.strip())
        bad = lines - sum(t.events for t in expected.values())
        assert len(quarantined) == bad, f"{bad} bad lines consumed, {len(quarantined)} quarantined"


def _explore(max_examples: int, steps: int) -> dict[str, int]:
    STATS.clear()
    started = time.monotonic()
    run_state_machine_as_test(
        ProtocolMachine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,  # the same sequences on every CI run
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    report = dict(STATS, seconds=round(time.monotonic() - started, 1))
    print(f"\nprotocol machine: {report}")
    return report


def test_protocol_machine():
    report = _explore(max_examples=8, steps=32)
    # The machine must have explored, not just passed: every kind of step ran.
    assert report["steps"] >= 200, report
    for kind in ("batches_committed", "crashes", "interleavings", "rewinds", "late_files", "maintenance", "outside_restores"):
        assert report.get(kind, 0) > 0, f"no {kind} explored: {report}"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 20 minutes on 2 cores; the suite default (900 s) is for CI tests
def test_protocol_machine_soak():
    report = _explore(max_examples=200, steps=50)
    assert report["steps"] >= 5_000, report


def test_no_cleanup_writes_on_unwind():
    """What makes `SimulatedCrash` equivalent to a kill: nothing on the way out writes.

    No bare ``except:`` or ``except BaseException`` in the protocol's
    modules, no ``with`` but files opened for reading and
    ``storage_errors(...)``, ``_changing_columns(...)`` and ``_racing(...)``
    (which only translate an OSError or a lost race into our errors) and ``steps(...)``
    (which times a step in memory, and only when it completes), and
    ``finally`` only releases the compute engine (in `catch_up`, whose
    engine first waits for the reads ahead already begun and cancels the
    others: reads write nothing).
    """
    allowed_finally = {"engine.close()"}
    for name in PROTOCOL_MODULES:
        tree = ast.parse((ROOT / "spark_jobs" / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler):
                caught = ast.unparse(node.type) if node.type is not None else "<bare>"
                assert caught not in ("<bare>", "BaseException"), f"{name}:{node.lineno} catches {caught}"
            if isinstance(node, ast.Try) and node.finalbody:
                body = {ast.unparse(stmt) for stmt in node.finalbody}
                assert body <= allowed_finally, f"{name}:{node.lineno} finally runs {body}"
            if isinstance(node, ast.With):
                for item in node.items:
                    expr = ast.unparse(item.context_expr)
                    allowed = ("open(", "self.open(", "self.lister.open(", "storage_errors(", "self._changing_columns(", "_racing(", "steps(")
                    assert expr.startswith(allowed), f"{name}:{node.lineno} uses {expr}"
