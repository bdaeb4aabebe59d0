"""Where the rows go (issue 47): the executors write a batch's updates, its
quarantined records, a merged state's merge and an appended state's fold as
data files; the job's process commits them and never holds a row.

Real Spark (the suite's session), real Delta tables in `tmp_path`, the real
protocol. "Never holds a row" is checked where rows could come back: every
`DataFrame.toArrow()` the job calls is counted, and a batch of thousands of
keys brings back one short row per file written.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.classic.dataframe import DataFrame  # what a classic session makes

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.folding import read_state, row_counts
from spark_jobs.core.maintain import maintain
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from tests.conftest import (
    assert_exact, assert_feed_is_the_change, assert_versions_carry_batches, feed_by_type, lose_the_race_to_the_join, oracle_spec_dict, write_spec,
)


@pytest.fixture
def arrow_rows(monkeypatch):
    """The rows each `toArrow()` of this process brought back, in order."""
    counts: list[int] = []
    real = DataFrame.toArrow

    def counted(self):
        table = real(self)
        counts.append(table.num_rows)
        return table

    monkeypatch.setattr(DataFrame, "toArrow", counted)
    return counts


def _spec(tmp_path, layout: str = "merged", state_write: str = "auto", **state):
    base = oracle_spec_dict()
    return write_spec(tmp_path, oracle_spec_dict(
        state={**base["state"], "layout": layout, **state},
        engine={"state_write": state_write},
        batch={"max_files": 1},
    ))


def _run(spec_path, compute) -> str:
    return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status


@pytest.mark.parametrize("layout", ["merged", "appended"])
def test_a_batch_s_rows_are_written_by_the_executors_and_only_file_names_come_back(tmp_path, compute, arrow_rows, layout):
    """3,000 users in a batch: what reaches the job's process is one row per
    file the tasks wrote (and the quarantine's files, the same way), never a
    user's row; the state is exact, and each ledger row names its commit."""
    spec_path = _spec(tmp_path, layout, state_write="executors")
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=6000, users=3000, bad_every=500)
    assert _run(spec_path, compute) == "committed"
    assert arrow_rows and max(arrow_rows) <= 8, f"rows brought back to the job's process: {arrow_rows}"
    write_wave(tmp_path / "landing", 1, files=1, records_per_file=6000, users=3000, bad_every=500)
    assert _run(spec_path, compute) == "committed"
    assert max(arrow_rows) <= 8, f"rows brought back to the job's process: {arrow_rows}"
    assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)
    spec = load_spec(spec_path)
    quarantined = read_all(open_table(spec.quarantine_path))
    assert quarantined.num_rows == 2 * (6000 // 500)
    assert set(quarantined.column("batch_id").to_pylist()) == {1, 2}
    assert all(uri.startswith("file:///") for uri in quarantined.column("file").to_pylist()), "named by their planned URIs"
    assert _untracked(spec.state_path) == set(), "a batch's files merged in are dropped, the others committed"


def _untracked(path: str) -> set[str]:
    """The Parquet files in a table's folder that no version of its log adds."""
    from pathlib import Path

    from spark_jobs.core.delta_io import version_actions

    added, version = set(), 0
    while (actions := version_actions(path, version)) is not None:
        added |= {a["add"]["path"] for a in actions if "add" in a}
        version += 1
    return {p.name for p in Path(path).glob("*.parquet")} - added


@pytest.mark.parametrize("way", ["join", "file by file"])
def test_a_merged_state_s_batch_is_merged_by_the_executors_as_a_merge_in_process_would(tmp_path, compute, monkeypatch, way):
    """The executors' copy-on-write merges (`state_write: executors`) against
    the MERGE in the job's process (`driver`), the same batches: every rule,
    keys coming back and new, nulls; the same state. A big batch is joined
    with the state's files (here every batch is made big); a small one is
    merged into each file where it stands."""
    import spark_jobs.core.state as state_module

    states = {}
    for setting in ("executors", "driver"):
        folder = tmp_path / setting
        spec_path = _spec(folder, state_write=setting)
        with monkeypatch.context() as patched:
            if way == "join":
                patched.setattr(state_module, "IN_PROCESS_ROWS", 0)
            for wave in range(3):
                write_wave(folder / "landing", wave, files=1, records_per_file=900, users=300 + 100 * wave, seed=7)
                assert _run(spec_path, compute) == "committed"
        assert_exact(spec_path)
        states[setting] = _by_key(load_spec(spec_path).state_path)
    assert states["executors"] == states["driver"]


def _by_key(path: str) -> dict:
    """A merged state's rows by key, each key once (a key written twice
    is a failure, not a row lost in a dict: found by a review)."""
    rows = read_all(open_table(path)).to_pylist()
    by_key = {r["user_id"]: r for r in rows}
    assert len(by_key) == len(rows), f"{len(rows) - len(by_key)} rows repeat a key"
    return by_key


def test_a_nested_min_or_max_is_merged_by_the_join_where_a_file_cannot_be(tmp_path, compute):
    """`min`/`max` of a STRUCT or an ARRAY (Spark orders them field by
    field; pyarrow has no such comparison): a small batch under
    `executors` is merged by the join, the same state as the MERGE here
    (before, every such batch failed in the tasks: found by a review)."""
    base = oracle_spec_dict()
    transform = ("SELECT user_id, count(*) AS events, min(named_struct('amount', amount, 'event', event_id)) AS lowest, "
                 "max(array(amount)) AS highest FROM batch WHERE user_id IS NOT NULL GROUP BY user_id")
    states = {}
    for setting in ("executors", "driver"):
        folder = tmp_path / setting
        spec_path = write_spec(folder, oracle_spec_dict(
            transform=transform,
            state={**base["state"], "merge": {"events": "sum", "lowest": "min", "highest": "max"}},
            engine={"state_write": setting},
        ))
        for wave in range(3):
            write_wave(folder / "landing", wave, files=1, records_per_file=300, users=60 + 20 * wave, seed=3)
            assert _run(spec_path, compute) == "committed"
        states[setting] = _by_key(load_spec(spec_path).state_path)
    assert states["executors"] == states["driver"] and len(states["driver"]) > 50


def test_a_small_batch_into_a_big_merged_state_has_the_executors_rewrite_its_files(tmp_path, compute, monkeypatch):
    """`state_write: auto`: a batch small enough to come back to the job's
    process, into a merged state whose files weigh more than
    `REWRITE_FROM_BYTES` (here, any), is staged as a file and merged into
    the state's files by the executors, file by file: no MERGE here, the
    same state as one, every version carrying its batch, and no file left
    behind that the log does not name (the staged batch is dropped)."""
    import spark_jobs.core.state as state_module

    from spark_jobs.core.delta_io import version_actions

    states = {}
    for rewrite in (True, False):
        folder = tmp_path / ("rewrite" if rewrite else "merge")
        spec_path = _spec(folder)
        with monkeypatch.context() as patched:
            if rewrite:
                patched.setattr(state_module, "REWRITE_FROM_BYTES", 0)
            for wave in range(3):
                write_wave(folder / "landing", wave, files=1, records_per_file=900, users=300 + 100 * wave, seed=7, bad_every=97)
                assert _run(spec_path, compute) == "committed"
        assert_exact(spec_path)
        assert_versions_carry_batches(spec_path)
        spec = load_spec(spec_path)
        operations = [
            next(a["commitInfo"].get("operation") for a in version_actions(spec.state_path, v) if "commitInfo" in a)
            for v in range(1, open_table(spec.state_path).version() + 1)
        ]
        # The first batch meets an empty state (no bytes to rewrite): a MERGE either way.
        assert ["MERGE" if op == "MERGE" else "files" for op in operations[1:]] == ["files" if rewrite else "MERGE"] * 2, operations
        assert _untracked(spec.state_path) == set()
        states[rewrite] = _by_key(spec.state_path)
    assert states[True] == states[False]


def test_a_fold_by_the_executors_keeps_every_value_and_every_kept_batch_rewinds(tmp_path, compute, arrow_rows):
    """`maintain` folds an appended state on the executors (`state_write:
    executors`): one row per key again, the same values, no row through the
    job's process, and a rewind to each batch before the fold still exact."""
    spec_path = _spec(tmp_path, "appended", state_write="executors", fold_at=10.0)
    for wave in range(3):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=600, users=200)
        assert _run(spec_path, compute) == "committed"
    spec = load_spec(spec_path)
    before = {r["user_id"]: r for b in read_state(spec) for r in b.to_pylist()}
    assert row_counts(open_table(spec.state_path)).appended > 0
    arrow_rows.clear()
    report = maintain(spec, compute_factory=compute)
    assert max(arrow_rows) <= 8, f"rows brought back to the job's process: {arrow_rows}"
    counts = row_counts(open_table(spec.state_path))
    assert counts.appended == 0 and counts.rows == len(before)
    assert {r["user_id"]: r for b in read_state(spec) for r in b.to_pylist()} == before
    assert report.kept_batches == [1, 2, 3]
    for batch in (2, 1):
        assert rewind(spec, batch, run_id=f"test-{batch}").status == "rewound"
        assert [r.batch_id for r in assert_exact(spec_path, drained=False)] == list(range(1, batch + 1))


@pytest.mark.parametrize("state_write", ["executors", "driver"])
def test_a_value_the_state_column_cannot_hold_fails_the_batch_by_name_before_any_commit(tmp_path, compute, state_write):
    """A batch whose values do not cast to the state's column type is a spec
    error the writing tasks find (or `align`, in the job's process): terminal,
    named the same either way, nothing committed; the spec fixed, the replay commits."""
    from spark_jobs.errors import TransformError, exit_code

    def spec(transform: str):
        return write_spec(tmp_path, {
            "name": "narrow",
            "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, n BIGINT"},
            "transform": transform,
            "state": {"path": "lake/state", "keys": ["k"], "merge": {"v": "last"}},
            "checkpoint": "lake/_checkpoints/narrow",
            "batch": {"max_files": 1},
            "engine": {"state_write": state_write},
        })

    spec_path = spec("SELECT k, CAST(max(n) AS DOUBLE) AS v FROM batch GROUP BY k")
    (tmp_path / "landing" / "a.json").write_text('{"k": "a", "n": 1}\n')
    assert _run(spec_path, compute) == "committed"
    (tmp_path / "landing" / "b.json").write_text('{"k": "a", "n": 2}\n')
    spec_path = spec("SELECT k, concat(CAST(max(n) AS STRING), 'x') AS v FROM batch GROUP BY k")
    version = open_table(load_spec(spec_path).state_path).version()
    with pytest.raises(TransformError, match="do not fit the state table's types.*cannot store column 'v' as double") as caught:
        _run(spec_path, compute)
    assert exit_code(caught.value) == 2
    assert open_table(load_spec(spec_path).state_path).version() == version
    spec_path = spec("SELECT k, CAST(max(n) AS DOUBLE) AS v FROM batch GROUP BY k")
    assert _run(spec_path, compute) == "committed"
    assert read_all(open_table(load_spec(spec_path).state_path)).to_pylist()[0]["v"] == 2.0


def test_a_result_too_big_to_come_back_fails_for_good_naming_the_setting_and_the_executors_write_it(tmp_path):
    """Issue 47: a batch whose result passed `spark.driver.maxResultSize`
    failed with exit 1, retried forever. Now exit 2 names
    `engine.state_write: executors`, and with it the same batch commits.
    (A 512 KB limit, from a spark-defaults.conf, stands for the 1 GB one;
    every task's own result carries some 10 KB of metrics besides.)"""
    import json as json_module

    from tests.conftest import run_cli

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text("spark.driver.maxResultSize 512k\n")
    env = {"SPARK_CONF_DIR": str(conf)}
    spec_path = _spec(tmp_path, state_write="driver")
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=30000, users=20000)
    refused = run_cli("run", str(spec_path), env=env)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "engine.state_write: executors" in refused.stderr
    assert "Total size of serialized results" in refused.stderr and "maxResultSize (512.0 KiB)" in refused.stderr
    spec_path = _spec(tmp_path, state_write="executors")
    done = run_cli("run", str(spec_path), "--json", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json_module.loads(done.stdout)["status"] == "committed"
    assert_exact(spec_path)


@pytest.mark.parametrize(
    ("sql", "proved"),
    [
        ("SELECT user_id, count(*) AS events FROM clicks GROUP BY user_id", True),
        ("SELECT u AS user_id, n AS events FROM (SELECT user_id AS u, count(*) AS n FROM clicks GROUP BY user_id) WHERE n > 0", True),
        ("SELECT DISTINCT user_id FROM clicks", True),
        ("SELECT user_id, 1L AS events FROM clicks", False),
        ("SELECT user_id, count(*) AS events FROM clicks GROUP BY user_id, amount", False),
        ("SELECT user_id, count(*) AS events FROM clicks GROUP BY user_id UNION ALL SELECT 'x', 1L", False),
        ("SELECT upper(user_id) AS user_id, count(*) AS events FROM clicks GROUP BY user_id", False),
    ],
)
def test_the_keys_are_proved_unique_only_by_a_plan_that_proves_it(spark, tmp_path, sql, proved):
    """`unique_keys` spares the written files the duplicate check only when
    Spark's optimizer proves each key once (a GROUP BY on the keys, a
    DISTINCT, through aliases and filters); an expression over a key, a
    second grouping column or a union proves nothing."""
    from spark_jobs.engine.spark_state import unique_keys

    spark.createDataFrame([("a", 1.0), ("a", 2.0), ("b", 1.0)], "user_id STRING, amount DOUBLE").createOrReplaceTempView("clicks")
    spec = load_spec(_spec(tmp_path))
    written = pa.schema([("user_id", pa.string()), ("events", pa.int64())])
    assert unique_keys(spark.sql(sql), spec, written) is proved


def test_keys_written_in_a_narrower_type_are_never_proved_unique(spark, tmp_path):
    """Found by a review: 0.1 and 0.10000000001 are two DOUBLE keys and one
    FLOAT; written into a state whose key is FLOAT they were one key twice,
    and the proof skipped the check. A key cast on its way into the files
    proves nothing: they are checked as written."""
    from spark_jobs.engine.spark_state import unique_keys

    spec = load_spec(_spec(tmp_path))
    grouped = spark.sql("SELECT user_id, count(*) AS events FROM VALUES (0.1D), (0.10000000001D) AS t(user_id) GROUP BY user_id")
    assert unique_keys(grouped, spec, pa.schema([("user_id", pa.float64()), ("events", pa.int64())]))
    assert not unique_keys(grouped, spec, pa.schema([("user_id", pa.float32()), ("events", pa.int64())]))


def test_a_result_with_a_key_twice_is_refused_when_the_executors_write_it(tmp_path, compute):
    """A transform with no GROUP BY proves nothing: the files are checked,
    and a key returned twice is refused with no state written."""
    from spark_jobs.core.delta_io import open_table
    from spark_jobs.errors import TransformError

    base = oracle_spec_dict()
    spec_path = write_spec(tmp_path, oracle_spec_dict(
        transform="SELECT user_id, 1L AS events, amount, 0L AS idhash, ts AS last_seen FROM batch",
        state={**base["state"]}, engine={"state_write": "executors"},
    ))
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=200, users=50)
    with pytest.raises(TransformError, match="one row per key"):
        _run(spec_path, compute)
    assert open_table(load_spec(spec_path).state_path) is None


@pytest.mark.parametrize("state_write", ["executors", "driver"])
def test_two_keys_that_are_one_in_the_state_s_type_are_refused(tmp_path, compute, state_write):
    """Found by a review, through the documented way forward: a FLOAT key
    column, then its source widened to DOUBLE. Batch 2's keys 0.1 and
    0.10000000001 are two DOUBLEs and one FLOAT: written into the state's
    FLOAT column they were one key twice, committed by either path. Now the
    batch is refused, and the state holds each key once."""
    import json

    from spark_jobs.core.delta_io import open_table
    from spark_jobs.errors import TransformError

    def spec(schema: str):
        return load_spec(write_spec(tmp_path, {
            "name": "floats", "source": {"type": "files", "path": "landing", "format": "json", "schema": schema},
            "transform": "SELECT k, count(*) AS events FROM batch GROUP BY k",
            "state": {"path": "lake/state", "keys": ["k"], "merge": {"events": "sum"}},
            "checkpoint": "lake/_checkpoints/floats", "engine": {"state_write": state_write},
        }))

    (tmp_path / "landing").mkdir()
    (tmp_path / "landing" / "a.json").write_text("".join(json.dumps({"k": k}) + "\n" for k in (1.5, 2.5)))
    assert run_batch(spec("k FLOAT"), RunOptions(run_id="b1"), compute_factory=compute).status == "committed"
    (tmp_path / "landing" / "b.json").write_text("".join(json.dumps({"k": k}) + "\n" for k in (0.1, 0.10000000001, 7.25)))
    with pytest.raises(TransformError, match="more than once"):
        run_batch(spec("k DOUBLE"), RunOptions(run_id="b2"), compute_factory=compute)
    keys = open_table(str(tmp_path / "lake" / "state")).to_pyarrow_table(columns=["k"]).column("k").to_pylist()
    assert sorted(keys) == [1.5, 2.5]


def test_a_change_feed_state_is_merged_by_the_executors_join_with_its_changes_through_a_race(tmp_path, compute, arrow_rows, spark):
    """A merged state with `change_feed` on a local disk, big batches
    (`state_write: executors`): the executors' join writes the change data
    with the merged rows and the job commits the entry (at the checked
    version + 1, hard-linked into place), no row coming back. The state is
    exact; each batch's feed is each returning key's old and new row and each
    new key's row, as delta-rs and delta-spark read it; a tool's commit landing
    between the join's files and the commit loses that attempt, whose files
    are deleted, and the batch merges again from the new snapshot."""
    import json

    from deltalake import DeltaTable

    from spark_jobs.core import faults
    from spark_jobs.core.delta_io import commit_info
    from spark_jobs.core.fencing import STATE_FENCE, Position

    spec_path = _spec(tmp_path, state_write="executors", change_feed=True)
    spec = load_spec(spec_path)
    change_data = tmp_path / "lake" / "state" / "_change_data"
    raced: list[str] = []
    written_before: set = set()

    def race(point: str) -> None:
        # Once the join has written its change data (the commit not made): a
        # tool's property change, a commit of no fence, takes the version the batch wanted.
        if point == "mid_state_merge" and not raced and set(change_data.glob("*")) - written_before:
            raced.append(point)
            DeltaTable(spec.state_path).alter.set_table_properties({"delta.logRetentionDuration": "interval 31 days"})

    write_wave(tmp_path / "landing", 0, files=1, records_per_file=600, users=200)
    assert _run(spec_path, compute) == "committed"
    for wave in (1, 2):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=600, users=300)
        before = _by_key(spec.state_path)
        written_before = set(change_data.glob("*"))
        faults.set_hook(race if wave == 2 else None)
        try:
            assert _run(spec_path, compute) == "committed"
        finally:
            faults.set_hook(None)
        table = open_table(spec.state_path)
        info = commit_info(spec.state_path, table.version())
        assert info["operation"] == "MERGE" and info["operationParameters"]["mode"] == "executors' join", info
        assert json.loads(info["microbatch"])["txn"] == Position(0, wave + 1).encode()
        assert table.transaction_version(STATE_FENCE) == Position(0, wave + 1).encode()
        feed = assert_feed_is_the_change(table, before, _by_key(spec.state_path))
        assert feed.get("insert"), "new users came"
        # delta-spark reads the same feed from the job's entry.
        kinds = {r["_change_type"]: r["count"] for r in spark.read.format("delta").option("readChangeFeed", "true")
                 .option("startingVersion", table.version()).load(spec.state_path).groupBy("_change_type").count().collect()}
        assert kinds == {t: len(rows) for t, rows in feed.items()}, kinds
    assert raced, "the race ran"
    assert max(arrow_rows) <= 8, f"rows brought back to the job's process: {arrow_rows}"
    history = [commit_info(spec.state_path, v)["operation"] for v in range(open_table(spec.state_path).version() + 1)]
    assert history[-2:] == ["SET TBLPROPERTIES", "MERGE"], history
    assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)
    named = set()
    for entry in (tmp_path / "lake" / "state" / "_delta_log").glob("*.json"):
        named |= {json.loads(line)["cdc"]["path"] for line in entry.read_text().splitlines() if '"cdc"' in line}
    assert {f"_change_data/{p.name}" for p in change_data.glob("*.parquet")} == named, "the lost attempt's change data was deleted"


def test_a_run_that_lost_the_race_to_the_join_s_commit_is_a_no_op(tmp_path, compute, monkeypatch):
    """Another run commits batch 2 after this run's join wrote its files and
    before its commit: the commit at the checked version + 1 fails, step 4
    finds the winner's batch (the fence at 2) and the run ends as one that
    lost the race does; its files are deleted, nothing is merged twice."""
    spec_path = _spec(tmp_path, state_write="executors", change_feed=True)
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=600, users=200)
    assert _run(spec_path, compute) == "committed"
    write_wave(tmp_path / "landing", 1, files=1, records_per_file=600, users=200)
    joined = lose_the_race_to_the_join(monkeypatch, spec_path, lambda: _run(spec_path, compute))
    assert any(p.startswith("_change_data/") for p in joined)


def test_a_small_batch_into_a_big_change_feed_state_is_merged_by_the_join_with_the_changes_delta_rs_writes(tmp_path, compute, monkeypatch):
    """`state_write: auto`: a small batch into a change-feed state whose
    files weigh more than `REWRITE_FROM_BYTES` (here, any) is staged and
    merged by the executors' join, which writes the change data (delta-rs's
    MERGE in the job's process would hold every file it rewrites): the same
    state and the same change feed, version by version, as delta-rs's."""
    import spark_jobs.core.state as state_module

    from spark_jobs.core.delta_io import commit_info

    found = {}
    for joined in (True, False):
        folder = tmp_path / ("join" if joined else "delta-rs")
        spec_path = _spec(folder, change_feed=True)
        with monkeypatch.context() as patched:
            if joined:
                patched.setattr(state_module, "REWRITE_FROM_BYTES", 0)
            for wave in range(3):
                write_wave(folder / "landing", wave, files=1, records_per_file=900, users=300 + 100 * wave, seed=7)
                assert _run(spec_path, compute) == "committed"
        assert_exact(spec_path)
        spec = load_spec(spec_path)
        table = open_table(spec.state_path)
        modes = [commit_info(spec.state_path, v).get("operationParameters", {}).get("mode") for v in range(table.version() - 1, table.version() + 1)]
        assert (modes == ["executors' join"] * 2) == joined, modes
        feeds = [feed_by_type(table, v) for v in range(table.version() - 1, table.version() + 1)]
        assert all(feed.get("update_preimage") and feed.get("insert") for feed in feeds), "users came back, and new ones"
        found[joined] = (_by_key(spec.state_path), feeds)
    assert found[True] == found[False]


def test_state_columns_named_like_the_join_s_working_columns_are_merged_as_any_other(tmp_path, compute):
    """A change-feed state may have columns of any name: ones named like the
    join's working columns (`__change`, `__before_<column>`; found by a
    review: Spark refused the query as ambiguous, and every retry failed)
    are merged by the executors' join as delta-rs merges them in the job's
    process: the same state, the same change feed."""
    from tests.conftest import ORACLE_TRANSFORM

    transform = ORACLE_TRANSFORM.replace("count(*) AS events", "count(*) AS events, count(*) AS `__change`, sum(amount) AS `__before_amount`")
    assert transform != ORACLE_TRANSFORM
    found = {}
    for setting in ("executors", "driver"):
        folder = tmp_path / setting
        base = oracle_spec_dict()
        spec_path = write_spec(folder, oracle_spec_dict(
            transform=transform,
            state={**base["state"], "change_feed": True, "merge": {**base["state"]["merge"], "__change": "sum", "__before_amount": "sum"}},
            engine={"state_write": setting},
            batch={"max_files": 1},
        ))
        for wave in range(3):
            write_wave(folder / "landing", wave, files=1, records_per_file=600, users=150 + 50 * wave, seed=wave)
            assert _run(spec_path, compute) == "committed"
        spec = load_spec(spec_path)
        table = open_table(spec.state_path)
        if setting == "executors":
            from spark_jobs.core.delta_io import commit_info

            assert commit_info(spec.state_path, table.version())["operationParameters"]["mode"] == "executors' join"
        state = _by_key(spec.state_path)
        assert all(r["__change"] == r["events"] for r in state.values())
        found[setting] = (state, [feed_by_type(table, v) for v in range(table.version() - 1, table.version() + 1)])
    assert found["executors"] == found["driver"]
