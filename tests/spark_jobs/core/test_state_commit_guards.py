"""Every commit to the state is fenced or checked (issue 62).

A commit made from a snapshot must not land once a file it removes or
relies on was removed since, whoever removed it: `maintain`'s compaction
or its removal of files no commit names, a fold, another tool's OPTIMIZE.
docs/reliability.md ("Every commit to the state is fenced or checked")
names the check that guards each writer; these tests break each one the
way a user's tools would, with real Spark and real tables, and check the
state against what the batches hold, each key once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from deltalake import DeltaTable

from spark_jobs.core.delta_io import open_table, read_all, version_actions
from spark_jobs.core.faults import MARKER
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.core.state import StateTable
from tests.conftest import ROOT, run_cli, write_spec

#: Three batches of (key, n): keys coming back and new ones.
BATCHES = ({"a": 1, "b": 1}, {"a": 10, "c": 10}, {"a": 100, "d": 100})
EXPECTED = {"a": 111, "b": 1, "c": 10, "d": 100}


def _spec(folder: Path, state_write: str = "executors", **extra) -> Path:
    return write_spec(folder, {
        "name": "sums",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, n BIGINT"},
        "transform": "SELECT k, sum(n) AS n FROM batch GROUP BY k",
        "state": {"path": "lake/state", "keys": ["k"], "merge": {"n": "sum"}},
        "checkpoint": "lake/_checkpoints/sums",
        "batch": {"max_files": 1},
        "engine": {"state_write": state_write},
        **extra,
    })


def _land(folder: Path, batch: int) -> None:
    rows = BATCHES[batch - 1]
    (folder / "landing").mkdir(parents=True, exist_ok=True)
    (folder / "landing" / f"{batch}.json").write_text("".join(json.dumps({"k": k, "n": n}) + "\n" for k, n in rows.items()))


def _sums(spec_path: Path) -> dict[str, int]:
    rows = read_all(open_table(load_spec(spec_path).state_path)).to_pylist()
    keys = [r["k"] for r in rows]
    assert len(keys) == len(set(keys)), f"a key is in the state more than once: {sorted(keys)}"
    return {r["k"]: r["n"] for r in rows}


def _operations(spec_path: Path) -> list[str]:
    path, version, found = load_spec(spec_path).state_path, 1, []
    while (actions := version_actions(path, version)) is not None:
        found.append(next(a["commitInfo"].get("operation") for a in actions if "commitInfo" in a))
        version += 1
    return found


def _untracked(path: str) -> list[Path]:
    """The Parquet files in the state's folder that no version of its log names."""
    named, version = set(), 0
    while (actions := version_actions(path, version)) is not None:
        named |= {a[k]["path"] for a in actions for k in ("add", "remove") if k in a}
        version += 1
    return [p for p in Path(path).glob("*.parquet") if p.name not in named]


# -- writers against an outside compaction, in the job's process -----------------------


@pytest.mark.parametrize("way", ["driver", "file by file", "join", "auto, big state"])
def test_a_compaction_landing_before_a_batch_s_commit_sends_it_to_a_fresh_snapshot(tmp_path, compute, monkeypatch, way):
    """An OPTIMIZE (ZORDER BY, rewriting every file) by another tool lands
    between the snapshot step 4 read and its commit. delta-rs's MERGE fails on it by itself; a commit of the
    executors' rewritten files lands only on the version it read (before,
    it landed, and the rewrites stood beside the compacted copy: every
    touched key twice). Either way step 4 starts again from a fresh
    snapshot, and the state holds each key once, with every batch in it."""
    import spark_jobs.core.state as state_module

    if way == "join":
        monkeypatch.setattr(state_module, "IN_PROCESS_ROWS", 0)
    if way == "auto, big state":
        monkeypatch.setattr(state_module, "REWRITE_FROM_BYTES", 0)
    spec_path = _spec(tmp_path, {"driver": "driver", "auto, big state": "auto"}.get(way, "executors"))
    for batch in (1, 2):
        _land(tmp_path, batch)
        assert run_batch(load_spec(spec_path), RunOptions(run_id=f"b{batch}"), compute_factory=compute).status == "committed"
    real, calls = StateTable.commit_batch, []

    def compacted_first(self, table, *args, **kwargs):
        calls.append(table.version())
        if len(calls) == 1:
            # Another tool, on its own handle: OPTIMIZE ZORDER BY (k), which rewrites every file.
            DeltaTable(self.path).optimize.z_order(["k"])
        return real(self, table, *args, **kwargs)

    monkeypatch.setattr(StateTable, "commit_batch", compacted_first)
    _land(tmp_path, 3)
    assert run_batch(load_spec(spec_path), RunOptions(run_id="b3"), compute_factory=compute).status == "committed"
    assert len(calls) == 2 and calls[1] > calls[0], f"step 4 did not start again from a fresh snapshot: {calls}"
    assert "OPTIMIZE" in _operations(spec_path)
    assert _sums(spec_path) == EXPECTED


def test_a_fold_loses_to_a_compaction_that_landed_first_and_keeps_every_value(tmp_path, compute, monkeypatch):
    """An appended state's fold by the executors removes the files it read:
    an OPTIMIZE that compacted them first makes the fold lose (it is due
    again), instead of its rows standing beside the compacted ones."""
    from spark_jobs.core import folding
    from spark_jobs.core.folding import read_state, row_counts
    from spark_jobs.core.maintain import maintain

    spec_path = _spec(tmp_path, state={"path": "lake/state", "keys": ["k"], "merge": {"n": "sum"}, "layout": "appended"})
    for batch in (1, 2, 3):
        _land(tmp_path, batch)
        assert run_batch(load_spec(spec_path), RunOptions(run_id=f"b{batch}"), compute_factory=compute).status == "committed"
    spec = load_spec(spec_path)
    real = folding.commit_files

    def compacted_first(table, *args, **kwargs):
        DeltaTable(spec.state_path).optimize.compact()
        return real(table, *args, **kwargs)

    monkeypatch.setattr(folding, "commit_files", compacted_first)
    maintain(spec, compute_factory=compute)
    assert row_counts(open_table(spec.state_path)).appended > 0, "the fold should have lost its race"
    assert {r["k"]: r["n"] for b in read_state(spec) for r in b.to_pylist()} == EXPECTED
    monkeypatch.setattr(folding, "commit_files", real)
    maintain(spec, compute_factory=compute)
    assert row_counts(open_table(spec.state_path)).appended == 0
    assert {r["k"]: r["n"] for b in read_state(spec) for r in b.to_pylist()} == EXPECTED


def test_a_rewind_after_an_outside_compaction_restores_exactly(tmp_path, compute, monkeypatch):
    """A rewind restores a version from the snapshot it checked: a
    compaction landing in between fails the RESTORE (delta-rs's own
    check), the rewind is retryable, and the next one restores exactly."""
    from spark_jobs.core import rewind as rewind_module
    from spark_jobs.core.rewind import rewind
    from spark_jobs.errors import is_retryable

    spec_path = _spec(tmp_path, "driver")
    for batch in (1, 2, 3):
        _land(tmp_path, batch)
        assert run_batch(load_spec(spec_path), RunOptions(run_id=f"b{batch}"), compute_factory=compute).status == "committed"
    spec = load_spec(spec_path)
    real = StateTable.restore

    def compacted_first(self, table, *args, **kwargs):
        DeltaTable(self.path).optimize.z_order(["k"])
        return real(self, table, *args, **kwargs)

    monkeypatch.setattr(StateTable, "restore", compacted_first)
    with pytest.raises(Exception) as lost:
        rewind(spec, 2, run_id="r1")
    assert is_retryable(lost.value), lost.value
    monkeypatch.setattr(StateTable, "restore", real)
    assert rewind_module.rewind(spec, 2, run_id="r2").status == "rewound"
    assert _sums(spec_path) == {"a": 11, "b": 1, "c": 10}


# -- `maintain` racing a batch held before its commit, through the CLI -------------------


def _held(spec_path: Path, hold: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A `microbatch run` that waits at `mid_state_merge` (its files written, its commit not made) while `hold` exists."""
    hold.touch()
    handle = open(log, "w")  # noqa: SIM115 - the child's stderr, closed by the OS with it
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_jobs", "run", str(spec_path), "--json"],
        stdout=subprocess.PIPE, stderr=handle, text=True, cwd=ROOT,
        env={**os.environ, **(env or {}), "MICROBATCH_HOLD_POINT": "mid_state_merge", "MICROBATCH_HOLD_FILE": str(hold)},
    )
    deadline = time.monotonic() + 300
    while f"{MARKER} hold mid_state_merge" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("state_write", ["executors", "driver"])
def test_maintain_while_a_batch_waits_before_its_commit_keeps_every_key_once(tmp_path, on_connect, state_write):
    """Issue 62, item 3: batches `a,b` then `a,c`; batch 3 (`a: 100, d: 100`)
    waits just before its commit while `microbatch maintain` compacts the
    state. Released, it committed its rewrites of the compacted files beside
    the compacted one (`a` as 11 and 111, `b` and `c` twice). Now its commit
    fails on the compaction and step 4 goes again from a fresh snapshot."""
    spec_path = _spec(tmp_path, state_write)
    for batch in (1, 2):
        _land(tmp_path, batch)
        assert run_cli("run", str(spec_path)).returncode == 0
    _land(tmp_path, 3)
    held = _held(spec_path, tmp_path / "hold", tmp_path / "held.log") if state_write == "executors" else None
    maintained = run_cli("maintain", str(spec_path), "--keep-batches", "1")
    assert maintained.returncode == 0, maintained.stderr[-3000:]
    if held is None:  # the MERGE in the job's process has no hold point: it starts after the compaction
        assert run_cli("run", str(spec_path)).returncode == 0
    else:
        (tmp_path / "hold").unlink()
        out, _ = held.communicate(timeout=300)
        assert held.returncode == 0, (tmp_path / "held.log").read_text()[-3000:]
        assert json.loads(out)["status"] == "committed"
        assert "OPTIMIZE" in _operations(spec_path)
    assert _sums(spec_path) == EXPECTED
    assert json.loads(run_cli("run", str(spec_path), "--json").stdout)["status"] == "no_new_data"


@pytest.mark.parametrize("maintained", [True, False], ids=["maintain-removed-them", "held-past-the-window"])
def test_a_batch_whose_files_outlived_the_window_is_written_again_never_committed_without_them(tmp_path, on_connect, maintained):
    """Issue 62, item 4: batch 2 waits before its commit for longer than
    `maintenance.untracked_files_hours` (its files are made a day old
    here). `maintain` removes them as files no commit names; released, the
    batch committed add actions for files that were gone (its rows lost, the
    ledger saying committed, `query` failing). Now `maintain` commits a
    fenced marker before it deletes, the batch's commit fails on it, and a
    batch never commits files older than half the window: it stops
    retryably, and the next run writes them again."""
    spec_path = _spec(tmp_path, maintenance={"untracked_files_hours": 1.0})
    _land(tmp_path, 1)
    assert run_cli("run", str(spec_path)).returncode == 0
    _land(tmp_path, 2)
    held = _held(spec_path, tmp_path / "hold", tmp_path / "held.log")
    state_path = load_spec(spec_path).state_path
    waiting = _untracked(state_path)
    assert waiting, "the held batch wrote no files"
    day_ago = time.time() - 24 * 3600
    for path in waiting:
        os.utime(path, (day_ago, day_ago))
    if maintained:
        done = run_cli("maintain", str(spec_path), "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout)["removed_files"]["state untracked"] >= len(waiting)
        assert not any(p.exists() for p in waiting)
    (tmp_path / "hold").unlink()
    held.communicate(timeout=300)
    err = (tmp_path / "held.log").read_text()
    assert held.returncode == 1 and "run again" in err, err[-3000:]
    assert "Traceback" not in err
    again = run_cli("run", str(spec_path), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["status"] == "committed"
    assert _sums(spec_path) == {"a": 11, "b": 1, "c": 10}
    query = run_cli("query", str(spec_path), "--json")
    assert query.returncode == 0, query.stderr[-2000:]
    assert sorted(r["k"] for r in json.loads(query.stdout)) == ["a", "b", "c"]


# -- failures a retry cannot fix ---------------------------------------------------------


def test_a_bug_on_the_executors_path_is_terminal_and_the_driver_path_gets_past_it(tmp_path, compute, monkeypatch):
    """A mistake in the project's own code in the executors' tasks fails
    the replay the same way every time: exit 2, naming where and the way
    around it (`engine.state_write: driver`), which then commits the batch."""
    from spark_jobs.core import arrow_rows
    from spark_jobs.errors import InternalError, exit_code

    spec_path = _spec(tmp_path)
    for batch in (1, 2):
        _land(tmp_path, batch)
        if batch == 2:
            def broken(*args, **kwargs):
                raise TypeError("a mistake in a merge rule")

            monkeypatch.setattr(arrow_rows, "apply_rule", broken)
            with pytest.raises(InternalError, match=r"TypeError: a mistake in a merge rule at \S+:\d+ in broken, in a task on the executors") as failed:
                run_batch(load_spec(spec_path), RunOptions(run_id="b2"), compute_factory=compute)
            assert exit_code(failed.value) == 2 and "engine.state_write: driver" in str(failed.value)
            spec_path = _spec(tmp_path, "driver")
        assert run_batch(load_spec(spec_path), RunOptions(run_id=f"b{batch}"), compute_factory=compute).status == "committed"
    assert _sums(spec_path) == {"a": 11, "b": 1, "c": 10}


def test_a_transform_that_fails_on_the_batch_s_records_is_terminal(tmp_path, on_connect):
    """Spark's data exceptions (a value that does not cast under ANSI SQL)
    meet the same records on every replay: exit 2, saying what to change,
    not exit 1 retried until the retries run out."""
    spec_path = write_spec(tmp_path, {
        "name": "casts",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, n STRING"},
        "transform": "SELECT k, sum(CAST(n AS INT)) AS n FROM batch GROUP BY k",
        "state": {"path": "lake/state", "keys": ["k"], "merge": {"n": "sum"}},
        "checkpoint": "lake/_checkpoints/casts",
    })
    (tmp_path / "landing" / "a.json").write_text('{"k": "a", "n": "1"}\n{"k": "b", "n": "one"}\n')
    failed = run_cli("run", str(spec_path))
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "CAST_INVALID_INPUT" in failed.stderr and "try_cast" in failed.stderr
    assert open_table(load_spec(spec_path).state_path) is None or _sums(spec_path) == {}
    spec = yaml.safe_load(spec_path.read_text())
    spec["transform"] = "SELECT k, sum(try_cast(n AS INT)) AS n FROM batch GROUP BY k"
    write_spec(tmp_path, spec)
    assert run_cli("run", str(spec_path)).returncode == 0
    assert _sums(spec_path) == {"a": 1, "b": None}
