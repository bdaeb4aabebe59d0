"""A change-feed state MERGEd by delta-spark on the executors (issue 64).

delta-spark merges the one batch the executors' join cannot
(`write_path.merged_by_delta_spark`): a big batch into a state merged on read,
whose files carry deletion vectors. So each test below first leaves vectors
(`_with_vectors`: a first batch, then a few returning users merged on read in
the job's process), then has a batch of more than `IN_PROCESS_ROWS` rows
(the bound lowered to none, in this process or in the CLI's: `BIG_BATCHES`)
written by the executors (`state_write: executors`).

Real Spark (the suite's session, which has delta-spark), real Delta tables
in `tmp_path`, the real protocol. What the fence relies on is shown on real
races: a commit carrying the state fence landing while delta-spark's MERGE
runs fails it, a fence already at its version skips it, and the protocol
turns both into the outcome a lost race has with delta-rs.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from spark_jobs.core.commits import METADATA_KEY
from spark_jobs.core.deletion_vectors import carries_vectors
from spark_jobs.core.delta_io import commit_info, is_commit_conflict, read_all
from spark_jobs.core.fencing import STATE_FENCE, Position
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.engine import delta_merge
from spark_jobs.engine.spark_compute import _writing_state
from spark_jobs.core.faults import MARKER
from tests.conftest import assert_exact, assert_versions_carry_batches, oracle_spec_dict, run_cli, winner_first, write_spec
from tests.spark_jobs.engine.test_spark_state import arrow_rows  # noqa: F401 - a fixture


def _spec(tmp_path, state_write: str = "executors", vectors: bool = True):
    base = oracle_spec_dict()
    return write_spec(tmp_path, oracle_spec_dict(
        state={**base["state"], "change_feed": True, "deletion_vectors": vectors},
        engine={"state_write": state_write},
        batch={"max_files": 1},
    ))


def _run(spec_path, compute) -> str:
    return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status


def _all_big(monkeypatch) -> None:
    """This process's batches from now on all count as big (`BIG_BATCHES`)."""
    import spark_jobs.core.state as state_module

    monkeypatch.setattr(state_module, "IN_PROCESS_ROWS", 0)


def _with_vectors(tmp_path, run, users: int = 500) -> object:
    """A state merged on read whose files carry vectors, then set to be
    written by the executors: batch 1 writes `users` users, batch 2 (a few
    of them, under `state_write: auto`) is merged on read in the job's
    process. `run(spec_path)` runs one batch and returns its status."""
    spec_path = _spec(tmp_path, state_write="auto")
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=2 * users, users=users)
    assert run(spec_path) == "committed"
    write_wave(tmp_path / "landing", 1, files=1, records_per_file=max(2, users // 25), users=users)
    assert run(spec_path) == "committed"
    assert carries_vectors(DeltaTable(load_spec(spec_path).state_path)), "batch 2 was merged on read"
    return _spec(tmp_path)


def test_returning_keys_are_merged_by_delta_spark_with_the_fence_the_metadata_and_the_change_feed(tmp_path, compute, spark, arrow_rows, monkeypatch):  # noqa: F811
    """A batch of the same 500 users into a state whose files carry vectors:
    one MERGE commit by delta-spark carrying the state fence and the batch's
    metadata; its change feed has each returning user's row before and
    after, and no row of the batch came back to the job's process."""
    spec_path = _with_vectors(tmp_path, lambda path: _run(path, compute))
    _all_big(monkeypatch)
    write_wave(tmp_path / "landing", 2, files=1, records_per_file=1000, users=500)
    arrow_rows.clear()  # (batches 1 and 2 came back to be merged in the job's process)
    assert _run(spec_path, compute) == "committed"
    assert max(arrow_rows) <= 8, f"rows brought back to the job's process: {arrow_rows}"
    assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)
    spec = load_spec(spec_path)
    table = DeltaTable(spec.state_path)
    info = commit_info(spec.state_path, table.version())
    assert info["operation"] == "MERGE" and "engineInfo" in info and "Delta-Lake" in info["engineInfo"], info.get("engineInfo")
    assert json.loads(info[METADATA_KEY])["txn"] == Position(0, 3).encode()
    assert table.transaction_version(STATE_FENCE) == Position(0, 3).encode()
    changes = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", table.version()).load(spec.state_path)
    kinds = {r["_change_type"]: r["count"] for r in changes.groupBy("_change_type").count().collect()}
    returning = kinds.get("update_postimage", 0)
    assert returning > 0 and kinds.get("update_preimage") == returning, kinds
    before = {r["user_id"]: r["events"] for r in changes.where("_change_type = 'update_preimage'").collect()}
    after = {r["user_id"]: r["events"] for r in changes.where("_change_type = 'update_postimage'").collect()}
    assert before.keys() == after.keys() and all(after[k] > before[k] for k in before), "a sum's postimage adds the batch's count"
    # delta-rs reads the table after delta-spark's commit, as every reader of the state does.
    assert read_all(table).num_rows == kinds.get("insert", 0) + len(read_all(DeltaTable(spec.state_path, version=table.version() - 1)).to_pylist())


def test_a_small_batch_stays_with_delta_rs_and_a_first_batch_needs_no_merge(tmp_path, compute):
    """`state_write: auto` with small batches: delta-rs merges them in the
    job's process as before (no delta-spark commit in the state's log)."""
    spec_path = _spec(tmp_path, state_write="auto", vectors=False)
    for wave in (0, 1):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=400, users=200)
        assert _run(spec_path, compute) == "committed"
    assert_exact(spec_path)
    spec = load_spec(spec_path)
    infos = [commit_info(spec.state_path, v) for v in range(DeltaTable(spec.state_path).version() + 1)]
    assert not any("Delta-Lake" in str(i.get("engineInfo", "")) for i in infos), [i.get("engineInfo") for i in infos]


def test_a_run_that_lost_the_race_before_delta_spark_merged_is_a_no_op(tmp_path, compute, monkeypatch):
    """Another run commits batch 3 after this run checked the fence and
    before delta-spark's MERGE: delta-spark skips the MERGE (the fence
    already reads 3), and the run ends as one that lost the race does, with
    the winner's batch recorded and nothing merged twice."""
    spec_path = _with_vectors(tmp_path, lambda path: _run(path, compute))
    _all_big(monkeypatch)
    write_wave(tmp_path / "landing", 2, files=1, records_per_file=1000, users=500)
    winner = winner_first(monkeypatch, delta_merge, "merge", lambda: _run(spec_path, compute))
    assert _run(spec_path, compute) == "already_committed"
    assert winner == ["committed"]
    assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)


def test_a_fenced_commit_landing_during_delta_spark_s_merge_fails_it_as_a_conflict(tmp_path, spark):
    """The race fencing.py relies on, with delta-spark: a MERGE that read the
    fence at 1 and commits 2 fails when a commit carrying the same app id
    (at a lower version even) lands while it runs; the error is a commit
    conflict to the protocol; and a MERGE at a version the fence holds is
    skipped."""
    path = str(tmp_path / "state")
    rows = pa.table({"k": pa.array(range(100), pa.int64()), "v": pa.array([1] * 100, pa.int64())})
    fenced = lambda version: CommitProperties(app_transactions=[Transaction(STATE_FENCE, version)])  # noqa: E731
    write_deltalake(path, rows, configuration={"delta.enableChangeDataFeed": "true"}, commit_properties=fenced(1))
    # A source whose read holds (one row does, in a filter no plan can drop)
    # until the winner has landed: mid-MERGE, after it read the fence, however
    # loaded the machine. (A fixed three seconds let the winner land before
    # the MERGE's read on a loaded machine, and the MERGE rightly committed.)
    gate = tmp_path / "gate"
    gate.mkdir()

    def held(k: int) -> bool:
        if k == 0 and not (gate / "landed").exists():
            (gate / "reading").touch()
            deadline = time.monotonic() + 120
            while not (gate / "landed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return True

    spark.udf.register("held_until_the_winner_landed", held, "boolean")
    spark.range(0, 200, 1, 1).selectExpr("id AS k", "1L AS v").createOrReplaceTempView("slow_batch")
    slow = "held_until_the_winner_landed(k)"
    sql = f"MERGE INTO delta.`{path}` t USING (SELECT k, v FROM slow_batch WHERE {slow}) s ON t.k = s.k " \
          "WHEN MATCHED THEN UPDATE SET t.v = t.v + s.v WHEN NOT MATCHED THEN INSERT *"
    failed: list[BaseException] = []

    def merge() -> None:
        try:
            with delta_merge._fenced(spark, (STATE_FENCE, 3), "{}"):
                spark.sql(sql)
        except Exception as exc:  # noqa: BLE001 - what the race raises is the point
            failed.append(exc)

    racer = threading.Thread(target=merge)
    racer.start()
    deadline = time.monotonic() + 120
    while not (gate / "reading").exists():
        assert racer.is_alive() and time.monotonic() < deadline, f"the MERGE never read its source: {failed}"
        time.sleep(0.05)
    write_deltalake(path, rows.schema.empty_table(), mode="append", commit_properties=fenced(2))
    (gate / "landed").touch()
    racer.join()
    assert failed and is_commit_conflict(failed[0]), failed
    assert "ConcurrentTransaction" in str(failed[0]) or "DELTA_CONCURRENT_TRANSACTION" in str(failed[0])
    assert DeltaTable(path).version() == 1, "the MERGE made no commit"
    with pytest.raises(type(failed[0])):  # the engine passes it on to step 4 as it came
        with _writing_state(load_spec(write_spec(tmp_path, oracle_spec_dict()))):
            raise failed[0]
    for key in (delta_merge.TXN_APP_ID, delta_merge.TXN_VERSION, delta_merge.USER_METADATA):
        assert spark.conf.get(key, None) is None, f"{key} left set on the session"
    # Skipped: the fence reads 2, a MERGE at 2 makes no commit.
    with delta_merge._fenced(spark, (STATE_FENCE, 2), "{}"):
        spark.sql(sql.replace(slow, "true"))
    assert DeltaTable(path).version() == 1


def test_the_session_of_a_one_batch_run_loads_delta_spark_only_for_a_batch_it_merges(tmp_path):
    """`SparkFactory.expect`: a big batch into a change-feed state merged
    on read (which delta-spark merges once its files carry vectors) gets a
    session with delta-spark; a small one (merged in the job's process), a
    state the executors' join merges, or one without a change feed does
    not pay its start."""
    from spark_jobs.engine import compute_factory
    from spark_jobs.sources.base import BatchRange

    class Manifest:
        def __init__(self, size):
            self.size = size

        def input_bytes(self):
            return self.size

    def wants(state_write, change_feed, size, vectors=True):
        base = oracle_spec_dict()
        spec = load_spec(write_spec(tmp_path, oracle_spec_dict(
            state={**base["state"], "change_feed": change_feed, "deletion_vectors": vectors}, engine={"state_write": state_write})))
        factory = compute_factory(spec, "local[1]")
        factory.expect(spec, BatchRange(None, None, Manifest(size)))
        return factory._delta

    assert wants("auto", True, 64 * 2**20)
    assert not wants("auto", True, 2**20)
    assert wants("executors", True, 10)
    assert not wants("executors", True, 64 * 2**20, vectors=False), "merged by the executors' join"
    assert not wants("executors", False, 64 * 2**20)
    assert not wants("driver", True, 64 * 2**20)


def test_a_commit_by_delta_spark_reads_as_the_job_s_own_and_a_user_s_as_theirs():
    """`with_user_metadata` reads the batch metadata delta-spark's
    `userMetadata` carries as delta-rs's commit info holds it, only when the
    commit's own `txn` moves the state fence to that metadata's position: a
    user's write whose text names `microbatch` stays an outside change
    (found by the review: a user's UPDATE with `{"microbatch": "hotfix"}`
    was taken for the job's and merged over)."""
    from spark_jobs.core.delta_io import with_user_metadata

    ours = json.dumps({"txn": 5, "pipeline": "p"})
    fenced = [{"txn": {"appId": STATE_FENCE, "version": 5}}]
    info = {"operation": "MERGE", "userMetadata": json.dumps({METADATA_KEY: ours})}
    assert with_user_metadata(info, fenced)[METADATA_KEY] == ours
    assert METADATA_KEY not in with_user_metadata(info, []), "no txn: a user's"
    assert METADATA_KEY not in with_user_metadata(info, [{"txn": {"appId": STATE_FENCE, "version": 6}}])
    for text in ('{"microbatch": "hotfix by ops"}', "{not json", "nightly load", '{"microbatch": "{}"}', "[1]"):
        assert METADATA_KEY not in with_user_metadata({"userMetadata": text}, fenced), text


# `mid_state_merge` stays in `make test` though its two runs start Spark
# with delta-spark's JARs (2.5 minutes): it alone kills a run amid
# delta-spark's files (test_crash_and_race.py's point of that name kills
# delta-rs's MERGE) and has a replay start its own engine for the batch it
# replays, delta-spark included. The other points in `make soak`.
@pytest.mark.parametrize(
    "point", ["mid_state_merge", pytest.param("after_plan", marks=pytest.mark.slow), pytest.param("after_state_commit", marks=pytest.mark.slow)]
)
def test_a_run_killed_amid_delta_spark_s_merge_or_after_its_commit_is_exact_after_a_rerun(tmp_path, compute, point):
    """SIGKILL of a run on its own Spark (its driver JVM, and the local
    executors writing, die with it) once delta-spark's MERGE has written its
    first data file, or once its commit landed, or after its plan: the next
    run (a replay, whose session also loads delta-spark) replays the batch
    or records the commit; the batch is delta-spark's commit, and the state
    is exact."""
    spec_path = _with_vectors(tmp_path, lambda path: _run(path, compute), users=100)
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
    merged_by = commit_info(spec.state_path, lineage[2].state_version).get("engineInfo", "")
    assert "Delta-Lake" in merged_by, f"batch 3 was merged by {merged_by or 'delta-rs'}"


def test_over_spark_connect_the_server_s_delta_spark_merges_the_batch(tmp_path, on_connect):
    """A run that is a thin client of a Connect server started with
    delta-spark (the project's, `tests.spark_servers`): the server's
    executors MERGE the batch into a state whose files carry vectors, with
    the fence and the metadata."""
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
    info = commit_info(spec.state_path, DeltaTable(spec.state_path).version())
    assert info["operation"] == "MERGE" and "Delta-Lake" in info.get("engineInfo", ""), info
