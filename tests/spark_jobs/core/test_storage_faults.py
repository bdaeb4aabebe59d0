"""Disk full and I/O errors on the commit path, injected with strace into the real CLI.

Each case runs ``python -m spark_jobs run`` (Spark and all) under strace and
fails one syscall of one Delta write with ENOSPC or EIO. The run must exit 1
(retryable) with a message naming the table and the cause and saying that a
re-run is safe; every table must still load and read, with no partial or
stray entry in any ``_delta_log``; and the next plain run must end exact.

How the faults are aimed (found with ``strace -f -e trace=file,write``):
delta-rs commits a log entry by creating ``_delta_log/<version>.json#1``
(openat O_CREAT|O_EXCL), writing it, and publishing it with ``linkat`` to
``<version>.json`` (then unlinking the temp name). Those paths are known in
advance for a fresh pipeline, so ``-P <path>`` restricts the injection to
exactly that entry; strace matches the ``write``'s file descriptor to the
path. Data files are staged as ``part-<uuid>...parquet#1`` and renamed into
place; the uuid is random, so ``-P`` cannot aim at them. Instead strace
attaches (``-p``) to the CLI process only once it has started the JVM (so
Spark's own shuffle renames, in the JVM process, are not traced) and fails
the first ``rename``: with the batch already planned (no ledger write in
this run) and no bad records (no quarantine write), the only rename left in
the Python process is the state's data file.

A log entry's fault is the job's process's alone: those runs are thin
clients of the test process's shared Spark Connect server (`on_connect`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from spark_jobs.core import faults
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.core.delta_io import describe_os_error, read_all
from spark_jobs.errors import StorageError, is_retryable
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import PipelineSpec, load_spec
from spark_jobs.core.state import StateTable
from tests.conftest import ROOT, assert_exact, run_cli
from tests.spark_jobs.arrow_compute import ArrowCompute

#: Log entry names of a fresh pipeline's first batch (see the module docstring).
STATE_BATCH_1_LOG = "00000000000000000001.json"  # state v0 is the empty create
LEDGER_COMMITTED_1_LOG = "00000000000000000002.json"  # ledger v0 create, v1 planned, v2 committed
RECORDS, BAD_EVERY = 40, 9


def _strace_injection_problem() -> str | None:
    """None if strace can inject an error here, else why not."""
    if shutil.which("strace") is None:
        return "strace is not installed"
    probe = Path(f"/tmp/microbatch-strace-probe-{os.getpid()}")
    try:
        result = subprocess.run(
            ["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(probe), "-e", "trace=openat",
             "-e", "inject=openat:error=ENOSPC", sys.executable, "-c", f"open({str(probe)!r}, 'w')"],
            capture_output=True, text=True, timeout=60,
        )
    finally:
        probe.unlink(missing_ok=True)
    if "No space left on device" not in result.stderr:
        return f"strace cannot inject syscall errors here (ptrace not permitted?): {result.stderr.strip()[-300:]}"
    return None


_problem = _strace_injection_problem()
needs_strace = pytest.mark.skipif(_problem is not None, reason=_problem or "")


def _pipeline(spec_path: Path, *, bad_lines: bool) -> PipelineSpec:
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=RECORDS, users=8,
               bad_every=BAD_EVERY if bad_lines else 0)
    return load_spec(spec_path)


def _run_under_strace(spec_path: Path, target: str, syscall: str, errno: str, log: Path) -> subprocess.CompletedProcess[str]:
    """`microbatch run` with `syscall` on `target` (a path) failing with `errno`."""
    return subprocess.run(
        ["strace", "-f", "-qq", "-e", "signal=none", "-o", str(log), "-P", target,
         "-e", f"trace={syscall}", "-e", f"inject={syscall}:error={errno}",
         sys.executable, "-m", "spark_jobs", "run", str(spec_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )


def _assert_failed_clearly(result: subprocess.CompletedProcess[str], cause: str, table: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error, f"no error line:\n{result.stderr[-3000:]}"
    message = error[0]
    assert cause in message and table in message and "safe to re-run" in message, message
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def _assert_tables_intact(spec: PipelineSpec) -> dict[str, int]:
    """Every table loads and reads; every log entry is complete JSON; no temp entries left.

    Returns each table's version, for the caller to check what was committed.
    """
    versions = {}
    for name, path in (("state", spec.state_path), ("ledger", spec.ledger_path), ("quarantine", spec.quarantine_path)):
        if not Path(path).exists():
            continue
        log = Path(path) / "_delta_log"
        for entry in log.iterdir():
            assert entry.suffix == ".json" or entry.name.endswith(".checkpoint.parquet") or entry.name == "_last_checkpoint", (
                f"stray entry {entry.name} in {log}"
            )
            if entry.suffix == ".json":
                for line in entry.read_text(encoding="utf-8").splitlines():
                    json.loads(line)  # a torn entry would not parse
        table = DeltaTable(path)
        read_all(table)
        versions[name] = table.version()
    return versions


def _assert_next_run_exact(spec_path: Path, spec: PipelineSpec, *, bad_lines: bool, env: dict[str, str] | None = None) -> None:
    result = run_cli("run", str(spec_path), "--json", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lineage = assert_exact(spec_path)
    assert len(lineage) == 1 and lineage[0].records_in == RECORDS
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    assert sorted(r.status for r in rows) == [RowStatus.COMMITTED, RowStatus.PLANNED]  # one plan, one commit: nothing twice
    quarantined = read_all(DeltaTable(spec.quarantine_path)).num_rows if bad_lines else 0
    assert quarantined == (RECORDS // BAD_EVERY if bad_lines else 0)


@needs_strace
@pytest.mark.parametrize(
    ("case", "syscall", "errno", "cause"),
    [
        ("state_log_write", "write", "ENOSPC", "No space left on device"),
        ("state_log_link", "linkat", "EIO", "Input/output error"),
        ("ledger_committed_write", "write", "ENOSPC", "No space left on device"),
    ],
)
def test_fault_on_a_delta_log_entry(spec_path, tmp_path, on_connect, case, syscall, errno, cause):
    """A log entry's write or publication fails in the job's process, where
    delta-rs commits: its runs are thin clients of the shared Connect
    server (strace then follows no JVM, whose every syscall it would slow)."""
    spec = _pipeline(spec_path, bad_lines=True)
    if case.startswith("state"):
        target, table = Path(spec.state_path) / "_delta_log" / f"{STATE_BATCH_1_LOG}#1", spec.state_path
    else:
        target, table = Path(spec.ledger_path) / "_delta_log" / f"{LEDGER_COMMITTED_1_LOG}#1", spec.ledger_path
    log = tmp_path / "strace.log"
    result = _run_under_strace(spec_path, str(target), syscall, errno, log)
    injected = [line for line in log.read_text().splitlines() if "(INJECTED)" in line]
    assert injected, f"the fault never fired:\n{log.read_text()[-2000:]}"
    _assert_failed_clearly(result, cause, table)
    versions = _assert_tables_intact(spec)
    if case.startswith("state"):
        assert versions["state"] == 0  # only the empty create: batch 1 did not commit
    else:
        assert versions["state"] == 1  # batch 1 committed; its ledger row did not
        assert "durable in the state table" in result.stderr
        assert versions["ledger"] == 1
    _assert_next_run_exact(spec_path, spec, bad_lines=True)


@needs_strace
def test_disk_full_on_the_state_data_file(spec_path, tmp_path, shared_connect):
    """The state's data file written by delta-rs in the job's process
    (`engine.state_write: driver`; the executors' writes happen in Spark's
    workers, which the attached strace does not follow). The faulted run
    starts Spark itself (strace attaches once it has); the run after it,
    whose subject is the protocol's recovery, is the shared server's client."""
    from tests.conftest import oracle_spec_dict, write_spec

    spec_path = write_spec(spec_path.parent, oracle_spec_dict(engine={"state_write": "driver"}))
    spec = _pipeline(spec_path, bad_lines=False)
    # Plan batch 1 in process, crashing right after (no JVM needed): the CLI
    # run below replays the plan and so writes no ledger row before the state.
    faults.set_hook(_crash_after_plan)
    try:
        with pytest.raises(_Crash):
            run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    finally:
        faults.set_hook(None)
    log = tmp_path / "strace.log"
    cli = subprocess.Popen(
        [sys.executable, "-m", "spark_jobs", "run", str(spec_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    _wait_for_spark_submit(cli.pid)  # from now on, Spark's renames happen in a process strace does not follow
    strace = subprocess.Popen(
        ["strace", "-f", "-e", "signal=none", "-o", str(log), "-p", str(cli.pid),
         "-e", "trace=rename", "-e", "inject=rename:error=ENOSPC:when=1"],
        stderr=subprocess.PIPE, text=True,
    )
    assert f"Process {cli.pid} attached" in strace.stderr.readline()
    out, err = cli.communicate(timeout=300)
    strace.wait(timeout=60)
    injected = [line for line in log.read_text().splitlines() if "(INJECTED)" in line]
    assert len(injected) == 1 and f"{spec.state_path}/part-" in injected[0], log.read_text()[-2000:]
    _assert_failed_clearly(subprocess.CompletedProcess(cli.args, cli.returncode, out, err), "No space left on device", spec.state_path)
    assert _assert_tables_intact(spec)["state"] == 0
    _assert_next_run_exact(spec_path, spec, bad_lines=False, env={"MICROBATCH_SPARK_MASTER": shared_connect})


class _Crash(BaseException):
    """Stops an in-process run at a fault point, as a kill would (see test_protocol_machine)."""


def _crash_after_plan(point: str) -> None:
    if point == "after_plan":
        raise _Crash(point)


def _wait_for_spark_submit(pid: int, timeout: float = 120.0) -> None:
    """Wait until process `pid` has forked pyspark's `spark-submit` (which execs into the JVM).

    Other children (``java -version`` for the JVM cache key) come earlier and
    are not it: attaching then would trace the JVM, forked later.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spark" in cmdline:
                return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} did not start spark-submit within {timeout} s")


# -- the error wrapping itself, without strace ---------------------------------------


DELTA_RS_ENOSPC = (
    "Generic LocalFileSystem error\n          \x1b[31m\u21b3\x1b[0m Unable to copy data to file\n"
    "           \x1b[31m\u21b3\x1b[0m No space left on device (os error 28)"
)


def test_describe_os_error_flattens_the_rust_chain():
    assert describe_os_error(OSError(DELTA_RS_ENOSPC)) == (
        "Generic LocalFileSystem error: Unable to copy data to file: No space left on device (os error 28)"
    )


def test_a_storage_error_in_the_state_commit_is_retryable_and_names_the_table(spec_path, monkeypatch):
    spec = _pipeline(spec_path, bad_lines=False)

    def disk_full(*args, **kwargs):
        raise OSError(DELTA_RS_ENOSPC)

    monkeypatch.setattr(StateTable, "commit_batch", disk_full)
    with pytest.raises(StorageError) as raised:
        run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    assert is_retryable(raised.value)
    message = str(raised.value)
    assert f"could not commit batch 1 (epoch 0) to the state table: storage error on Delta table {spec.state_path}" in message
    assert "No space left on device (os error 28)" in message and "safe to re-run" in message
    monkeypatch.undo()
    run_batch(spec, RunOptions(run_id="test"), compute_factory=ArrowCompute)
    assert_exact(spec_path)


def test_storage_errors_translates_only_os_failures():
    from deltalake.exceptions import CommitFailedError, DeltaError

    from spark_jobs.core.delta_io import storage_errors

    data_file = DeltaError("Failed to parse parquet: External: Generic LocalFileSystem error: Unable to rename file: No space left on device (os error 28)")
    with pytest.raises(StorageError, match=r"commit: storage error on Delta table /t: Failed to parse parquet.*\(os error 28\)"):
        with storage_errors("commit", "/t"):
            raise data_file
    for other in (CommitFailedError("conflict"), DeltaError("Schema error: mismatch"), ValueError("x")):
        with pytest.raises(type(other)):
            with storage_errors("commit", "/t"):
                raise other
