"""The two readers of a Delta source's batch (`engine/delta_read.py`): the
driver's (delta-rs) and Spark's (delta-spark on the executors) give the same
rows for every range of versions a batch can plan, on real tables written by
delta-rs and by delta-spark in `tmp_path`, with the suite's Spark session
(delta-spark loaded)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from spark_jobs.engine import delta_read
from spark_jobs.engine.delta_read import _may_cancel, net_changes, read_versions, spark_net_changes, spark_versions
from spark_jobs.sources.delta import DeltaManifest
from tests.spark_jobs.sources.test_delta import netting_rows

SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64())])


def _rows(rows: list[dict]) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True, default=str) for r in rows)


def _both(spark, uri: str, read: str, first: int, last: int) -> tuple[list[str], list[str]]:
    manifest = DeltaManifest(uri, read, first, last)
    return _rows(read_versions(manifest).to_pylist()), _rows(spark_versions(spark, manifest).toArrow().to_pylist())


def test_both_readers_give_the_same_changes_across_each_kind_of_version(tmp_path, spark):
    """A delta-rs upstream with the versions a chained pipeline meets: appends,
    a MERGE's updates and inserts, an update that changed nothing, a
    DELETE, and a RESTORE (a rewind), whose rows removed and added back
    unchanged net out in both readers, and whose commit time is the one its
    log entry records in both."""
    uri = str(tmp_path / "up")
    DeltaTable.create(uri, SCHEMA, configuration={"delta.enableChangeDataFeed": "true"})
    write_deltalake(uri, pa.table({"k": ["a", "b", "c"], "v": [1, 2, None]}, schema=SCHEMA), mode="append")  # v1
    write_deltalake(uri, pa.table({"k": ["d"], "v": [4]}, schema=SCHEMA), mode="append")  # v2
    DeltaTable(uri).merge(
        pa.table({"k": ["a", "e"], "v": [10, 5]}, schema=SCHEMA), "t.k = s.k", source_alias="s", target_alias="t"
    ).when_matched_update_all().when_not_matched_insert_all().execute()  # v3
    DeltaTable(uri).merge(
        pa.table({"k": ["b"], "v": [2]}, schema=SCHEMA), "t.k = s.k", source_alias="s", target_alias="t"
    ).when_matched_update_all().execute()  # v4: b = 2 again, no change
    DeltaTable(uri).delete("k = 'd'")  # v5
    DeltaTable(uri).restore(2)  # v6: back to a=1, b=2, c=null, d=4
    write_deltalake(uri, pa.table({"k": ["f"], "v": [6]}, schema=SCHEMA), mode="append")  # v7
    last = DeltaTable(uri).version()
    # Each version alone, and ranges across the MERGEs, the DELETE and the RESTORE.
    for first, end in [*[(v, v) for v in range(last + 1)], (0, last), (1, 4), (2, 6), (3, 7), (5, 6)]:
        by_driver, by_spark = _both(spark, uri, "changes", first, end)
        assert by_spark == by_driver, f"versions {first}..{end}"
    restore = [json.loads(r) for r in _both(spark, uri, "changes", 6, 6)[1]]
    assert sorted((r["k"], r["v"], r["_change_type"]) for r in restore) == [
        ("a", 1, "insert"), ("a", 10, "delete"), ("d", 4, "insert"), ("e", 5, "delete"),
    ]


def test_spark_netting_pairs_the_same_rows_as_the_drivers(spark):
    """`spark_net_changes` against `net_changes` on the rows their test is
    made of: nulls and NaN equal themselves, another version's row or the
    same change twice stays, a nested table passes as it is."""
    rows = netting_rows((3, 4, 3, 3, 3, 3, 3, 3))
    stamp = rows.column("_commit_timestamp")
    by_spark = spark_net_changes(spark.createDataFrame(rows)).toArrow()
    assert _rows(by_spark.to_pylist()) == _rows(net_changes(rows).to_pylist())
    assert by_spark.num_rows == 6, "a's pair spans two versions; b's cancels"
    nested = pa.table({"k": ["a", "a"], "l": [[1], [1]], "_change_type": ["delete", "insert"],
                       "_commit_version": [1, 1], "_commit_timestamp": stamp.slice(0, 2)})
    assert spark_net_changes(spark.createDataFrame(nested)).count() == 2


def test_a_version_may_cancel_if_its_entry_has_change_files_or_removes_and_adds_files():
    """`_may_cancel` on log entries as writers make them: a change file's
    action says `dataChange: false` always (a review found the rule read it
    as no change), a compaction's files change no data."""
    cdc, add, remove = {"cdc": {"size": 9, "dataChange": False}}, {"add": {"dataChange": True}}, {"remove": {"dataChange": True}}
    compaction = [{"add": {"dataChange": False}}, {"remove": {"dataChange": False}}]
    assert [_may_cancel(e) for e in ([cdc, add], [cdc], [add, remove], [add], [remove], compaction, None)] == [
        True, True, True, False, False, False, True,
    ]


def test_both_readers_net_only_where_a_version_may_cancel(tmp_path, spark, monkeypatch):
    """Versions that only add files (appends, a first batch of new keys)
    read as inserts alone: Spark's read of them has no windows to net them
    (a shuffle and two sorts of every row), and a MERGE's (its change files)
    or a RESTORE's (files removed and added) has them; a range of both, each
    run of versions read on its own. The rows are the driver's either way."""
    uri = str(tmp_path / "up")
    DeltaTable.create(uri, SCHEMA, configuration={"delta.enableChangeDataFeed": "true"})
    write_deltalake(uri, pa.table({"k": ["a", "b"], "v": [1, 2]}, schema=SCHEMA), mode="append")  # v1
    write_deltalake(uri, pa.table({"k": ["c"], "v": [3]}, schema=SCHEMA), mode="append")  # v2
    DeltaTable(uri).merge(
        pa.table({"k": ["a"], "v": [10]}, schema=SCHEMA), "t.k = s.k", source_alias="s", target_alias="t"
    ).when_matched_update_all().execute()  # v3: change files
    DeltaTable(uri).restore(2)  # v4: files removed and added, no change files

    def netted(first: int, last: int) -> bool:
        plan = spark_versions(spark, DeltaManifest(uri, "changes", first, last))._jdf.queryExecution().optimizedPlan().toString()
        return "Window" in plan

    assert [netted(1, 1), netted(1, 2), netted(2, 3), netted(4, 4)] == [False, False, True, True]
    # A range of both is read as its runs: only the MERGE's and the RESTORE's rows netted.
    plan = spark_versions(spark, DeltaManifest(uri, "changes", 0, 4))._jdf.queryExecution().optimizedPlan().toString()
    assert plan.count("Union") == 1 and plan.count("Window [") == 2, plan
    for first, last in [(1, 2), (0, 4), (4, 4), (1, 3), (2, 4)]:
        by_driver, by_spark = _both(spark, uri, "changes", first, last)
        assert by_spark == by_driver, f"versions {first}..{last}"
    # The driver builds a text key a row to net: not for a range of appends.
    netted_by_driver = []
    monkeypatch.setattr(delta_read, "net_changes", lambda rows: netted_by_driver.append(rows.num_rows) or net_changes(rows))
    for first, last in [(1, 2), (1, 3)]:
        read_versions(DeltaManifest(uri, "changes", first, last))
    assert netted_by_driver == [5]  # (1..3: two inserts, one insert, an update's two images)


@pytest.fixture
def appended(tmp_path, spark) -> str:
    """A delta-spark table, partitioned by values that need escaping (a
    space, '/', ':', '%', '+', null), with an OPTIMIZE that folds earlier
    versions' files into new ones, and a column added along the way."""
    uri = str(tmp_path / "appends up")
    spark.sql(f"CREATE TABLE delta.`{uri}` (k STRING, v BIGINT, p STRING) USING delta PARTITIONED BY (p)")
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('a', 1, 'x y'), ('b', 2, 'é/:%')")  # v1
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('c', 3, 'x y'), ('d', 4, NULL)")  # v2
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('e', 5, 'a+b'), ('f', 6, 'x y')")  # v3
    spark.sql(f"OPTIMIZE delta.`{uri}`")  # v4: files of v1..v3 rewritten, no data changed
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('g', 7, 'x y')")  # v5
    spark.sql(f"ALTER TABLE delta.`{uri}` ADD COLUMNS (w DOUBLE)")  # v6
    spark.sql(f"INSERT INTO delta.`{uri}` VALUES ('h', 8, 'a+b', 0.5), ('i', 9, NULL, NULL)")  # v7
    assert DeltaTable(uri).history(4)[-1]["operation"] == "OPTIMIZE"
    return uri


def test_both_readers_give_the_same_appends_across_an_optimize_and_an_added_column(spark, appended):
    last = DeltaTable(appended).version()
    # Ranges that end at, start at or span the OPTIMIZE (v4) and the added
    # column (v6); `make soak` adds each version alone and two more spans.
    read = {}
    for first, end in [(0, last), (1, 4), (4, 5), (3, 7)]:
        by_driver, by_spark = read[first, end] = _both(spark, appended, "appends", first, end)
        assert by_spark == by_driver, f"versions {first}..{end}"
    everything = [json.loads(r) for r in read[0, last][1]]
    assert sorted(r["k"] for r in everything) == list("abcdefghi"), "each appended row once, none the OPTIMIZE wrote"
    assert {r["k"]: r["w"] for r in everything}["h"] == 0.5 and {r["k"]: r["p"] for r in everything}["d"] is None


@pytest.mark.slow  # the ranges above cross every kind of version; here each version alone, and two more spans
def test_both_readers_give_the_same_appends_for_each_version_alone(spark, appended):
    for first, end in [*[(v, v) for v in range(DeltaTable(appended).version() + 1)], (2, 5), (5, 7)]:
        by_driver, by_spark = _both(spark, appended, "appends", first, end)
        assert by_spark == by_driver, f"versions {first}..{end}"
