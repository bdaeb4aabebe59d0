"""Pipeline identity and spec changes over a pipeline's life (issue 11, sections 1 and 2).

JVM-free: the pure-Arrow compute runs the real protocol on real Delta tables.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from deltalake import write_deltalake

from spark_jobs.cli import main
from spark_jobs.core import faults
from spark_jobs.core.delta_io import ensure_table, open_table, read_all
from spark_jobs.core.identity import SpecIdentity, changes
from spark_jobs.core.inspect import history, status
from spark_jobs.core.ledger import SCHEMA, OffsetLedger, RowStatus
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import EXIT_TERMINAL, RewindError, SpecChangedError, StateLedgerMismatchError
from tests.conftest import assert_exact, oracle_spec_dict, write_spec
from tests.spark_jobs.arrow_compute import ArrowCompute


def _run(spec_file: Path) -> str:
    return run_batch(load_spec(spec_file), RunOptions(run_id="test"), ArrowCompute).status


def _edit(spec_file: Path, change) -> None:
    data = yaml.safe_load(spec_file.read_text())
    change(data)
    spec_file.write_text(yaml.safe_dump(data, sort_keys=False))


def _ledger_rows(spec_file: Path) -> list:
    spec = load_spec(spec_file)
    return OffsetLedger(spec.ledger_path, spec.name).load().rows


# -- 1. spec changes ----------------------------------------------------------------------


def test_a_changed_merge_rule_is_refused_before_any_write(spec_path, capsys):
    """Reproduced: `sum` became `max` and the new rule was applied to old totals."""
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=40, users=5)
    assert _run(spec_path) == "committed"
    _edit(spec_path, lambda d: d["state"]["merge"].update(amount="max"))
    write_wave(landing, 1, files=1, records_per_file=40, users=5)
    before = len(_ledger_rows(spec_path))
    state_version = open_table(load_spec(spec_path).state_path).version()
    with pytest.raises(SpecChangedError, match="merge rule of 'amount' changed from sum to max") as info:
        _run(spec_path)
    message = str(info.value)
    assert "revert the spec" in message and "--to-batch 0" in message and "new state path and a new checkpoint" in message
    assert len(_ledger_rows(spec_path)) == before, "nothing is written"
    assert open_table(load_spec(spec_path).state_path).version() == state_version
    assert main(["-q", "run", str(spec_path)]) == EXIT_TERMINAL
    assert "merge rule of 'amount'" in capsys.readouterr().err
    # status shows the pending change; reverting the spec lets the pipeline go on, exact.
    assert "merge rule of 'amount' changed" in (status(load_spec(spec_path)).note or "")
    _edit(spec_path, lambda d: d["state"]["merge"].update(amount="sum"))
    assert _run(spec_path) == "committed"
    assert_exact(spec_path)


def test_changed_keys_are_refused_and_every_change_is_named(spec_path):
    """Reproduced: keys [user_id, day] became [user_id]; old rows stopped matching."""
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=20, users=3)
    assert _run(spec_path) == "committed"

    def change(d):
        d["state"]["keys"] = ["user_id", "last_seen"]
        d["state"]["merge"].pop("last_seen")
        d["source"]["schema"] = "event_id STRING, user_id STRING, amount FLOAT, ts TIMESTAMP"

    _edit(spec_path, change)
    with pytest.raises(SpecChangedError) as info:
        _run(spec_path)
    message = str(info.value)
    assert "state.keys changed from ['user_id'] to ['user_id', 'last_seen']" in message
    assert "merge column 'last_seen' (max) was removed or renamed" in message
    assert "source column 'amount' changed type from DOUBLE to FLOAT" in message


def test_rewind_to_0_recomputes_under_the_new_spec(spec_path):
    landing = spec_path.parent / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=1, records_per_file=30, users=4)
        assert _run(spec_path) == "committed"
    _edit(spec_path, lambda d: d["state"]["merge"].update(amount="max"))
    with pytest.raises(SpecChangedError):
        _run(spec_path)
    spec = load_spec(spec_path)
    with pytest.raises(RewindError, match="computed under another spec"):
        rewind(spec, 1, run_id="test-rewind")
    rewind(spec, 0, run_id="test-rewind")
    assert _run(spec_path) == "committed"
    # One replay batch read every file: the max of one batch's sums is the sum.
    assert [r.batch_id for r in assert_exact(spec_path)] == [1]
    fingerprints = {(r.epoch, r.status): r.spec_fingerprint for r in history(spec)}
    assert fingerprints[(0, RowStatus.COMMITTED)] != fingerprints[(1, RowStatus.COMMITTED)]


def test_a_new_transform_text_is_compatible_and_recorded(spec_path):
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    _edit(spec_path, lambda d: d.update(transform=d["transform"].replace("FROM batch", "FROM   batch")))
    write_wave(landing, 1, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    committed = sorted((r for r in _ledger_rows(spec_path) if r.status is RowStatus.COMMITTED), key=lambda r: r.batch_id)
    assert len({r.spec_fingerprint for r in committed}) == 2
    assert committed[1].spec["transform"].count("FROM   batch") == 1
    assert_exact(spec_path)


def test_compatibility_rules():
    base = SpecIdentity(("k",), {"n": "sum"}, {"type": "files", "location": "/in", "format": "json",
                        "schema": [["k", "STRING", True], ["n", "INT", True]]}, "/state", "SELECT 1")

    def with_(**kw):
        return SpecIdentity(**{**base.__dict__, **kw})

    assert changes(base, base) == ([], [])
    widened = with_(source={**base.source, "schema": [["k", "STRING", True], ["n", "BIGINT", True], ["x", "DATE", True]]})
    assert changes(base, widened) == ([], ["source column 'n' changed type from INT to BIGINT", "new source column 'x'"])
    narrowed = with_(source={**base.source, "schema": [["k", "STRING", True], ["n", "SMALLINT", True]]})
    assert changes(base, narrowed)[0] == ["source column 'n' changed type from INT to SMALLINT"]
    assert changes(base, with_(merge={"n": "sum", "m": "max"})) == ([], ["new merge column 'm' (max): old rows hold null"])
    assert changes(base, with_(state="/other"))[0] == ["state.path changed from /state to /other"]
    assert changes(base, with_(source={**base.source, "format": "csv"}))[0] == ["source format changed from 'json' to 'csv'"]
    assert base.fingerprint != with_(transform="SELECT 2").fingerprint


# -- 2. identity ---------------------------------------------------------------------------


def _twin(tmp_path: Path, folder: str) -> Path:
    """A pipeline named `clicks` with its own source and checkpoint, sharing one state table."""
    spec = oracle_spec_dict(
        source={**oracle_spec_dict()["source"], "path": f"{folder}/landing"},
        state={**oracle_spec_dict()["state"], "path": str(tmp_path / "shared" / "state")},
        checkpoint=f"{folder}/checkpoint",
    )
    return write_spec(tmp_path, spec, name=f"{folder}.yaml")


def test_two_pipelines_with_one_name_sharing_a_state_are_told_apart(tmp_path):
    """Reproduced: the second recorded the first's batch as its own, then skipped its own files."""
    first, second = _twin(tmp_path, "a"), _twin(tmp_path, "b")
    write_wave(tmp_path / "a" / "landing", 0, files=1, records_per_file=100)
    write_wave(tmp_path / "b" / "landing", 0, files=1, records_per_file=100)  # same file names
    assert _run(first) == "committed"
    with pytest.raises(StateLedgerMismatchError, match="not this state's"):
        _run(second)
    assert _ledger_rows(second) == [], "nothing was written to the second pipeline's ledger"
    assert main(["-q", "run", str(second)]) == EXIT_TERMINAL


def test_a_state_committed_by_another_pipeline_id_between_plan_and_commit_is_refused(tmp_path):
    """Both planned batch 1 with the same range; the first committed it. The
    second must not take that commit for its own, though names and offsets match."""
    first, second = _twin(tmp_path, "a"), _twin(tmp_path, "b")
    write_wave(tmp_path / "a" / "landing", 0, files=1, records_per_file=50)
    write_wave(tmp_path / "b" / "landing", 0, files=1, records_per_file=50)

    def other_pipeline_commits(point: str) -> None:
        if point == "after_plan":
            faults.set_hook(None)
            assert _run(first) == "committed"

    faults.set_hook(other_pipeline_commits)
    try:
        with pytest.raises(StateLedgerMismatchError, match="id "):
            _run(second)
    finally:
        faults.set_hook(None)
    [planned] = _ledger_rows(second)
    assert planned.status is RowStatus.PLANNED and planned.pipeline_id != _ledger_rows(first)[0].pipeline_id


def test_every_row_and_commit_carries_the_pipeline_id(spec_path):
    landing = spec_path.parent / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=1, records_per_file=10)
        assert _run(spec_path) == "committed"
    rewind(load_spec(spec_path), 1, run_id="test-rewind")
    ids = {r.pipeline_id for r in _ledger_rows(spec_path)}
    assert len(ids) == 1 and None not in ids


def test_a_ledger_from_before_ids_is_upgraded_in_place(spec_path):
    """Format-1 ledgers lack the new columns: the next write adds them; old rows read as None."""
    spec = load_spec(spec_path)
    old_schema = pa.schema([f for f in SCHEMA if f.name not in ("pipeline_id", "spec", "spec_fingerprint")])
    old_row = {"pipeline": "other", "epoch": 0, "batch_id": 1, "status": "planned", "start_offsets": "{}",
               "end_offsets": "{}", "manifest": "{}", "format_version": 1}
    write_deltalake(ensure_table(spec.ledger_path, old_schema), pa.Table.from_pylist([old_row], old_schema), mode="append")
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    assert _run(spec_path) == "committed"
    assert "pipeline_id" in pa.schema(open_table(spec.ledger_path).schema().to_arrow()).names
    assert_exact(spec_path)
    [old] = OffsetLedger(spec.ledger_path, "other").load().rows
    assert (old.pipeline_id, old.spec, old.spec_fingerprint) == (None, None, None)


def test_a_new_merge_column_joins_the_state_with_nulls_for_old_rows(tmp_path, compute):
    """Compatible: the state gains the column; rows no later batch touched hold null (Spark end to end)."""
    spec_path = write_spec(tmp_path, oracle_spec_dict(
        transform="SELECT user_id, count(*) AS events FROM batch GROUP BY user_id",
        state={"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum"}},
    ))
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=40, users=8)
    assert run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute).status == "committed"

    def add_amount(d):
        d["transform"] = "SELECT user_id, count(*) AS events, sum(amount) AS amount FROM batch WHERE user_id < 'user000004' GROUP BY user_id"
        d["state"]["merge"]["amount"] = "sum"

    _edit(spec_path, add_amount)
    write_wave(landing, 1, files=1, records_per_file=40, users=8)
    assert run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute).status == "committed"
    rows = {r["user_id"]: r for r in read_all(open_table(load_spec(spec_path).state_path)).to_pylist()}
    touched = {u for u, r in rows.items() if r["_batch_id"] == 2}
    assert touched and all(u < "user000004" for u in touched)
    assert {u for u, r in rows.items() if r["amount"] is not None} == touched, "old rows hold null"
    committed = [r for r in history(load_spec(spec_path)) if r.status is RowStatus.COMMITTED]
    assert len({r.spec_fingerprint for r in committed}) == 2
