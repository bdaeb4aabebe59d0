"""The key directory (`spark_jobs.core.key_directory`): a merged state's
batches merged on read find their returning keys in it, on real Delta
tables in `tmp_path`, and hold what the same batches hold without it (rows
and change feed), through rewinds, purges, compactions, merged levels and a
broken directory; and the hash it sorts by gives equal keys equal hashes."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from spark_jobs.core import key_directory, merge_on_read
from spark_jobs.core.delta_io import open_table
from spark_jobs.core.fencing import Position
from spark_jobs.core.key_directory import KeyDirectory, key_hashes
from tests.conftest import batch_metadata, commit_updates
from tests.spark_jobs.core.test_merge_on_read import _batches, _changes, _merged_on_read, _rows, _state


def _levels(folder: Path) -> list[dict]:
    manifests = list(folder.glob("*/manifest.json"))
    assert len(manifests) == 1, manifests
    return json.loads(manifests[0].read_text())["levels"]


@pytest.fixture
def keys_folder(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "keys"
    monkeypatch.setenv(key_directory.ENV, str(folder))
    return folder


class _Twins:
    """One state with the key directory, one without, given the same batches and rewinds."""

    def __init__(self, tmp_path: Path, folder: Path, monkeypatch) -> None:
        self.on, self.off = _state(tmp_path / "on", True), _state(tmp_path / "off", True)
        self.folder, self.monkeypatch, self.versions = folder, monkeypatch, {}

    def _as(self, state):
        self.monkeypatch.setenv(key_directory.ENV, str(self.folder) if state is self.on else "off")
        return state

    def batch(self, batch: pa.Table, position: Position) -> None:
        for state in (self.on, self.off):
            self._as(state)
            version, _ = commit_updates(state, state.open() or state.create(batch), batch, position)
            self.versions[state.path, position] = version
        assert _merged_on_read(self.on) == _merged_on_read(self.off)
        self.same()

    def restore(self, to: Position, position: Position) -> None:
        for state in (self.on, self.off):
            state.restore(state.open(), self.versions[state.path, to], batch_metadata("clicks", position))
        self.same()

    def same(self) -> None:
        assert _rows(self.on) == _rows(self.off)
        assert len({r["k"] for r in _rows(self.on)}) == len(_rows(self.on))
        on, off = open_table(self.on.path), open_table(self.off.path)
        assert _changes(self.on, on.version()) == _changes(self.off, off.version())


def test_with_the_directory_a_steady_batch_reads_no_state_file_and_holds_what_a_read_holds(tmp_path, keys_folder, monkeypatch):
    """Eight batches of returning and new keys: the same rows and change
    feed as the state's files read each batch. After the first batch merged
    on read builds the directory, no batch reads a row of the state's files
    (both ways of reading them fail), and each adds one level, its new file."""
    twins = _Twins(tmp_path, keys_folder, monkeypatch)
    batches = _batches(8, seed=21)
    for n, batch in enumerate(batches[:2], start=1):
        twins.batch(batch, Position(0, n))
    assert _merged_on_read(twins.on)
    built = _levels(keys_folder)
    assert built and sum(level["entries"] for level in built) >= 2000

    scan, rows_of = merge_on_read._scan, merge_on_read._file_rows

    def only_the_twin(real):
        def guarded(root, *args, **kwargs):
            assert not str(root).startswith(twins.on.path), "the state's files were read"
            return real(root, *args, **kwargs)
        return guarded

    monkeypatch.setattr(merge_on_read, "_scan", only_the_twin(scan))
    monkeypatch.setattr(merge_on_read, "_file_rows", only_the_twin(rows_of))
    for n, batch in enumerate(batches[2:], start=3):
        twins.batch(batch, Position(0, n))
        assert _merged_on_read(twins.on)
        assert len(_levels(keys_folder)) == len(built) + n - 2


def test_rewinds_purges_and_compactions_are_followed_and_files_back_are_found_whole(tmp_path, keys_folder, monkeypatch):
    """Levels merged at every batch (`MAX_LEVELS` 1) and built a few files
    at a time: a rewind to before files were purged brings them back with
    their old vectors, and the directory, which dropped them, reads them
    again; a delta-rs compaction and the job's purge replace files the
    directory then no longer answers for. Every step against the twin
    without a directory."""
    from spark_jobs.core.merge_on_read import purge

    monkeypatch.setattr(key_directory, "MAX_LEVELS", 1)
    monkeypatch.setattr(key_directory, "LEVEL_ROWS", 8000)  # every batch's level is small: merged each batch
    twins = _Twins(tmp_path, keys_folder, monkeypatch)
    batches = _batches(12, seed=22, then=150)
    for n in range(1, 5):
        twins.batch(batches[n - 1], Position(0, n))
    for state in (twins.on, twins.off):
        purge(open_table(state.path))
    twins.batch(batches[4], Position(0, 5))
    twins.restore(Position(0, 3), Position(1, 3))  # the files the purge replaced, back
    for n in range(4, 7):
        twins.batch(batches[n + 1], Position(1, n))
    assert _merged_on_read(twins.on)
    for state in (twins.on, twins.off):
        open_table(state.path).optimize.compact()
    twins.same()
    for n in range(7, 10):
        twins.batch(batches[n + 1], Position(1, n))
    levels = _levels(keys_folder)
    active = {Path(p).name for p in open_table(twins.on.path).file_uris()}
    assert {f["path"] for level in levels for f in level["files"]} <= active


def test_with_every_key_hashing_alike_the_keys_themselves_decide(tmp_path, keys_folder, monkeypatch, caplog):
    """A hash only chooses which rows to compare: with one hash for every
    key (each lookup hits every row of every level, deleted and live, all
    in one bucket), the batches hold what the twin's hold, the directory in use."""
    monkeypatch.setattr(key_directory, "key_hashes", lambda table, keys: np.zeros(table.num_rows, np.uint64))
    twins = _Twins(tmp_path, keys_folder, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        for n, batch in enumerate(_batches(5, seed=24), start=1):
            twins.batch(batch, Position(0, n))
    assert "key directory" not in caplog.text
    assert _merged_on_read(twins.on) and len(_levels(keys_folder)) == 5


@pytest.mark.parametrize(
    "damage",
    [
        "truncated rows", "no positions", "garbage manifest", "other hash", "a level twice", "a level of nothing",
        "buckets zeroed", "buckets moved", "hashes' low bits set", "positions shuffled",
    ],
)
def test_a_broken_directory_is_read_around_and_built_again(tmp_path, keys_folder, monkeypatch, caplog, damage):
    """A directory damaged between batches (a level cut short, a file gone,
    a manifest that is not JSON, one of another hash function): the next
    batch holds what the twin holds, and the directory is whole again after it."""
    twins = _Twins(tmp_path, keys_folder, monkeypatch)
    batches = _batches(5, seed=23)
    for n in range(1, 4):
        twins.batch(batches[n - 1], Position(0, n))
    (manifest,) = keys_folder.glob("*/manifest.json")
    level = json.loads(manifest.read_text())["levels"][0]["id"]
    if damage == "truncated rows":
        rows = manifest.parent / f"{level}.rows.arrow"
        rows.write_bytes(rows.read_bytes()[: rows.stat().st_size // 2])
    elif damage == "no positions":
        (manifest.parent / f"{level}.pos.npy").unlink()
    elif damage == "garbage manifest":
        manifest.write_text("{not json")
    elif damage == "other hash":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "check": "0" * 16}))
    elif damage in ("a level twice", "a level of nothing"):
        written = json.loads(manifest.read_text())
        written["levels"].append(written["levels"][0] if damage == "a level twice" else {})
        manifest.write_text(json.dumps(written))
    else:  # the same size, other contents: what a lookup reads is checked
        suffix = {"positions shuffled": "pos", "hashes' low bits set": "hash"}.get(damage, "start")
        part = manifest.parent / f"{level}.{suffix}.npy"
        values = np.load(part)
        if damage == "buckets zeroed":
            values = np.zeros_like(values)
        elif damage == "buckets moved":  # every odd bucket emptied into the next: its keys out of any range read
            values[1:-1:2] = values[2::2]
        elif damage == "hashes' low bits set":
            values = values | np.uint64(1)
        else:
            values = np.random.default_rng(0).permutation(values)
        np.save(part, values)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        twins.batch(batches[3], Position(0, 4))
    if damage in ("truncated rows", "no positions", "buckets zeroed", "buckets moved", "hashes' low bits set", "positions shuffled"):
        assert "key directory" in caplog.text and "not used" in caplog.text
    twins.batch(batches[4], Position(0, 5))
    levels = _levels(keys_folder)
    active = {Path(p).name for p in open_table(twins.on.path).file_uris()}
    assert active <= {f["path"] for level in levels for f in level["files"]}


def test_a_cache_folder_that_cannot_be_made_leaves_the_batch_reading_the_state(tmp_path, monkeypatch, caplog):
    """`MICROBATCH_KEY_DIRECTORY` naming a file (or a folder the job cannot
    write): the batches hold what the twin's hold, with a warning."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    twins = _Twins(tmp_path, blocked, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        for n, batch in enumerate(_batches(3, seed=26), start=1):
            twins.batch(batch, Position(0, n))
    assert _merged_on_read(twins.on) and "key directory" in caplog.text


def test_the_weekly_sweep_removes_only_directories_this_module_made(tmp_path, monkeypatch):
    """A folder unused for a week is removed when it holds only a key
    directory's files; one with anything else in it stays (the setting may
    name a folder other programs use)."""
    week_ago = time.time() - 8 * 86400
    ours, theirs = tmp_path / ("a" * 24), tmp_path / ("b" * 24)
    for folder in (ours, theirs):
        folder.mkdir()
        (folder / "lock").write_text("")
        (folder / "manifest.json").write_text("{}")
    (theirs / "precious.db").write_text("keep me")
    for folder in (ours, theirs):
        os.utime(folder / "lock", (week_ago, week_ago))
    monkeypatch.setattr(key_directory, "_SWEPT", set())
    key_directory._sweep(tmp_path)
    assert not ours.exists() and (theirs / "precious.db").read_text() == "keep me"


def test_a_run_behind_the_table_keeps_the_levels_of_files_it_does_not_know(tmp_path):
    """A run that waited for the lock with an older snapshot (a racing
    run's winner recorded its file since) looks up without dropping the
    winner's level; the winner's next batch finds it."""
    schema = pa.schema([("k", pa.int64()), ("s", pa.int64())])
    rows = pa.table({"k": pa.array([1, 2], pa.int64()), "s": pa.array([1, 1], pa.int64())})
    directory = KeyDirectory(tmp_path / "t", ["k"], schema)
    with directory.locked():
        directory.record("old.parquet", 10, rows, {"old.parquet": 10})
        directory.record("won.parquet", 11, rows, {"old.parquet": 10, "won.parquet": 11})
    with directory.locked():
        found = directory.find({"old.parquet": 10}, {"old.parquet": 2}, ["old.parquet"], {}, lambda p: [], rows)
    assert [f.path for f in found] == ["old.parquet"]
    assert {f["path"] for level in _levels(tmp_path) for f in level["files"]} == {"old.parquet", "won.parquet"}


class _Killed(BaseException):
    """Stands for a kill: no `except Exception` catches it."""


def test_a_run_killed_between_its_commit_and_the_directory_leaves_the_next_batch_right(tmp_path, keys_folder, monkeypatch):
    """The commit landed, the process died before its file joined the
    directory: the next batch finds that file uncovered, reads it into a
    level, and holds what the twin holds."""
    twins = _Twins(tmp_path, keys_folder, monkeypatch)
    batches = _batches(5, seed=25)
    for n in range(1, 4):
        twins.batch(batches[n - 1], Position(0, n))

    def killed(*args, **kwargs):
        raise _Killed

    with monkeypatch.context() as patched:
        patched.setattr(KeyDirectory, "record", killed)
        twins._as(twins.on)
        with pytest.raises(_Killed):
            commit_updates(twins.on, twins.on.open(), batches[3], Position(0, 4))
    twins._as(twins.off)
    commit_updates(twins.off, twins.off.open(), batches[3], Position(0, 4))
    twins.same()
    twins.batch(batches[4], Position(0, 5))
    active = {Path(p).name for p in open_table(twins.on.path).file_uris()}
    assert active <= {f["path"] for level in _levels(keys_folder) for f in level["files"]}


def test_racing_runs_take_the_directory_one_at_a_time(tmp_path):
    """The lock file: a second holder waits until the first lets go."""
    schema = pa.schema([("k", pa.int64())])
    first, second = KeyDirectory(tmp_path / "t", ["k"], schema), KeyDirectory(tmp_path / "t", ["k"], schema)
    order: list[str] = []

    def late() -> None:
        with second.locked():
            order.append("second")

    with first.locked():
        thread = threading.Thread(target=late)
        thread.start()
        time.sleep(0.3)
        order.append("first")
    thread.join(10)
    assert order == ["first", "second"]


def test_a_directory_of_other_key_types_is_started_again(tmp_path):
    """Keys hashed as INT are not looked up as BIGINT: the manifest names
    the key types, and another type empties the folder."""
    narrow = KeyDirectory(tmp_path / "t", ["k"], pa.schema([("k", pa.int32())]))
    with narrow.locked():
        narrow.record("a.parquet", 10, pa.table({"k": pa.array([1, 2], pa.int32())}), {"a.parquet": 10})
    assert len(list((tmp_path / "t").glob("*.rows.arrow"))) == 1
    wide = KeyDirectory(tmp_path / "t", ["k"], pa.schema([("k", pa.int64())]))
    with wide.locked():
        pass
    assert not list((tmp_path / "t").glob("*.rows.arrow"))


def test_equal_keys_hash_alike_whatever_array_holds_them():
    """As the match compares keys: -0.0 is 0.0, NaNs alike; a sliced or
    chunked array hashes as a fresh one; a null is not an empty string or 0."""
    def h(**columns) -> list[int]:
        return key_hashes(pa.table(columns), list(columns)).tolist()

    words = pa.array(["", "a", None, "ab", "b" * 5000, "zz"])
    assert h(k=words.slice(2)) == h(k=pa.array([None, "ab", "b" * 5000, "zz"]))
    assert h(k=pa.chunked_array([words.slice(0, 2), words.slice(2)])) == h(k=words)
    assert h(k=pa.array(["ab"], pa.large_string())) == h(k=pa.array(["ab"]))
    assert len(set(h(k=words))) == 6
    # Values all as long are hashed as a matrix, others one by one: the same hashes.
    ids = ["u000000001", "u123456789", "u999999999"]
    assert h(k=pa.array(ids)) == h(k=pa.array([*ids, "u1"]))[:3] == h(k=pa.array([*ids, None]))[:3]
    nan = np.frombuffer(np.array([0x7FF8000000000001], np.uint64).tobytes(), np.float64)[0]
    assert h(k=pa.array([-0.0, float("nan")])) == h(k=pa.array([0.0, nan]))
    assert len(set(h(k=pa.array([0, None], pa.int64())))) == 2
    assert h(k=pa.array([1, 2], pa.int64()), s=pa.array(["a", "b"])) != h(k=pa.array([1, 2], pa.int64()), s=pa.array(["b", "a"]))
    assert h(k=pa.array([Decimal("1.50")], pa.decimal128(5, 2))) == h(k=pa.array([Decimal("1.5")], pa.decimal128(5, 2)))
    moments = pa.array([1, 2], pa.timestamp("us", "UTC"))
    assert h(k=moments) == h(k=moments.slice(0)) and len(set(h(k=moments))) == 2
