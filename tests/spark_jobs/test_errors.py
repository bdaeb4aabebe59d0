"""One error policy: the class of an error decides the CLI's exit code and
whether Airflow retries, and formats written by a newer version are refused."""

from __future__ import annotations

import inspect
import json

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from spark_jobs import errors
from spark_jobs.cli import main
from spark_jobs.core import commits, ledger
from spark_jobs.core.commits import METADATA_KEY
from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.fencing import STATE_FENCE, Position, commit_properties
from spark_jobs.core.inspect import status
from spark_jobs.core.ledger import OffsetLedger
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import (
    EXIT_RETRYABLE,
    EXIT_TERMINAL,
    ConcurrentRunError,
    MicrobatchError,
    NewerFormatError,
    StateChangedOutsideError,
    Terminal,
    Transient,
    exit_code,
    is_retryable,
)
from tests.spark_jobs.arrow_compute import ArrowCompute


def _error_classes() -> list[type[MicrobatchError]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, MicrobatchError) and cls is not MicrobatchError
    ]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_is_terminal_or_transient_and_both_orchestrators_agree(cls):
    assert issubclass(cls, Terminal) != issubclass(cls, Transient), f"{cls.__name__} must be exactly one"
    exc = cls.__new__(cls)
    assert exit_code(exc) == (EXIT_TERMINAL if issubclass(cls, Terminal) else EXIT_RETRYABLE)
    assert is_retryable(exc) == issubclass(cls, Transient)


def test_errors_carry_their_context_as_attributes():
    exc = StateChangedOutsideError("clicks", "/lake/state", [(5, "DELETE")], Position(0, 3))
    assert (exc.pipeline, exc.path, exc.position, exc.changes) == ("clicks", "/lake/state", Position(0, 3), [(5, "DELETE")])
    assert "--to-batch 3" in str(exc)
    assert ConcurrentRunError("x", pipeline="clicks").pipeline == "clicks"
    assert is_retryable(RuntimeError("not ours")), "unexpected errors keep the orchestrator's retries"


def _one_batch(spec_path) -> None:
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=20)
    spec = load_spec(spec_path)
    assert run_batch(spec, RunOptions(run_id="test"), ArrowCompute).status == "committed"


def test_a_state_changed_outside_exits_2_because_a_retry_cannot_help(spec_path, capsys):
    """It exited 1 ("retrying is safe") before the policy was one."""
    _one_batch(spec_path)
    open_table(load_spec(spec_path).state_path).delete("events > 0")
    assert main(["-q", "run", str(spec_path)]) == EXIT_TERMINAL
    assert "changed outside `microbatch`" in capsys.readouterr().err


def test_a_ledger_row_from_a_newer_format_is_refused(spec_path):
    _one_batch(spec_path)
    spec = load_spec(spec_path)
    table = open_table(spec.ledger_path)
    record = read_all(table).to_pylist()[-1]
    newer = {**record, "format_version": ledger.FORMAT_VERSION + 1}
    write_deltalake(table, pa.Table.from_pylist([newer], read_all(table).schema), mode="append")
    with pytest.raises(NewerFormatError, match="offset ledger .* format version .* by a newer microbatch"):
        OffsetLedger(spec.ledger_path, spec.name).load()


def test_a_state_commit_from_a_newer_format_is_refused(spec_path):
    """Reconcile reads the lagging commit's metadata, and checks its version first."""
    _one_batch(spec_path)
    spec = load_spec(spec_path)
    table = open_table(spec.state_path)
    metadata = {"format_version": commits.FORMAT_VERSION + 1, "txn": Position(0, 2).encode(), "kind": "batch", "pipeline": spec.name,
                "epoch": 0, "batch_id": 2, "start_offsets": {"files": 1}, "end_offsets": {"files": 2}}
    empty = pa.schema(table.schema().to_arrow()).empty_table()
    props = commit_properties(STATE_FENCE, Position(0, 2), {METADATA_KEY: json.dumps(metadata)})
    write_deltalake(table, empty, mode="append", commit_properties=props)
    with pytest.raises(NewerFormatError, match="state commit .* by a newer microbatch"):
        run_batch(spec, RunOptions(run_id="test"), ArrowCompute)
    assert "newer microbatch" in (status(spec).note or "")
