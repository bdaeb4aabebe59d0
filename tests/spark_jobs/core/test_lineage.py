"""A run's cost does not grow with the pipeline's age (issue 11, section 5):
the ledger is read by position, and consumed files are looked up in the
consumed index, a cache of the ledger that is never trusted past what it
says it holds. JVM-free: the pure-Arrow compute runs the real protocol on
real Delta tables. (The figures are in docs/benchmarks.md, from
bench/long_life.py, in the history: `git show 140d2d9:bench/long_life.py`; these
tests check what the figures rely on.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from deltalake import write_deltalake

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.ledger import OffsetLedger, RowStatus, _to_arrow
from spark_jobs.core.lineage import CONSUMED_FENCE
from spark_jobs.core.maintain import maintain
from spark_jobs.core.pipeline import Pipeline
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from tests.conftest import assert_exact, crash_at, oracle_spec_dict, write_spec
from tests.spark_jobs.arrow_compute import ArrowCompute


def _run(spec_path: Path, **options) -> str:
    return run_batch(load_spec(spec_path), RunOptions(run_id="test", **options), ArrowCompute).status


def _index(spec_path: Path) -> tuple[object, list[str]]:
    """The consumed index's position and its keys, for the spec's pipeline."""
    spec = load_spec(spec_path)
    p = Pipeline(spec)
    table = p.consumed.open()
    if table is None:
        return None, []
    ledger = p.ledger.load().table.metadata().id
    rows = [r for r in read_all(table).to_pylist() if r["pipeline"] == spec.name and r["ledger"] == ledger]
    return p.consumed.position(table, ledger), sorted(r["key"] for r in rows)


def _consumed_names(spec_path: Path) -> list[str]:
    spec = load_spec(spec_path)
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    return sorted(f["name"] for r in view.lineage() for f in r.manifest["files"])


def _drain(spec_path: Path, wave: int, files: int, records: int = 10) -> Path:
    """Land a wave of files and run until nothing is new; the landing folder."""
    landing = spec_path.parent / "landing"
    write_wave(landing, wave, files=files, records_per_file=records)
    while _run(spec_path) == "committed":
        pass
    return landing


@pytest.fixture
def spec_path(tmp_path) -> Path:
    return write_spec(tmp_path, oracle_spec_dict(batch={"max_files": 2}))


def test_runs_never_read_the_whole_ledger(spec_path, monkeypatch):
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=6, records_per_file=10)
    for _ in range(3):
        assert _run(spec_path) == "committed"

    from spark_jobs.core import ledger

    def read_all(table, *, where=None, columns=()):
        if where is None:
            raise AssertionError("a run read the whole offset ledger")
        return real_read_all(table, where=where, columns=columns)

    real_read_all = ledger.read_all
    monkeypatch.setattr(ledger, "read_all", read_all)
    assert _run(spec_path) == "no_new_data"
    write_wave(landing, 1, files=1, records_per_file=10)
    assert _run(spec_path) == "committed"
    assert _run(spec_path) == "no_new_data"
    monkeypatch.undo()
    assert_exact(spec_path)


def test_the_index_follows_the_ledger_and_holds_exactly_the_consumed_files(spec_path):
    _drain(spec_path, 0, files=5, records=10)
    at, keys = _index(spec_path)
    spec = load_spec(spec_path)
    assert at == OffsetLedger(spec.ledger_path, spec.name).load().position
    assert keys == _consumed_names(spec_path)


def test_an_index_left_behind_by_a_crash_is_not_trusted_past_its_position(spec_path):
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=2, records_per_file=10)
    assert _run(spec_path) == "committed"
    write_wave(landing, 1, files=1, records_per_file=10)
    with crash_at("after_ledger_commit"):  # committed and recorded, the index not yet
        _run(spec_path)
    at, _ = _index(spec_path)
    spec = load_spec(spec_path)
    assert at is not None and at < OffsetLedger(spec.ledger_path, spec.name).load().position
    # The batch the index lacks is read from the ledger: its files are not new.
    assert _run(spec_path) == "no_new_data"
    write_wave(landing, 2, files=1, records_per_file=10)
    assert _run(spec_path) == "committed"
    assert _index(spec_path)[1] == _consumed_names(spec_path)
    assert_exact(spec_path)


def test_a_missing_index_is_rebuilt_from_the_ledger(spec_path):
    """A pipeline older than the index (or whose index was deleted) loses nothing."""
    landing = _drain(spec_path, 0, files=4, records=10)
    shutil.rmtree(Path(load_spec(spec_path).consumed_path))
    assert _run(spec_path) == "no_new_data"
    write_wave(landing, 1, files=1, records_per_file=10)
    assert _run(spec_path) == "committed"
    assert _index(spec_path)[1] == _consumed_names(spec_path)
    shutil.rmtree(Path(load_spec(spec_path).consumed_path))
    maintain(load_spec(spec_path))
    assert _index(spec_path)[1] == _consumed_names(spec_path), "maintain builds the index too"
    assert_exact(spec_path)


def test_a_rewind_rebuilds_the_index_for_its_epoch(spec_path):
    _drain(spec_path, 0, files=6, records=10)
    spec = load_spec(spec_path)
    rewind(spec, 1, run_id="test")
    at, keys = _index(spec_path)
    assert at is not None and at.epoch == 1
    assert keys == _consumed_names(spec_path), "only batch 1's files are consumed after the rewind"
    while _run(spec_path) == "committed":
        pass
    assert_exact(spec_path)


def test_an_index_from_an_earlier_epoch_is_not_used(spec_path, monkeypatch):
    """If the rebuild after a rewind fails, lookups read the lineage instead."""
    _drain(spec_path, 0, files=4, records=10)
    from spark_jobs.core.lineage import ConsumedIndex

    monkeypatch.setattr(ConsumedIndex, "rebuild", lambda *a, **k: False)
    rewind(load_spec(spec_path), 1, run_id="test")
    at, _ = _index(spec_path)
    assert at.epoch == 0, "the index still holds epoch 0's lineage"
    assert _run(spec_path) == "committed", "batch 2's files are pending again in epoch 1"
    monkeypatch.undo()
    while _run(spec_path) == "committed":
        pass
    assert_exact(spec_path)


def test_file_names_that_are_sql_syntax_are_looked_up_as_names(spec_path):
    landing = spec_path.parent / "landing"
    record = {"event_id": "e1", "user_id": "u1", "amount": 1.0, "ts": "2026-11-23T10:00:00Z"}
    names = ["it's.json", "a' OR '1'='1.json", "back\\slash.json", "ünï cødé.json", "x'); DROP TABLE t; --.json"]
    for i, name in enumerate(names):
        (landing / name).write_text(json.dumps({**record, "event_id": f"e{i}"}) + "\n")
    while _run(spec_path) == "committed":
        pass
    assert _index(spec_path)[1] == sorted(names)
    assert _run(spec_path) == "no_new_data", "each name was found in the index"
    assert_exact(spec_path)


def test_a_listing_of_many_files_is_looked_up_in_bulk(tmp_path):
    spec_path = write_spec(tmp_path, oracle_spec_dict(batch={"max_files": 400}))
    landing = tmp_path / "landing"
    write_wave(landing, 0, files=700, records_per_file=1)
    assert _run(spec_path) == "committed"
    assert _run(spec_path) == "committed"
    assert _run(spec_path) == "no_new_data", "700 listed names all found"
    assert_exact(spec_path)


def test_a_ledger_without_fences_is_read_in_full(spec_path):
    """Rows written without fences (a ledger older than them) still give the head."""
    _drain(spec_path, 0, files=4, records=10)
    spec = load_spec(spec_path)
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    copy = spec_path.parent / "unfenced"
    write_deltalake(str(copy), _to_arrow(view.rows), mode="append")
    unfenced = OffsetLedger(str(copy), spec.name).load()
    assert unfenced.head == view.head and unfenced.head.status is RowStatus.COMMITTED


def test_the_index_is_per_pipeline_in_a_shared_checkpoint(tmp_path):
    """Two pipelines sharing a checkpoint folder: each index holds its own files;
    one's rebuild leaves the other's rows alone."""
    first = write_spec(tmp_path, oracle_spec_dict(name="first", source={**oracle_spec_dict()["source"], "path": "a"},
                                                  state={**oracle_spec_dict()["state"], "path": "lake/a"},
                                                  checkpoint="lake/_checkpoints/shared"), "first.yaml")
    second = write_spec(tmp_path, oracle_spec_dict(name="second", source={**oracle_spec_dict()["source"], "path": "b"},
                                                   state={**oracle_spec_dict()["state"], "path": "lake/b"},
                                                   checkpoint="lake/_checkpoints/shared"), "second.yaml")
    write_wave(tmp_path / "a", 0, files=2, records_per_file=10)
    write_wave(tmp_path / "b", 5, files=3, records_per_file=10)
    assert _run(first) == "committed" and _run(second) == "committed"
    rewind(load_spec(first), 0, run_id="test")
    table = open_table(load_spec(first).consumed_path)
    rows = read_all(table).to_pylist()
    assert sorted(r["key"] for r in rows if r["pipeline"] == "second") == _consumed_names(second)
    assert not [r for r in rows if r["pipeline"] == "first"], "first was rewound to 0: nothing consumed"
    second_ledger = OffsetLedger(load_spec(second).ledger_path, "second").load().table.metadata().id
    assert table.transaction_version(f"{CONSUMED_FENCE}/second/{second_ledger}") is not None
    assert _run(first) == "committed"
    assert_exact(first) and assert_exact(second)


def test_an_index_left_from_a_checkpoint_started_over_is_not_trusted(spec_path):
    """Deleting the ledger and the state to start over (the index left in
    place) reads every file again: the old rows belong to the old ledger."""
    _drain(spec_path, 0, files=6, records=10)
    spec = load_spec(spec_path)
    shutil.rmtree(spec.ledger_path)
    shutil.rmtree(spec.state_path)
    while _run(spec_path, max_files=1) == "committed":
        pass
    assert _index(spec_path)[1] == _consumed_names(spec_path)
    assert len(_consumed_names(spec_path)) == 6
    assert_exact(spec_path)


def test_maintain_sorts_the_index_by_name(spec_path):
    landing = _drain(spec_path, 0, files=8, records=5)
    maintain(load_spec(spec_path))
    table = open_table(load_spec(spec_path).consumed_path)
    keys = read_all(table).column("key").to_pylist()
    assert keys == sorted(keys) and len(keys) == 8
    assert _run(spec_path) == "no_new_data"
    write_wave(landing, 1, files=1, records_per_file=5)
    assert _run(spec_path) == "committed"
    assert_exact(spec_path)


def test_an_index_that_cannot_be_read_is_answered_by_the_ledger(spec_path, monkeypatch, caplog):
    from spark_jobs.core.lineage import ConsumedIndex

    landing = _drain(spec_path, 0, files=4, records=10)

    def unreadable(*args, **kwargs):
        raise OSError("index file vanished")

    monkeypatch.setattr(ConsumedIndex, "lookup", unreadable)
    assert _run(spec_path) == "no_new_data", "the ledger says every file was consumed"
    assert "consumed index not read (index file vanished)" in caplog.text
    write_wave(landing, 1, files=1, records_per_file=10)
    assert _run(spec_path) == "committed"
    monkeypatch.undo()
    assert_exact(spec_path)
