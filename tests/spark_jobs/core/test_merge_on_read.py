"""A merged state merged on read (`state.deletion_vectors`: the job's own
deletion vectors and commits, `spark_jobs.core.merge_on_read`), on real
Delta tables in `tmp_path`: against copy-on-write on the same batches (rows
and change feed), against a racing commit, and with delta-rs writing after
it (rewind, OPTIMIZE, VACUUM, checkpoints); delta-spark reads what it wrote."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from spark_jobs.core.delta_io import arrow, commit_info, is_commit_conflict, open_table, read_all
from spark_jobs.core.fencing import STATE_FENCE, Position
from spark_jobs.core.spec import load_spec
from tests.conftest import batch_metadata, commit_updates, oracle_spec_dict, write_spec

MERGE = {"s": "sum", "lo": "min", "hi": "max", "f": "first", "l": "last"}


def _state(folder: Path, vectors: bool, change_feed: bool = True):
    from spark_jobs.core.state import StateTable

    spec = oracle_spec_dict()
    spec["state"] = {"path": "lake/state", "keys": ["k"], "merge": MERGE, "deletion_vectors": vectors, "change_feed": change_feed}
    folder.mkdir(parents=True, exist_ok=True)
    return StateTable(load_spec(write_spec(folder, spec)))


def _batches(count: int, seed: int = 1, first: int = 2000, then: int = 120) -> list[pa.Table]:
    """A first batch of `first` keys, then batches of `then` keys coming back
    and new (small beside the state: batches that merge on read), nulls on
    either side of each rule."""
    rng = random.Random(seed)
    out = []
    for b in range(count):
        keys = rng.sample(range(2400), first if b == 0 else then)
        maybe = lambda v: None if rng.random() < 0.1 else v  # noqa: E731
        out.append(pa.table({
            "k": [f"k{k:03d}" for k in keys],
            "s": [maybe(rng.randint(-5, 9)) for _ in keys],
            "lo": [maybe(rng.random()) for _ in keys],
            "hi": [maybe(rng.randint(0, 99)) for _ in keys],
            "f": [maybe(f"f{b}") for _ in keys],
            "l": [maybe(f"l{b}") for _ in keys],
        }))
    return out


def _rows(state) -> list[dict]:
    return sorted(read_all(open_table(state.path)).to_pylist(), key=lambda r: r["k"])


def _changes(state, version: int) -> list[tuple]:
    changes = arrow(open_table(state.path).load_cdf(starting_version=version, ending_version=version).read_all())
    keep = [c for c in changes.column_names if not c.startswith("_commit")]
    return sorted((tuple(sorted(r.items())) for r in changes.select(keep).to_pylist()), key=repr)


def _data_files(state) -> set[str]:
    return {p.name for p in Path(state.path).glob("*.parquet")}


def _replays(state, version: int) -> bool:
    """Whether the state's rows before `version`, with that version's change
    feed applied (as a downstream reads it), are its rows after it."""
    from collections import Counter

    before = Counter(repr(sorted(r.items())) for r in read_all(DeltaTable(state.path, version=version - 1)).to_pylist())
    feed = arrow(open_table(state.path).load_cdf(starting_version=version, ending_version=version).read_all())
    columns = [c for c in feed.column_names if not c.startswith("_change_type") and not c.startswith("_commit")]
    for row, kind in zip(feed.select(columns).to_pylist(), feed.column("_change_type").to_pylist()):
        before[repr(sorted(row.items()))] += -1 if kind in ("delete", "update_preimage") else 1
    after = Counter(repr(sorted(r.items())) for r in read_all(DeltaTable(state.path, version=version)).to_pylist())
    return +before == after and not any(n < 0 for n in before.values())


def _merged_on_read(state) -> bool:
    """Whether the state's latest commit is a batch merged on read."""
    return '"merge-on-read"' in (Path(state.path) / "_delta_log" / f"{open_table(state.path).version():020d}.json").read_text()


def test_merged_on_read_holds_what_copy_on_write_holds_and_writes_the_same_changes(tmp_path):
    """Six batches into two states, one copy-on-write (delta-rs's MERGE),
    one merged on read: after each, the same rows, one per key, and the
    same change feed (pre-images, post-images, inserts). A batch adds one
    data file and removes none: the files it touches keep their bytes."""
    cow, mor = _state(tmp_path / "cow", False), _state(tmp_path / "mor", True)
    for n, batch in enumerate(_batches(6), start=1):
        files_before = _data_files(mor)
        for state in (cow, mor):
            table = state.open() or state.create(batch)
            commit_updates(state, table, batch, Position(0, n))
        assert _rows(mor) == _rows(cow), f"batch {n}"
        assert len({r["k"] for r in _rows(mor)}) == len(_rows(mor))
        assert _changes(mor, open_table(mor.path).version()) == _changes(cow, open_table(cow.path).version()), f"batch {n}"
        if n > 1:
            assert _merged_on_read(mor) and not _merged_on_read(cow)
            assert files_before < _data_files(mor) and len(_data_files(mor) - files_before) == 1
    table = open_table(mor.path)
    assert "deletionVectors" in table.protocol().reader_features
    assert Position.decode(table.transaction_version(STATE_FENCE)) == Position(0, 6)
    commit = mor.find_commit(table, Position(0, 6))
    assert commit is not None and commit.version == table.version() and commit.keys_updated == 120


def test_a_commit_since_its_snapshot_fails_the_batch_and_leaves_the_state_as_the_winner_left_it(tmp_path):
    """Two runs read the same snapshot; the first commits. The second's
    commit fails as delta-rs's conflicts do (step 4 judges it), and the
    state holds the winner's batch only."""
    state = _state(tmp_path, True)
    first, second, third = _batches(3, seed=2)
    commit_updates(state, state.create(first), first, Position(0, 1))
    commit_updates(state, state.open(), second, Position(0, 2))  # turns the feature on: a batch of vectors next
    stale = state.open()
    commit_updates(state, state.open(), third, Position(0, 3))
    assert _merged_on_read(state)
    winner = _rows(state)
    with pytest.raises(Exception) as failed:
        state.commit_batch(stale, state.align(stale, third), batch_metadata("clicks", Position(0, 3)))
    assert is_commit_conflict(failed.value)
    assert _rows(state) == winner


def test_delta_rs_rewinds_compacts_vacuums_and_checkpoints_it(tmp_path):
    """After batches merged on read: a rewind (delta-rs's RESTORE) to batch
    2 gives batch 2's rows; batches go on from there, over a checkpoint
    (whose add actions carry the vectors); OPTIMIZE and VACUUM keep every
    row; and the copy-on-write twin agrees all along."""
    cow, mor = _state(tmp_path / "cow", False), _state(tmp_path / "mor", True)
    batches = _batches(7, seed=3)
    versions = {}
    for n, batch in enumerate(batches[:4], start=1):
        for state in (cow, mor):
            version, _ = commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
            versions[state.path, n] = version
    for state in (cow, mor):
        state.restore(state.open(), versions[state.path, 2], batch_metadata("clicks", Position(1, 2)))
    assert _rows(mor) == _rows(cow) and _replays(mor, open_table(mor.path).version())
    open_table(mor.path).create_checkpoint()
    for n, batch in enumerate(batches[4:], start=3):
        for state in (cow, mor):
            commit_updates(state, state.open(), batch, Position(1, n))
        assert _rows(mor) == _rows(cow), f"batch {n} after the rewind"
        assert _merged_on_read(mor)
    expected = _rows(cow)
    table = open_table(mor.path)
    table.optimize.compact()
    table.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    assert _rows(mor) == expected
    commit_updates(mor, mor.open(), batches[0], Position(1, 6))
    commit_updates(cow, cow.open(), batches[0], Position(1, 6))
    assert _rows(mor) == _rows(cow)


def test_delta_spark_reads_the_rows_and_the_change_feed_it_wrote(tmp_path, spark):
    """Spark (delta-spark) reads the state merged on read as delta-rs does,
    and its change feed as the job wrote it."""
    state = _state(tmp_path, True)
    for n, batch in enumerate(_batches(4, seed=4), start=1):
        commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
    version = DeltaTable(state.path).version()
    rows = spark.read.format("delta").load(state.path).toArrow()
    assert sorted(rows.select(["k", "s", "lo", "hi", "f", "l"]).to_pylist(), key=lambda r: r["k"]) == [
        {k: r[k] for k in ("k", "s", "lo", "hi", "f", "l")} for r in _rows(state)
    ]
    feed = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", version).load(state.path)
    counted = {r["_change_type"]: r["count"] for r in feed.groupBy("_change_type").count().collect()}
    mine = {}
    for change in _changes(state, version):
        kind = dict(change)["_change_type"]
        mine[kind] = mine.get(kind, 0) + 1
    assert counted == mine and counted.get("update_postimage")


def _deleted_by_delta_rs(table) -> dict[str, np.ndarray]:
    """The oracle of `deletion_vectors.deleted_in`: delta-rs's reading of
    every file's vector (a mask of its rows), as row indexes by path."""
    from urllib.parse import unquote, urlparse

    root = unquote(urlparse(table.table_uri).path).rstrip("/") + "/"
    vectors = arrow(table.deletion_vectors())
    found = {}
    for uri, keep in zip(vectors.column(0).to_pylist(), vectors.column(1).to_pylist()):
        path = unquote(urlparse(uri).path)
        found[path[len(root):] if path.startswith(root) else path] = np.flatnonzero(~np.asarray(keep, dtype=bool)).astype(np.uint64)
    return found


def _deleted_by_the_job(table) -> dict[str, np.ndarray]:
    from spark_jobs.core.deletion_vectors import active_files, deleted_in, table_root

    return deleted_in(table_root(table), active_files(table_root(table), table.version()).values())


def _same_vectors(table) -> bool:
    mine, theirs = _deleted_by_the_job(table), _deleted_by_delta_rs(table)
    return mine.keys() == theirs.keys() and all(np.array_equal(mine[p], theirs[p]) for p in mine)


def test_the_job_reads_each_vector_as_delta_rs_does_after_batches_a_restore_and_a_checkpoint(tmp_path):
    """`deletion_vectors.deleted_in` (the job reads only the vectors of the
    files a batch touches) against delta-rs's reading of every vector: the
    same rows deleted, file by file, after batches merged on read (vectors
    growing batch by batch), delta-rs's RESTORE and a checkpoint."""
    state = _state(tmp_path, True, change_feed=False)
    for n, batch in enumerate(_batches(6, seed=14), start=1):
        commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
        assert _same_vectors(open_table(state.path)), f"batch {n}"
    assert any(len(v) for v in _deleted_by_the_job(open_table(state.path)).values())
    # A stored vector's offset may be left out: its data then follows the file's version byte.
    from spark_jobs.core.deletion_vectors import active_files, deleted_in

    adds = [a for a in active_files(state.path, open_table(state.path).version()).values() if (a.get("deletionVector") or {}).get("offset") == 1]
    unset = [{**a, "deletionVector": {k: v for k, v in a["deletionVector"].items() if k != "offset"}} for a in adds]
    assert adds and all(np.array_equal(deleted_in(state.path, unset)[k], v) for k, v in deleted_in(state.path, adds).items())
    state.restore(state.open(), open_table(state.path).version() - 2, batch_metadata("clicks", Position(1, 4)))
    open_table(state.path).create_checkpoint()
    assert _same_vectors(open_table(state.path))


def _has_runs(folder: Path) -> bool:
    """Whether a vector file in `folder` holds a Roaring bitmap with run containers (its cookie says so)."""
    import struct

    for path in folder.glob("**/deletion_vector_*.bin"):
        data = path.read_bytes()
        at = 1
        while at < len(data):
            (size,) = struct.unpack_from(">I", data, at)
            if struct.unpack_from("<I", data, at + 4 + 12 + 4)[0] & 0xFFFF == 12347:  # after magic, count and the first key
                return True
            at += 4 + size + 4
    return False


def test_the_job_reads_vectors_delta_spark_wrote_runs_bitmaps_and_arrays(tmp_path, spark):
    """Vectors another writer made: delta-spark's DELETEs on a table with
    deletion vectors, whose Roaring bitmaps hold run containers (a range of
    rows), bitmap containers (most of 65,536 rows) and arrays (a few
    scattered rows). The job reads the rows each deletes as delta-rs does,
    and a purge keeps exactly the live rows."""
    from spark_jobs.core.merge_on_read import purge

    path = str(tmp_path / "table")
    spark.range(0, 300_000, 1, 1).selectExpr("id", "id % 7 AS v").write.format("delta").option(
        "delta.enableDeletionVectors", "true"
    ).save(path)
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id BETWEEN 1000 AND 9000")  # a run
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id >= 70000 AND id < 140000 AND id % 97 <> 0")  # a bitmap
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id % 50000 = 7")  # an array
    table = open_table(path)
    assert _same_vectors(table)
    gone = {i for i in range(300_000) if 1000 <= i <= 9000 or (70000 <= i < 140000 and i % 97) or i % 50000 == 7}
    [deleted] = _deleted_by_the_job(table).values()  # one file, its rows in id order
    assert deleted.tolist() == sorted(gone)
    assert _has_runs(tmp_path / "table"), "delta-spark wrote no run container: the test no longer covers them"
    live = sorted(r["id"] for r in read_all(table).to_pylist())
    purge(table)
    assert sorted(r["id"] for r in read_all(open_table(path)).to_pylist()) == live


def test_turned_off_the_state_is_written_copy_on_write_again_and_stays_right(tmp_path):
    """A state merged on read whose spec turns `deletion_vectors` off: the
    next batches are delta-rs's MERGE over the vectors, the rows still the
    copy-on-write twin's."""
    from spark_jobs.core.state import StateTable

    cow, mor = _state(tmp_path / "cow", False), _state(tmp_path / "mor", True)
    batches = _batches(5, seed=5)
    for n, batch in enumerate(batches, start=1):
        if n == 4:
            mor = StateTable(mor.spec.model_copy(update={"state": mor.spec.state.model_copy(update={"deletion_vectors": False})}))
        for state in (cow, mor):
            commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
        assert _rows(mor) == _rows(cow), f"batch {n}"
    assert '"merge-on-read"' not in (Path(mor.path) / "_delta_log" / f"{open_table(mor.path).version():020d}.json").read_text()


@pytest.mark.parametrize(("state", "refusal"), [
    ({"layout": "appended"}, "deletion_vectors is for layout: merged"),
    ({"path": "gs://bucket/state"}, "supported for a state on a local or mounted file system or on S3, not at gs://"),
    ({"path": "s3://bucket/a b/state"}, "deletion_vectors on S3 needs a state path of letters, digits"),
])
def test_a_spec_that_cannot_merge_on_read_is_refused_by_name(tmp_path, state, refusal):
    spec = oracle_spec_dict()
    spec["state"] = {**spec["state"], "deletion_vectors": True, **state}
    with pytest.raises(Exception, match=refusal):
        load_spec(write_spec(tmp_path, spec))


def test_a_batch_big_beside_the_state_or_its_deleted_rows_is_merged_copy_on_write(tmp_path):
    """Merging on read pays while the rows the vectors delete, with the
    batch's, stay within half the rows the files hold: a batch as big as the
    state rewrites the files it touches (dropping their deleted rows), and
    small batches merge on read again after it."""
    cow, mor = _state(tmp_path / "cow", False), _state(tmp_path / "mor", True)
    small = _batches(4, seed=6)
    big = _batches(2, seed=7, then=1800)[1]
    kinds = []
    for n, batch in enumerate([*small[:3], big, small[3]], start=1):
        for state in (cow, mor):
            commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
        kinds.append(_merged_on_read(mor))
        assert _rows(mor) == _rows(cow), f"batch {n}"
    assert kinds == [False, True, True, False, True]


def test_auto_merges_on_read_once_the_state_passes_its_bound_and_stays_so(tmp_path, monkeypatch):
    """`deletion_vectors: auto` (the default): copy-on-write, the table
    without the feature (every Delta reader reads it), while the state's
    files weigh less than `AUTO_FROM_BYTES`; from the batch that finds them
    past it, merged on read, for good (a smaller bound later changes
    nothing). `false` never turns it on. The rows are copy-on-write's after
    every batch."""
    from spark_jobs.core import merge_on_read
    from spark_jobs.core.staged import files_bytes

    cow, auto, never = _state(tmp_path / "cow", False), _state(tmp_path / "auto", "auto"), _state(tmp_path / "never", False)
    (tmp_path / "default").mkdir()
    assert load_spec(write_spec(tmp_path / "default", oracle_spec_dict())).state.deletion_vectors == "auto"
    monkeypatch.setattr(merge_on_read, "AUTO_FROM_BYTES", 1 << 40)
    kinds, features = [], []
    for n, batch in enumerate(_batches(5, seed=11), start=1):
        if n == 3:  # the state now weighs more than the bound
            monkeypatch.setattr(merge_on_read, "AUTO_FROM_BYTES", files_bytes(open_table(auto.path)))
        if n == 5:  # back above what the state weighs: it stays merged on read
            monkeypatch.setattr(merge_on_read, "AUTO_FROM_BYTES", 1 << 40)
        for state in (cow, auto, never):
            commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
        kinds.append(_merged_on_read(auto))
        features.append("deletionVectors" in (open_table(auto.path).protocol().reader_features or []))
        assert _rows(auto) == _rows(cow) == _rows(never), f"batch {n}"
    assert kinds == [False, False, True, True, True]
    assert features == [False, False, True, True, True]
    assert not _merged_on_read(never) and "deletionVectors" not in (open_table(never.path).protocol().reader_features or [])


def _features(path: str) -> tuple[set[str], set[str]]:
    protocol = open_table(path).protocol()
    return set(protocol.reader_features or ()), set(protocol.writer_features or ())


def test_turned_on_mid_life_the_feed_reads_on_in_delta_spark_and_the_protocol_names_no_other_feature(tmp_path, spark, monkeypatch):
    """`auto` turns vectors on in a state whose change feed a downstream
    reads: the protocol moves to table features keeping `changeDataFeed`
    (delta-rs's `add_feature` dropped it, and delta-spark then refused every
    change-feed read from that version: a downstream stuck) and adds no
    `variantType` (delta-rs's `set_table_properties` added it: no reader
    before Delta 4.0 reads that). delta-spark reads the feed across it, as
    the job wrote it. A change feed turned on after the vectors is listed
    too. Found by a try-to-break review."""
    from spark_jobs.core import merge_on_read

    monkeypatch.setattr(merge_on_read, "AUTO_FROM_BYTES", 1)
    state = _state(tmp_path / "chain", "auto")
    batches = _batches(3, seed=12)
    commit_updates(state, state.create(batches[0]), batches[0], Position(0, 1))  # created empty: copy-on-write
    before = open_table(state.path).version()
    for n, batch in enumerate(batches[1:], start=2):
        commit_updates(state, state.open(), batch, Position(0, n))
    assert _merged_on_read(state)
    assert _features(state.path) == ({"deletionVectors"}, {"deletionVectors", "changeDataFeed", "appendOnly", "invariants", "checkConstraints", "generatedColumns"})
    feed = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", before + 1).load(state.path)
    counted = {r["_change_type"]: r["count"] for r in feed.groupBy("_change_type").count().collect()}
    mine: dict[str, int] = {}
    for version in range(before + 1, open_table(state.path).version() + 1):
        for change in _changes(state, version):
            kind = dict(change)["_change_type"]
            mine[kind] = mine.get(kind, 0) + 1
    assert counted == mine and counted.get("update_postimage")

    late = _state(tmp_path / "late_feed", True, change_feed=False)
    commit_updates(late, late.create(batches[0]), batches[0], Position(0, 1))
    commit_updates(late, late.open(), batches[1], Position(0, 2))
    from spark_jobs.core.state import StateTable

    late = StateTable(late.spec.model_copy(update={"state": late.spec.state.model_copy(update={"change_feed": True})}))
    commit_updates(late, late.open(), batches[2], Position(0, 3))
    readers, writers = _features(late.path)
    assert readers == {"deletionVectors"} and "changeDataFeed" in writers and "variantType" not in writers


def test_a_run_that_lost_the_race_to_turn_vectors_on_goes_on_when_the_winner_turned_them_on(tmp_path):
    """Two runs reach the bound together: the one whose entry loses finds
    the vectors on (the winner's entry; on S3, perhaps its own, answered
    with an error) and goes on from the table's latest version, as a run
    started after the winner would; another commit in between (not
    turning them on) still fails it."""
    from deltalake.exceptions import CommitFailedError

    from spark_jobs.core import merge_on_read

    state = _state(tmp_path / "race", "auto", change_feed=False)
    batch = _batches(1, seed=15)[0]
    commit_updates(state, state.create(batch), batch, Position(0, 1))
    loser = state.open()
    merge_on_read.enable(state.open())
    merge_on_read.enable(loser)
    assert merge_on_read.enabled(loser) and loser.version() == open_table(state.path).version()

    other = _state(tmp_path / "other", "auto", change_feed=False)
    commit_updates(other, other.create(batch), batch, Position(0, 1))
    stale = other.open()
    commit_updates(other, other.open(), _batches(2, seed=16)[1], Position(0, 2))
    with pytest.raises(CommitFailedError):
        merge_on_read.enable(stale)


def test_a_rewind_to_before_auto_turned_them_on_turns_them_on_again_at_the_next_batch(tmp_path, monkeypatch):
    """delta-rs's RESTORE brings back the metadata of a version before the
    vectors were on (their property off; the protocol stays): the next batch
    turns them on again and merges on read, as `auto` keeps them on for
    good; the rows stay copy-on-write's (found by a try-to-break review)."""
    from spark_jobs.core import merge_on_read

    cow, auto = _state(tmp_path / "cow", False, change_feed=False), _state(tmp_path / "auto", "auto", change_feed=False)
    batches = _batches(5, seed=13)
    monkeypatch.setattr(merge_on_read, "AUTO_FROM_BYTES", 1 << 40)
    for n, batch in enumerate(batches[:2], start=1):
        for state in (cow, auto):
            commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
    restore_to = {state.path: open_table(state.path).version() for state in (cow, auto)}
    monkeypatch.setattr(merge_on_read, "AUTO_FROM_BYTES", 1)
    for state in (cow, auto):
        commit_updates(state, state.open(), batches[2], Position(0, 3))
    assert _merged_on_read(auto) and merge_on_read.enabled(open_table(auto.path))
    monkeypatch.setattr(merge_on_read, "AUTO_FROM_BYTES", 1 << 40)
    for state in (cow, auto):
        state.restore(state.open(), restore_to[state.path], batch_metadata(state.spec.name, Position(1, 2)))
    assert not merge_on_read.enabled(open_table(auto.path))  # (delta-rs's RESTORE took the property back)
    for state in (cow, auto):
        commit_updates(state, state.open(), batches[3], Position(1, 3))
    assert _merged_on_read(auto) and merge_on_read.enabled(open_table(auto.path))
    assert _rows(auto) == _rows(cow)


def test_row_groups_read_on_every_core_each_have_their_own_reader(tmp_path, monkeypatch):
    """A state file of many row groups, each batch's keys in all of them:
    the groups are read in runs (of three groups here), `READERS` runs at a
    time, each thread through a Parquet reader of its own (one shared by the
    threads failed with "ReadRangeCache did not find matching cache entry"
    or crashed the process, about half the batches of a try-to-break
    review's 5M-key state), each run's deleted rows found among its file's
    at its offset. Ten batches, the rows copy-on-write's after each."""
    from deltalake import WriterProperties, write_deltalake

    from spark_jobs.core import merge_on_read

    monkeypatch.setattr(merge_on_read, "READERS", 4)
    monkeypatch.setattr(merge_on_read, "UNIT_ROWS", 5_000)
    cow, mor = _simple(tmp_path / "cow", False, change_feed=False), _simple(tmp_path / "mor", True, change_feed=False)
    seed = _keyed(list(range(200_000)), [1] * 200_000)
    for state in (cow, mor):
        state.create(seed)
        rows = seed.append_column("_batch_id", pa.array([0] * seed.num_rows, pa.int64()))
        write_deltalake(state.path, rows, mode="append", writer_properties=WriterProperties(max_row_group_size=2_000))
    assert pq_groups(mor.path) >= 50
    rng = random.Random(14)
    for n in range(1, 11):
        batch = _keyed(rng.sample(range(200_000), 3_000), [n] * 3_000)
        for state in (cow, mor):
            commit_updates(state, state.open(), batch, Position(0, n))
        assert _merged_on_read(mor), f"batch {n}"
        assert sorted(read_all(open_table(mor.path)).to_pylist(), key=lambda r: r["k"]) == sorted(read_all(open_table(cow.path)).to_pylist(), key=lambda r: r["k"]), n


def pq_groups(path: str) -> int:
    import pyarrow.parquet as pq

    return max(pq.ParquetFile(f).metadata.num_row_groups for f in Path(path).glob("*.parquet"))


@pytest.mark.parametrize("state", [{"layout": "appended"}, {"path": "s3://bucket/a b/state"}])
def test_auto_where_a_state_cannot_merge_on_read_stays_copy_on_write(tmp_path, state):
    """Where `deletion_vectors: true` is refused by name, the default `auto`
    is taken and never turns them on (no table needed to say so)."""
    from spark_jobs.core import merge_on_read

    spec = oracle_spec_dict()
    spec["state"] = {**spec["state"], **state}
    loaded = load_spec(write_spec(tmp_path, spec)).state
    assert loaded.deletion_vectors == "auto" and not loaded.may_merge_on_read
    assert not merge_on_read.due(loaded, table=None) and not merge_on_read.merges(loaded, table=None)


def _keyed(keys, values, kind=pa.int64()) -> pa.Table:
    return pa.table({"k": pa.array(keys, kind), "s": pa.array(values, pa.int64())})


def _simple(folder: Path, vectors: bool, change_feed: bool = True):
    from spark_jobs.core.state import StateTable

    spec = oracle_spec_dict()
    spec["state"] = {"path": "lake/state", "keys": ["k"], "merge": {"s": "sum"}, "deletion_vectors": vectors, "change_feed": change_feed}
    folder.mkdir(parents=True, exist_ok=True)
    return StateTable(load_spec(write_spec(folder, spec)))


def test_a_timestamp_key_past_its_file_s_millisecond_bound_is_found_not_stored_twice(tmp_path):
    """The log keeps a file's largest time cut to the millisecond: a batch
    of only the state's last key (a microsecond past that bound) is merged
    into its row, not inserted beside it (found by a review: the key twice)."""
    from datetime import datetime, timedelta, timezone

    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    keys = [start + timedelta(microseconds=1001 * k) for k in range(2000)]
    kind = pa.timestamp("us", tz="UTC")
    state = _simple(tmp_path, True)
    first = _keyed(keys, [1] * 2000, kind)
    commit_updates(state, state.create(first), first, Position(0, 1))
    commit_updates(state, state.open(), _keyed([keys[-1]], [10], kind), Position(0, 2))
    assert _merged_on_read(state)
    assert [r["s"] for r in _rows(state) if r["k"] == keys[-1]] == [11]


def test_after_a_rewind_the_files_and_their_vectors_are_read_as_delta_rs_reads_them(tmp_path):
    """delta-rs's RESTORE adds a file with its old vector and removes it
    with its newer one, in one entry: the log is read by path and vector,
    so the next batch finds that file (a review saw it vanish: every retry
    of the batch failed). Without a change feed: a rewind is delta-rs's
    RESTORE then (`merge_on_read.restore` writes one with change files)."""
    from spark_jobs.core.deletion_vectors import active_files, carries_vectors

    cow, mor = _simple(tmp_path / "cow", False, change_feed=False), _simple(tmp_path / "mor", True, change_feed=False)
    batches = [_keyed(range(2000), [1] * 2000), _keyed([*range(2000, 2900), 0], [1] * 901), _keyed(range(1, 51), [1] * 50)]
    versions = {}
    for n, batch in enumerate(batches, start=1):
        for state in (cow, mor):
            versions[state.path, n] = commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))[0]
    for state in (cow, mor):
        state.restore(state.open(), versions[state.path, 2], batch_metadata("clicks", Position(1, 2)))
    table = open_table(mor.path)
    assert carries_vectors(table) and len(active_files(mor.path, table.version())) == len(table.file_uris())
    assert _rows(mor) == _rows(cow)
    for state in (cow, mor):
        commit_updates(state, state.open(), _keyed(range(100, 180), [1] * 80), Position(1, 3))
    assert _merged_on_read(mor) and _rows(mor) == _rows(cow)


def test_widening_a_column_over_vectors_leaves_a_change_feed_a_downstream_nets_to_nothing(tmp_path):
    """A merge column widened (INT to BIGINT) rewrites the state; delta-rs
    reads the removal of a file with a vector as the rows the vector
    deletes, so the vectors are purged first (a commit that changes no
    data): the widening's change feed deletes exactly the live rows and
    inserts them again (a review's downstream counted users twice)."""
    state = _simple(tmp_path, True)
    narrow = pa.table({"k": pa.array(range(2000), pa.int64()), "s": pa.array([1] * 2000, pa.int32())})
    commit_updates(state, state.create(narrow), narrow, Position(0, 1))
    commit_updates(state, state.open(), narrow.slice(0, 100), Position(0, 2))
    assert _merged_on_read(state)
    live = _rows(state)
    wide = pa.table({"k": pa.array([5, 7], pa.int64()), "s": pa.array([2**40, 1], pa.int64())})
    commit_updates(state, state.open(), wide, Position(0, 3))
    table = open_table(state.path)
    operations = [commit_info(state.path, v)["operation"] for v in range(table.version() - 2, table.version() + 1)]
    assert operations == ["REORG", "WRITE", "MERGE"], operations  # the purge, the widening's overwrite, the batch
    widened = arrow(table.load_cdf(starting_version=table.version() - 1, ending_version=table.version() - 1).read_all())
    kinds = widened.column("_change_type").to_pylist()
    assert kinds.count("delete") == kinds.count("insert") == len(live)
    deleted = sorted(k for k, kind in zip(widened.column("k").to_pylist(), kinds) if kind == "delete")
    assert deleted == [r["k"] for r in live]
    assert {r["k"]: r["s"] for r in _rows(state)}[5] == 2 + 2**40


def test_maintain_s_purge_leaves_no_vector_and_every_row(tmp_path):
    """`merge_on_read.purge` (what `maintain` runs after its compaction):
    each file with a vector rewritten without the rows it deletes, in a
    commit that changes no data; the rows are the same, none is read dead."""
    from spark_jobs.core.deletion_vectors import carries_vectors
    from spark_jobs.core.merge_on_read import purge

    state = _state(tmp_path, True)
    for n, batch in enumerate(_batches(4, seed=8), start=1):
        commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
    rows, version = _rows(state), open_table(state.path).version()
    assert carries_vectors(open_table(state.path))
    purged, files = purge(open_table(state.path))
    table = open_table(state.path)
    assert purged == version + 1 and files >= 1 and not carries_vectors(table)
    assert _rows(state) == rows and commit_info(state.path, purged)["operation"] == "REORG"
    assert arrow(table.load_cdf(starting_version=purged, ending_version=purged).read_all()).num_rows == 0
    assert purge(table) is None


def test_a_rewind_to_before_the_first_batch_deletes_every_live_row_in_its_change_feed(tmp_path):
    """A rewind to the start (an empty state) over vectors: the change feed
    deletes exactly the live rows, as a downstream must see it."""
    state = _state(tmp_path, True)
    for n, batch in enumerate(_batches(3, seed=9), start=1):
        commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
    live = len(_rows(state))
    state.restore(state.open(), None, batch_metadata("clicks", Position(1, 0)))
    version = open_table(state.path).version()
    assert _rows(state) == [] and _replays(state, version)
    feed = arrow(open_table(state.path).load_cdf(starting_version=version, ending_version=version).read_all())
    assert feed.column("_change_type").to_pylist() == ["delete"] * live


def test_vector_files_no_kept_version_names_are_removed_and_every_kept_version_reads_as_before(tmp_path):
    """Each batch merged on read writes a vector file, and the next batch's
    vector for the same data file makes the old one dead: `maintain`'s
    removal of untracked files (`untracked.remove_untracked`) deletes the
    old vector files no kept version names, an orphan one too, and keeps a
    young one (a batch's on its way to its commit). Every kept version
    reads the rows it read before, and a rewind to the oldest still works."""
    import os
    import time

    from spark_jobs.core.deletion_vectors import vector_file
    from spark_jobs.core.maintain import restorable
    from spark_jobs.core.untracked import remove_untracked

    state = _state(tmp_path, True)
    versions = []
    for n, batch in enumerate(_batches(6, seed=10), start=1):
        versions.append(commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))[0])
    root = Path(state.path)
    old, orphan, young = time.time() - 3 * 3600, root / "deletion_vector_orphan.bin", root / "deletion_vector_young.bin"
    orphan.write_bytes(b"\x01")
    young.write_bytes(b"\x01")
    for path in root.glob("*"):
        if path != young and path.is_file():
            os.utime(path, (old, old))
    before = {p.name for p in root.glob("deletion_vector_*.bin")}
    keep_from = versions[3]
    reads = {v: _sorted(read_all(DeltaTable(state.path, version=v)).to_pylist()) for v in range(keep_from, versions[-1] + 1)}
    named = {vector_file(state.path, a.get("deletionVector")) for v in reads for a in _adds(state.path, v)} - {None}

    removed = remove_untracked(open_table(state.path), keep_from, 1, [STATE_FENCE])

    after = {p.name for p in root.glob("deletion_vector_*.bin")}
    assert orphan.name not in after and young.name in after
    assert named <= after and len(before - after) == removed >= 2, "the first batches' vector files are dead"
    for v, rows in reads.items():
        assert _sorted(read_all(DeltaTable(state.path, version=v)).to_pylist()) == rows, f"version {v}"
    # A version not kept whose data files all remain (a batch merged on read
    # removes none) lost its vector files: a rewind must not take it.
    assert [restorable(state.path, v) for v in versions] == [True, False, False, True, True, True]
    state.restore(state.open(), keep_from, batch_metadata("clicks", Position(1, 4)))
    assert _sorted(read_all(open_table(state.path)).to_pylist()) == reads[keep_from]


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r["k"])


def _adds(path: str, version: int) -> list[dict]:
    from spark_jobs.core.deletion_vectors import active_files

    return list(active_files(path, version).values())


def test_vectors_named_by_absolute_path_into_the_table_are_kept_while_a_kept_version_names_them(tmp_path):
    """A writer may name a vector file by its absolute path (storage type
    ``p``) rather than by UUID: one inside the table's folder is the
    table's, kept while a kept version names it and removed after, as the
    job's own are (a review found such live files deleted)."""
    import json
    import os
    import time

    from spark_jobs.core.deletion_vectors import vector_file
    from spark_jobs.core.maintain import restorable
    from spark_jobs.core.untracked import remove_untracked

    state = _state(tmp_path, True)
    for n, batch in enumerate(_batches(6, seed=15), start=1):
        commit_updates(state, state.open() or state.create(batch), batch, Position(0, n))
    for entry in (Path(state.path) / "_delta_log").glob("*.json"):
        actions = [json.loads(line) for line in entry.read_text().splitlines() if line.strip()]
        for action in actions:
            for kind in ("add", "remove"):
                descriptor = action.get(kind, {}).get("deletionVector")
                if descriptor and descriptor["storageType"] == "u":
                    uri = (Path(state.path) / vector_file(state.path, descriptor)).as_uri()
                    action[kind]["deletionVector"] = {**descriptor, "storageType": "p", "pathOrInlineDv": uri}
        entry.write_text("".join(json.dumps(a) + "\n" for a in actions))
    head = open_table(state.path).version()
    rows = _rows(state)
    old = time.time() - 3 * 3600
    for path in Path(state.path).glob("deletion_vector_*.bin"):
        os.utime(path, (old, old))
    removed = remove_untracked(open_table(state.path), head - 1, 1, [STATE_FENCE])
    assert removed >= 1 and _rows(state) == rows and restorable(state.path, head - 1) and restorable(state.path, head)


def test_the_job_s_own_commits_checkpoint_at_the_table_s_interval(tmp_path):
    """delta-rs checkpoints after its own commits; a state whose batches
    are all the job's own entries got none, and every open read every
    entry since the table began. Now an own commit at the interval
    (`delta.checkpointInterval`, 10 on the job's tables) writes one, which
    delta-rs and the job's log reader (`active_files`) read alike."""
    from spark_jobs.core.deletion_vectors import active_files

    mor = _state(tmp_path / "mor", True)
    batches = _batches(12, seed=5)
    commit_updates(mor, mor.create(batches[0]), batches[0], Position(0, 1))
    n = 1
    while open_table(mor.path).version() < 20:
        n += 1
        batch = batches[n % len(batches)]
        commit_updates(mor, mor.open(), batch, Position(0, n))
    log_folder = Path(mor.path) / "_delta_log"
    own = [v for v in (10, 20) if _merged_on_read_at(mor, v)]
    assert own, "a version at the interval was the job's own commit"
    for v in own:
        assert (log_folder / f"{v:020d}.checkpoint.parquet").exists(), f"no checkpoint at own version {v}"
    latest = open_table(mor.path).version()
    assert len({r["k"] for r in _rows(mor)}) == len(_rows(mor))
    assert set(active_files(mor.path, latest)) == {a for a in open_table(mor.path).get_add_actions(flatten=True).column("path").to_pylist()}


def _merged_on_read_at(state, version: int) -> bool:
    return '"merge-on-read"' in (Path(state.path) / "_delta_log" / f"{version:020d}.json").read_text()
