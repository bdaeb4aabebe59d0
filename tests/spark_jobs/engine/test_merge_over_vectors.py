"""A big batch into a state merged on read, merged by the executors' join.

A state merged on read (`state.deletion_vectors`) has files whose deletion
vectors delete some of their rows. A batch too big for the job's process
(more than `IN_PROCESS_ROWS` rows: the bound lowered to none here, in this
process or in the CLI's, `BIG_BATCHES`) is merged by the executors' join
(`StateTable._merge_by_join`): each task reads a file without the rows its
vector deletes (`spark_files.read_files`), and the job commits the entry
itself, the rewritten files removed with their vectors (delta-rs can
commit neither that removal nor change files written by others). So each
test first leaves vectors (`_with_vectors`: a first batch, then a few
returning users merged on read in the job's process).

Real Spark (the suite's session), real Delta tables in `tmp_path`, the real
protocol; a rows' oracle (`assert_exact`): a deleted row read again would
count its user twice.
"""

from __future__ import annotations

import json
import signal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from spark_jobs.core.commits import METADATA_KEY
from spark_jobs.core.deletion_vectors import carries_vectors, write_vectors
from spark_jobs.core.delta_io import commit_info, read_all
from spark_jobs.core.faults import MARKER
from spark_jobs.core.fencing import STATE_FENCE, Position
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.engine.spark_files import read_files
from tests.conftest import (
    assert_exact, assert_feed_is_the_change, assert_versions_carry_batches, lose_the_race_to_the_join, oracle_spec_dict, run_cli, write_spec,
)
from tests.spark_jobs.engine.test_spark_state import _by_key, arrow_rows  # noqa: F401 - a fixture


def _spec(tmp_path, state_write: str = "executors", change_feed: bool = True):
    base = oracle_spec_dict()
    return write_spec(tmp_path, oracle_spec_dict(
        state={**base["state"], "change_feed": change_feed, "deletion_vectors": True},
        engine={"state_write": state_write},
        batch={"max_files": 1},
    ))


def _run(spec_path, compute) -> str:
    return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status


def _all_big(monkeypatch) -> None:
    """This process's batches from now on all count as big (`BIG_BATCHES`)."""
    import spark_jobs.core.state as state_module

    monkeypatch.setattr(state_module, "IN_PROCESS_ROWS", 0)


def _with_vectors(tmp_path, run, users: int = 500, change_feed: bool = True) -> object:
    """A state merged on read whose files carry vectors, then set to be
    written by the executors: batch 1 writes `users` users, batch 2 (a few
    of them, under `state_write: auto`) is merged on read in the job's
    process. `run(spec_path)` runs one batch and returns its status."""
    spec_path = _spec(tmp_path, state_write="auto", change_feed=change_feed)
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=2 * users, users=users)
    assert run(spec_path) == "committed"
    write_wave(tmp_path / "landing", 1, files=1, records_per_file=max(2, users // 25), users=users)
    assert run(spec_path) == "committed"
    assert carries_vectors(DeltaTable(load_spec(spec_path).state_path)), "batch 2 was merged on read"
    return _spec(tmp_path, change_feed=change_feed)


def _removed_vectors(state_path: str, version: int) -> int:
    """How many of the files version `version` removed carried a deletion vector."""
    with open(f"{state_path}/_delta_log/{version:020d}.json") as entry:
        actions = [json.loads(line) for line in entry]
    return sum(1 for action in actions if "remove" in action and action["remove"].get("deletionVector"))


@pytest.mark.parametrize("change_feed", [True, False], ids=["change_feed", "no_feed"])
def test_returning_keys_over_vectors_are_merged_by_the_join_without_the_rows_the_vectors_delete(
    tmp_path, compute, spark, arrow_rows, monkeypatch, change_feed,  # noqa: F811
):
    """A batch of the same 500 users into a state whose files carry vectors:
    one entry by the executors' join, removing files with their vectors,
    carrying the state fence and the batch's metadata; no row came back to
    the job's process, no deleted row was read again (the state is exact),
    and with a change feed, the feed is each returning user's row before and
    after, as delta-rs and delta-spark read it."""
    spec_path = _with_vectors(tmp_path, lambda path: _run(path, compute), change_feed=change_feed)
    _all_big(monkeypatch)
    spec = load_spec(spec_path)
    write_wave(tmp_path / "landing", 2, files=1, records_per_file=1000, users=500)
    before = _by_key(spec.state_path)
    arrow_rows.clear()  # (batches 1 and 2 came back to be merged in the job's process)
    assert _run(spec_path, compute) == "committed"
    assert max(arrow_rows) <= 8, f"rows brought back to the job's process: {arrow_rows}"
    assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)
    table = DeltaTable(spec.state_path)
    info = commit_info(spec.state_path, table.version())
    assert info["operation"] == "MERGE" and info["operationParameters"]["mode"] == "executors' join", info
    assert json.loads(info[METADATA_KEY])["txn"] == Position(0, 3).encode()
    assert table.transaction_version(STATE_FENCE) == Position(0, 3).encode()
    assert _removed_vectors(spec.state_path, table.version()), "a file with a vector was rewritten"
    after = _by_key(spec.state_path)  # (a deleted row read again would be a key twice)
    if change_feed:
        feed = assert_feed_is_the_change(table, before, after)
        assert feed.get("update_postimage"), "users came back"
        kinds = {r["_change_type"]: r["count"] for r in spark.read.format("delta").option("readChangeFeed", "true")
                 .option("startingVersion", table.version()).load(spec.state_path).groupBy("_change_type").count().collect()}
        assert kinds == {t: len(rows) for t, rows in feed.items()}, kinds
    # delta-spark reads the same rows (its own reading of the vectors left).
    assert spark.read.format("delta").load(spec.state_path).count() == read_all(table).num_rows


def test_a_run_that_lost_the_race_to_the_join_over_vectors_is_a_no_op(tmp_path, compute, monkeypatch):
    """Another run commits batch 3 after this run's join over vectors wrote
    its files and before its commit: the commit fails, step 4 finds the
    winner's batch, and the run ends as one that lost the race does; its
    files are deleted, nothing is merged twice."""
    spec_path = _with_vectors(tmp_path, lambda path: _run(path, compute))
    _all_big(monkeypatch)
    write_wave(tmp_path / "landing", 2, files=1, records_per_file=1000, users=500)
    lose_the_race_to_the_join(monkeypatch, spec_path, lambda: _run(spec_path, compute))


def test_a_file_is_read_without_the_rows_its_vector_deletes_across_its_row_groups(tmp_path, spark):
    """`read_files` on the executors: a file of several row groups (and so
    several Arrow batches a task reads), a vector deleting rows in each and
    at both ends, stored with another file's vector in one vector file (read
    by its range), and a file without one, read whole."""
    root = tmp_path / "table"
    root.mkdir()
    schema = pa.schema([("k", pa.int64()), ("v", pa.string())])
    for name, n in (("a.parquet", 10_000), ("b.parquet", 50)):
        pq.write_table(pa.table({"k": pa.array(range(n), pa.int64()), "v": [f"{name}{i}" for i in range(n)]}, schema=schema),
                       root / name, row_group_size=1_000)
    deleted = np.array([0, 1, 999, 1000, 5555, 9999], np.uint64)
    # Two vectors in one file: the first another file's (never read here), the second a.parquet's.
    _, descriptor = write_vectors(str(root), [np.array([3, 4], np.uint64), deleted])
    vectors = {"a.parquet": descriptor}
    rows = read_files(spark, str(root), ["a.parquet", "b.parquet"], schema, {}, vectors).toArrow()
    a = sorted(k for k, v in zip(rows.column("k").to_pylist(), rows.column("v").to_pylist(), strict=True) if v.startswith("a."))
    assert a == [k for k in range(10_000) if k not in set(deleted.tolist())]
    assert rows.num_rows == len(a) + 50, "the file without a vector is read whole"


# `mid_state_merge` stays in `make test`: it kills a run between the join's
# files over vectors and the job's commit, on the run's own Spark. The other
# points in `make soak`.
@pytest.mark.parametrize(
    ("point", "change_feed"),
    [
        ("mid_state_merge", True),
        pytest.param("mid_state_merge", False, marks=pytest.mark.slow),
        pytest.param("after_plan", True, marks=pytest.mark.slow),
        pytest.param("after_state_commit", True, marks=pytest.mark.slow),
    ],
)
def test_a_run_killed_amid_the_join_over_vectors_or_after_its_commit_is_exact_after_a_rerun(tmp_path, compute, point, change_feed):
    """SIGKILL of a run on its own Spark once the join over vectors has
    written its files (before the commit; with a change feed or without),
    or once its commit landed, or after its plan: the next run replays the
    batch or records the commit; the batch is the join's entry, and the
    state is exact."""
    spec_path = _with_vectors(tmp_path, lambda path: _run(path, compute), users=100, change_feed=change_feed)
    landing = tmp_path / "landing"
    write_wave(landing, 2, files=1, records_per_file=600, users=100)
    crashed = run_cli("run", str(spec_path), big=True, env={"MICROBATCH_FAULT_POINT": point, "MICROBATCH_SPARK_MASTER": "local[2]"})
    assert f"{MARKER} {point}" in crashed.stderr, crashed.stderr[-2000:]
    assert crashed.returncode == -signal.SIGKILL
    write_wave(landing, 3, files=1, records_per_file=600, users=100)
    recovered = run_cli("run", str(spec_path), "--json", big=True, env={"MICROBATCH_SPARK_MASTER": "local[2]"})
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    assert json.loads(recovered.stdout)["status"] == "committed"
    while _run(spec_path, compute) != "no_new_data":
        pass
    assert_exact(spec_path)
    lineage = assert_versions_carry_batches(spec_path)
    spec = load_spec(spec_path)
    mode = commit_info(spec.state_path, lineage[2].state_version).get("operationParameters", {}).get("mode")
    assert mode == "executors' join", f"batch 3 was merged by {mode or 'delta-rs'}"
    assert _removed_vectors(spec.state_path, lineage[2].state_version)


def test_over_spark_connect_the_server_s_executors_merge_the_batch_over_vectors(tmp_path, on_connect):
    """A run that is a thin client of a Connect server: the server's
    executors read the state's files without their deleted rows, decoding
    the vectors with this project's code pickled to them."""
    def run(path, big: bool = False) -> str:
        result = run_cli("run", str(path), "--json", big=big)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)["status"]

    spec_path = _with_vectors(tmp_path, run, users=100)
    write_wave(tmp_path / "landing", 2, files=1, records_per_file=600, users=100)
    assert run(spec_path, big=True) == "committed"
    assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)
    spec = load_spec(spec_path)
    version = DeltaTable(spec.state_path).version()
    assert commit_info(spec.state_path, version)["operationParameters"]["mode"] == "executors' join"
    assert _removed_vectors(spec.state_path, version)


def test_no_session_loads_delta_spark_to_write_a_state(tmp_path):
    """`SparkFactory.expect`: a big batch into a change-feed state merged on
    read (MERGEd by delta-spark until 2026-12-04) gets a session without
    delta-spark, which cost a start 1.6 s; a batch its manifest says Spark
    reads (a Delta source's) still gets one."""
    from spark_jobs.engine import compute_factory
    from spark_jobs.sources.base import BatchRange

    class Manifest:
        def __init__(self, reader: str | None) -> None:
            self.reader = reader

        def input_bytes(self):
            return 64 * 2**20

        def reader_for(self, _asked: str) -> str | None:
            return self.reader

    base = oracle_spec_dict()
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(
        state={**base["state"], "change_feed": True, "deletion_vectors": True}, engine={"state_write": "executors"})))
    factory = compute_factory(spec, "local[1]")
    factory.expect(spec, BatchRange(None, None, Manifest("driver")))
    assert not factory._delta
    factory.expect(spec, BatchRange(None, None, Manifest("spark")))
    assert factory._delta
