"""delta-spark and this project's tables (issue 34): what delta-rs writes,
delta-spark reads as the same rows, and what delta-spark writes with its
own table features is accepted as a source or refused by name.

Real Spark with the delta-spark JARs that set-up fetched (`jars/spark`),
real tables in `tmp_path`; nothing is mocked."""

from __future__ import annotations

import json

import pytest
from deltalake import DeltaTable

from spark_jobs.core.delta_io import read_all, rows_of
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import SourceRefusedError, TransformError, exit_code
from spark_jobs.storage.s3 import delta_storage_options, spark_read_options
from tests.conftest import chain_specs, oracle_spec_dict, run_cli, write_spec


def _rows(table) -> list[str]:
    """Rows as sorted JSON text: an order-free, type-stable comparison."""
    return sorted(json.dumps(r, sort_keys=True, default=str) for r in rows_of(table))


def _by_spark(spark, path: str) -> list[str]:
    return _rows(spark.read.format("delta").load(path).toArrow())


def _by_delta_rs(path: str) -> list[str]:
    return _rows(read_all(DeltaTable(path, storage_options=delta_storage_options(path))))


def test_every_table_this_project_writes_reads_the_same_in_delta_spark(tmp_path, spark, compute):
    spec_path = write_spec(tmp_path, oracle_spec_dict())
    spec = load_spec(spec_path)
    landing = tmp_path / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=2, records_per_file=200, users=40, bad_every=37)
        assert run_batch(spec, RunOptions(run_id=f"r{wave}"), compute_factory=compute).status == "committed"
    tables = {
        "state": spec.state_path,
        "ledger": spec.ledger_path,
        "quarantine": spec.quarantine_path,
        "consumed": spec.consumed_path,
    }
    for name, path in tables.items():
        by_rs = _by_delta_rs(path)
        assert by_rs, f"{name}: the run wrote rows"
        assert _by_spark(spark, path) == by_rs, f"{name} ({path}) reads differently in delta-spark"


def test_the_tables_on_s3_read_the_same_in_delta_spark_through_s3_locations(tmp_path, bucket, spark, compute):
    """`s3://` as the spec names it, through hadoop-aws from the same JAR set,
    with the endpoint and credentials of the AWS chain the job uses (moto)."""
    spec_path = write_spec(tmp_path, oracle_spec_dict(
        state={**oracle_spec_dict()["state"], "path": f"s3://{bucket}/lake/state"},
        checkpoint=f"s3://{bucket}/lake/_checkpoints/clicks",
    ))
    spec = load_spec(spec_path)
    write_wave(tmp_path / "landing", 0, files=2, records_per_file=100, users=20)
    assert run_batch(spec, RunOptions(run_id="r0"), compute_factory=compute).status == "committed"
    # The suite's session may predate the moto server (session fixtures):
    # Hadoop settings given at run time reach Delta's reads all the same.
    for key, value in spark_read_options().items():
        spark.conf.set(key.removeprefix("spark.hadoop."), value)
    for path in (spec.state_path, spec.ledger_path):
        assert path.startswith("s3://")
        by_rs = _by_delta_rs(path)
        assert by_rs and _by_spark(spark, path) == by_rs, f"{path} reads differently in delta-spark"


def test_a_state_is_read_by_delta_spark_as_of_each_committed_batch(tmp_path, spark, compute):
    upstream, _ = chain_specs(tmp_path)
    spec = load_spec(upstream)
    for wave in range(3):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=100, users=20)
        assert run_batch(spec, RunOptions(run_id=f"r{wave}"), compute_factory=compute).status == "committed"
    table = DeltaTable(spec.state_path)
    for version in range(table.version() + 1):
        as_of = spark.read.format("delta").option("versionAsOf", version).load(spec.state_path).toArrow()
        table.load_as_version(version)
        assert _rows(as_of) == _rows(read_all(table)), f"state version {version}"
    changes = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 1).load(spec.state_path)
    assert changes.count() > 0, "the change feed chained pipelines read is readable by delta-spark too"


_FOLLOW = """
SELECT k, sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN v
                   WHEN _change_type IN ('delete', 'update_preimage') THEN -v ELSE 0 END) AS v
FROM batch GROUP BY k
"""


def _downstream(folder, upstream: str, read: str, reader: str = "driver", column: str = "v"):
    """A pipeline summing `column` of the upstream by `k` into its state's `v`."""
    transform = (_FOLLOW if read == "changes" else "SELECT k, sum(v) AS v FROM batch GROUP BY k").replace("v", column)
    name = f"follow_{read}_{reader}"
    spec = {
        "name": name,
        "source": {"type": "delta", "path": upstream, "read": read, "reader": reader},
        "transform": transform.replace(f"AS {column}", "AS v"),
        "state": {"path": f"lake/{name}", "keys": ["k"], "merge": {"v": "sum"}},
        "checkpoint": f"lake/_checkpoints/{name}",
    }
    return load_spec(write_spec(folder, spec, f"{name}.yaml"))


def _drain(spec, compute) -> dict:
    """Run `spec` until nothing is new; its state as {k: v}, zeros left out."""
    while run_batch(spec, RunOptions(run_id="r"), compute_factory=compute).status == "committed":
        pass
    return {r["k"]: r["v"] for r in rows_of(read_all(DeltaTable(spec.state_path))) if r["v"] != 0}


def _upstream(spark, path, properties: dict[str, str]) -> str:
    props = ", ".join(f"'{k}' = '{v}'" for k, v in {"delta.enableChangeDataFeed": "true", **properties}.items())
    spark.sql(f"CREATE TABLE delta.`{path}` (k STRING, v BIGINT) USING delta TBLPROPERTIES ({props})")
    return str(path)


@pytest.mark.parametrize("reader", ["driver", "spark"])
def test_a_source_with_deletion_vectors_written_by_delta_spark_is_followed_exactly(tmp_path, spark, compute, reader):
    up = _upstream(spark, tmp_path / "up", {"delta.enableDeletionVectors": "true"})
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', 1), ('b', 2), ('c', 3), ('d', 4)")
    spark.sql(f"DELETE FROM delta.`{up}` WHERE k = 'b'")  # a deletion vector, not a rewrite
    spark.sql(f"UPDATE delta.`{up}` SET v = 30 WHERE k = 'c'")
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('e', 5)")
    assert "deletionVectors" in (DeltaTable(up).protocol().reader_features or [])
    followed = _drain(_downstream(tmp_path, up, "changes", reader), compute)
    upstream_now = {r["k"]: r["v"] for r in rows_of(spark.read.format("delta").load(up).toArrow())}
    assert followed == upstream_now == {"a": 1, "c": 30, "d": 4, "e": 5}
    appends = _downstream(tmp_path, up, "appends", reader)
    with pytest.raises(SourceRefusedError, match=r"version 2 \(DELETE\) removed or rewrote rows"):
        run_batch(appends, RunOptions(run_id="r"), compute_factory=compute)
    assert not DeltaTable.is_deltatable(appends.state_path)


@pytest.mark.parametrize("read", ["changes", "appends"])
def test_a_source_with_column_mapping_is_refused_to_the_driver_reader_by_name_before_any_write(tmp_path, spark, compute, read):
    up = _upstream(spark, tmp_path / "up", {"delta.columnMapping.mode": "name"})
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', 1)")
    spark.sql(f"ALTER TABLE delta.`{up}` RENAME COLUMN v TO w")
    follow = _downstream(tmp_path, up, read)
    with pytest.raises(SourceRefusedError, match=r"column mapping \(delta.columnMapping.mode = name\)") as caught:
        run_batch(follow, RunOptions(run_id="r"), compute_factory=compute)
    assert exit_code(caught.value) == 2
    assert not DeltaTable.is_deltatable(follow.state_path) and not DeltaTable.is_deltatable(follow.ledger_path)


def test_a_source_with_column_mapping_is_read_by_spark_across_a_rename(tmp_path, spark, compute):
    """delta-spark reads what delta-rs cannot: files that name their columns
    by physical name. Appends come with the names the table has now. A
    change feed cannot be read across a rename, so a batch ends before it and
    the next comes with the new names: a transform on the old name fails
    (exit 2, nothing committed) until the spec follows the rename."""
    up = _upstream(spark, tmp_path / "up", {"delta.columnMapping.mode": "name"})
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', 1), ('b', 2)")
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('c', 3)")
    spark.sql(f"ALTER TABLE delta.`{up}` RENAME COLUMN v TO w")  # version 3
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', 10)")
    assert _drain(_downstream(tmp_path, up, "appends", "spark", column="w"), compute) == {"a": 11, "b": 2, "c": 3}
    before = _downstream(tmp_path, up, "changes", "spark", column="v")
    assert run_batch(before, RunOptions(run_id="r"), compute_factory=compute).status == "committed"
    # The first batch ended before the rename (versions 0..2), else Delta would have refused it.
    assert {r["k"]: r["v"] for r in rows_of(read_all(DeltaTable(before.state_path)))} == {"a": 1, "b": 2, "c": 3}
    with pytest.raises(TransformError, match="v") as caught:
        run_batch(before, RunOptions(run_id="r"), compute_factory=compute)
    assert exit_code(caught.value) == 2
    after = _downstream(tmp_path, up, "changes", "spark", column="w")
    assert _drain(after, compute) == {"a": 11, "b": 2, "c": 3}


@pytest.mark.parametrize(("added", "kept"), [("STRING", False), ("STRUCT<x: INT>", True)])
def test_a_column_mapped_feed_with_a_column_added_is_read_as_one_read_reads_it(tmp_path, spark, monkeypatch, added, kept):
    """A change feed's range is read as runs of versions to net and not
    (`delta_read._runs`), unless the runs would come with other columns:
    with column mapping delta-spark reads a range with its last version's,
    so a run before a column was added lacks it, and a nested column turns
    the netting off for the range it is in. Such a range is one read, as
    before: an update that changed nothing cancels in it, or stays when a
    nested column is added later in the range (found by a review: as runs,
    it was netted away)."""
    from spark_jobs.engine import delta_read
    from spark_jobs.sources.delta import DeltaManifest

    up = _upstream(spark, tmp_path / "up", {"delta.columnMapping.mode": "name"})
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', 1), ('b', 2)")  # v1: appends, not netted alone
    spark.sql(f"UPDATE delta.`{up}` SET v = v WHERE k = 'a'")  # v2: change files, an update that changed nothing
    spark.sql(f"ALTER TABLE delta.`{up}` ADD COLUMNS (z {added})")  # v3
    spark.sql(f"INSERT INTO delta.`{up}` (k, v) VALUES ('c', 3)")  # v4
    manifest = DeltaManifest(up, "changes", 1, 4)

    def read() -> tuple[list[str], list[str]]:
        frame = delta_read.spark_versions(spark, manifest)
        rows = sorted(json.dumps(r, sort_keys=True, default=str) for r in frame.toArrow().to_pylist())
        return frame.columns, rows

    as_runs = read()
    monkeypatch.setattr(delta_read, "MAX_FEED_READS", 0)  # (more runs than that: one read)
    assert as_runs == read()
    columns, rows = as_runs
    assert columns[:4] == ["k", "v", "z", "_change_type"]
    changes = sorted((r["k"], r["v"], r["_change_type"]) for r in map(json.loads, rows))
    unchanged = [("a", 1, "update_postimage"), ("a", 1, "update_preimage")] if kept else []
    assert changes == sorted([("a", 1, "insert"), ("b", 2, "insert"), ("c", 3, "insert"), *unchanged])


def test_spark_reader_without_delta_spark_in_the_session_is_refused_by_name(tmp_path, spark):
    """A run whose session lacks delta-spark (no JARs: MICROBATCH_SPARK_JARS=none)
    stops with exit 2, naming the setting and what to do, and commits nothing."""
    up = _upstream(spark, tmp_path / "up", {})
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', 1)")
    follow = _downstream(tmp_path, up, "appends", "spark")
    result = run_cli("run", follow.spec_path, env={"MICROBATCH_SPARK_JARS": "none"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "`source.reader: spark`" in result.stderr and "make jars" in result.stderr, result.stderr[-2000:]
    assert not DeltaTable.is_deltatable(follow.state_path)


def _fenced_merge(spark, path: str, version: int, keys) -> list:
    """A MERGE under Delta's idempotent-DML fence (app id `app`, `version`),
    with its batch number as the commit's user metadata."""
    settings = {
        "spark.databricks.delta.write.txnAppId": "app",
        "spark.databricks.delta.write.txnVersion": str(version),
        "spark.databricks.delta.commitInfo.userMetadata": json.dumps({"batch": version}),
    }
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        spark.createDataFrame([(f"k{i}", 1) for i in keys], "k STRING, d BIGINT").createOrReplaceTempView("fenced_batch")
        return spark.sql(
            f"MERGE INTO delta.`{path}` t USING fenced_batch s ON t.k = s.k "
            "WHEN MATCHED THEN UPDATE SET v = t.v + s.d WHEN NOT MATCHED THEN INSERT (k, v) VALUES (s.k, s.d)"
        ).collect()
    finally:
        for key in settings:
            spark.conf.unset(key)


# In `make soak`: what a design of issue 64 weighed (deletion vectors,
# RESTORE), not a path of the job: its big batches are merged by the
# executors' join (engine/test_merge_over_vectors.py), never by delta-spark.
@pytest.mark.slow
def test_delta_spark_fenced_merges_with_deletion_vectors_and_what_restore_does_to_the_fence(tmp_path, spark):
    """What docs/state-at-scale.md relies on, pinned (issue 35): a MERGE with
    deletion vectors copies no rows; a repeated fence version is skipped
    without a commit; delta-rs reads the fence, the rows, the change feed and
    the user metadata; and RESTORE leaves the fence at its newest version, so
    a replay of a rewound batch under the same app id is silently skipped."""
    path = str(tmp_path / "state")
    spark.sql(f"CREATE TABLE delta.`{path}` (k STRING, v BIGINT) USING delta TBLPROPERTIES "
              "('delta.enableDeletionVectors'='true', 'delta.enableChangeDataFeed'='true')")
    spark.range(0, 20000).selectExpr("concat('k', id) AS k", "id AS v").repartition(4).write.format("delta").mode("append").save(path)

    assert _fenced_merge(spark, path, 1, range(0, 20000, 200))[0]["num_updated_rows"] == 100
    metrics = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()[0]["operationMetrics"]
    assert int(metrics["numTargetDeletionVectorsAdded"]) > 0 and metrics["numTargetRowsCopied"] == "0"
    table = DeltaTable(path)
    assert (table.version(), table.transaction_version("app")) == (2, 1)

    assert _fenced_merge(spark, path, 1, range(0, 20000, 200)) == [], "a repeated fence version is skipped"
    assert DeltaTable(path).version() == 2, "without a commit"
    _fenced_merge(spark, path, 2, range(1, 20000, 200))
    spark.sql(f"RESTORE TABLE delta.`{path}` TO VERSION AS OF 2")
    restored = DeltaTable(path)
    assert restored.transaction_version("app") == 2, "RESTORE keeps the newest fence"
    assert _fenced_merge(spark, path, 2, range(1, 20000, 200)) == [], "so the rewound batch's replay is skipped"

    expected = sum(range(20000)) + 100
    assert spark.read.format("delta").load(path).selectExpr("sum(v)").collect()[0][0] == expected
    assert _rows(read_all(DeltaTable(path))) == _by_spark(spark, path), "delta-rs reads a state with deletion vectors"
    changes = DeltaTable(path).load_cdf(starting_version=2, ending_version=2).read_all()
    assert changes.num_rows == 200 and set(changes.column("_change_type").to_pylist()) == {"update_preimage", "update_postimage"}
    assert '{"batch": 1}' in [h.get("userMetadata") for h in DeltaTable(path).history()]


_WITHOUT_DELTA_SPARK = """
import sys
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.engine.session import default_session
from spark_jobs.engine.spark_compute import SparkCompute
from spark_jobs.errors import MicrobatchError

if sys.argv[2] == "no-delta":
    session = default_session("local[1]", delta=False)
else:  # spark-submit given Delta's `--conf`s but not its `--jars`
    from pyspark.sql import SparkSession
    from spark_jobs.engine.session import DELTA_SQL

    session = SparkSession.builder.master("local[1]").config(map=DELTA_SQL).getOrCreate()
try:
    run_batch(load_spec(sys.argv[1]), RunOptions(run_id="no-jars"), compute_factory=lambda: SparkCompute(session=session))
except MicrobatchError as exc:
    print(type(exc).__name__, exc)
"""


# A catalog set without the JARs in `make soak`: the same refusal, reached another way.
@pytest.mark.parametrize("session", ["no-delta", pytest.param("catalog-without-jars", marks=pytest.mark.slow)])
def test_reader_spark_without_delta_spark_is_refused_naming_the_reader_not_the_transform(tmp_path, compute, session):
    """As spark-submit runs a spec with `reader: spark` when no delta-spark
    JARs were given: the read is lazy, so Spark's "no data source delta"
    came out of the transform's analysis, and the error said "the transform
    SQL failed"; with Delta's catalog set but no JARs on the driver, every
    SQL failed so. It names delta-spark and the ways out, and nothing is
    committed."""
    import subprocess
    import sys

    upstream, downstream = chain_specs(tmp_path, reader="spark")
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=50, users=10)
    assert run_batch(load_spec(upstream), RunOptions(run_id="up"), compute_factory=compute).status == "committed"
    shown = subprocess.run([sys.executable, "-c", _WITHOUT_DELTA_SPARK, str(downstream), session],
                           capture_output=True, text=True, timeout=300)
    assert shown.stdout.startswith("SourceRefusedError"), shown.stdout + shown.stderr[-3000:]
    assert "delta-spark, which this Spark session does not have" in shown.stdout, shown.stdout
    assert "`source.reader: driver`" in shown.stdout and "make jars" in shown.stdout, shown.stdout
    assert "transform SQL failed" not in shown.stdout
    assert not DeltaTable.is_deltatable(load_spec(downstream).state_path)


def _widened_upstream(path: str, last_type) -> str:
    """A delta-rs upstream with its change feed: two appends with `v` an INT,
    then every row rewritten with `v` as `last_type` (as `StateTable._widen`
    rewrites a state whose sum outgrew its column), then one more append."""
    import pyarrow as pa
    from deltalake import write_deltalake

    narrow = pa.schema([("k", pa.string()), ("v", pa.int32())])
    DeltaTable.create(path, narrow, configuration={"delta.enableChangeDataFeed": "true"})
    write_deltalake(path, pa.table({"k": ["a", "b"], "v": [1, 2]}, schema=narrow), mode="append")  # v1
    write_deltalake(path, pa.table({"k": ["c"], "v": [3]}, schema=narrow), mode="append")  # v2
    wide = pa.schema([("k", pa.string()), ("v", last_type)])
    write_deltalake(path, read_all(DeltaTable(path)).cast(wide), mode="overwrite", schema_mode="overwrite")  # v3
    write_deltalake(path, pa.table({"k": ["a"], "v": pa.array(["x"] if pa.types.is_string(last_type) else [2**40]).cast(last_type)},
                                   schema=wide), mode="append")  # v4
    return path


@pytest.mark.parametrize("wider", ["bigint", "decimal(20,0)"])
@pytest.mark.parametrize("reader", ["driver", "spark"])
def test_an_upstream_state_widened_since_its_versions_were_written_is_followed_exactly(tmp_path, compute, reader, wider):
    """An upstream whose INT column became a BIGINT (a state's sum that
    outgrew its column) after the versions a downstream has yet to read:
    delta-spark reads a change feed with today's columns and refused those
    versions on every retry (found by a review); now Spark's Parquet reader
    widens their values (a BIGINT, or a DECIMAL with room for every INT),
    and both readers follow the upstream exactly."""
    import pyarrow as pa

    up = _widened_upstream(str(tmp_path / "up"), {"bigint": pa.int64(), "decimal(20,0)": pa.decimal128(20, 0)}[wider])
    followed = _downstream(tmp_path, up, "changes", reader)
    assert _drain(followed, compute) == {"a": 1 + 2**40, "b": 2, "c": 3}


def test_an_upstream_column_retyped_otherwise_is_refused_to_spark_s_reader_naming_the_driver_s(tmp_path, compute):
    """A column that became a STRING since the versions to read is not a
    widening: delta-spark would read those versions with today's type, so
    planning refuses them (exit 2, nothing committed), naming the reader
    that reads each version with its own columns."""
    import pyarrow as pa

    up = _widened_upstream(str(tmp_path / "up"), pa.string())
    followed = _downstream(tmp_path, up, "changes", "spark")
    with pytest.raises(SourceRefusedError, match=r"column 'v' was int32 at version 0 and is now string.*`source.reader: driver`") as caught:
        run_batch(followed, RunOptions(run_id="r"), compute_factory=compute)
    assert exit_code(caught.value) == 2
    assert not DeltaTable.is_deltatable(followed.state_path)


def test_a_column_retyped_otherwise_inside_the_range_is_refused_though_today_s_type_widens_the_first(tmp_path, compute):
    """INT, then DECIMAL(10,2), then BIGINT again: today's type widens the
    first version's, but the range's middle files hold decimals, which
    Spark would read as their unscaled digits (1.00 as 100; found by a
    review). Every type the range's files may hold must widen to today's."""
    from decimal import Decimal

    import pyarrow as pa
    from deltalake import write_deltalake

    up = str(tmp_path / "up")

    def schema(kind):
        return pa.schema([("k", pa.string()), ("v", kind)])

    DeltaTable.create(up, schema(pa.int32()), configuration={"delta.enableChangeDataFeed": "true"})  # v0
    write_deltalake(up, pa.table({"k": ["a"], "v": [1]}, schema=schema(pa.int32())), mode="append")  # v1
    write_deltalake(up, pa.table({"k": ["a", "b"], "v": [Decimal("1.00"), Decimal("7.00")]}, schema=schema(pa.decimal128(10, 2))),
                    mode="overwrite", schema_mode="overwrite")  # v2
    write_deltalake(up, pa.table({"k": ["a", "b"], "v": [1, 7]}, schema=schema(pa.int64())), mode="overwrite", schema_mode="overwrite")  # v3
    followed = _downstream(tmp_path, up, "changes", "spark")
    with pytest.raises(SourceRefusedError, match=r"column 'v' was decimal128\(10, 2\) at version 2 and is now int64") as caught:
        run_batch(followed, RunOptions(run_id="r"), compute_factory=compute)
    assert exit_code(caught.value) == 2
    assert not DeltaTable.is_deltatable(followed.state_path)
    assert _drain(_downstream(tmp_path, up, "changes", "driver"), compute) == {"a": 1, "b": 7}


# Without column mapping in `make soak`: with it, the same widening is followed by physical names too.
@pytest.mark.parametrize("mapping", [pytest.param("none", marks=pytest.mark.slow), "name"])
def test_an_upstream_widened_by_delta_s_own_alter_type_is_followed_by_spark_s_reader(tmp_path, spark, compute, mapping):
    """Delta's type widening (`ALTER TABLE ... ALTER COLUMN v TYPE BIGINT`,
    the `typeWidening` table feature) changes the schema without rewriting a
    file: the versions before it keep INTs in their files. Spark's reader
    reads them widened. With column mapping, delta-spark reads a range with
    its last version's columns, and a range spanning the widening, read
    after a later rename, failed on every retry with exit 1 (found by a
    review): now it is read, and the rename starts the next batch."""
    up = str(tmp_path / "up")
    props = {"delta.enableChangeDataFeed": "true", "delta.enableTypeWidening": "true", "delta.columnMapping.mode": mapping}
    spark.sql(f"CREATE TABLE delta.`{up}` (k STRING, v INT) USING delta TBLPROPERTIES "
              f"({', '.join(f'{k!r} = {v!r}' for k, v in props.items())})")
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', 1), ('b', 2)")
    spark.sql(f"UPDATE delta.`{up}` SET v = 20 WHERE k = 'b'")
    spark.sql(f"ALTER TABLE delta.`{up}` ALTER COLUMN v TYPE BIGINT")
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('a', {2**40})")
    followed = _downstream(tmp_path, up, "changes", "spark")
    if mapping == "none":
        assert _drain(followed, compute) == {"a": 1 + 2**40, "b": 20}
        return
    spark.sql(f"ALTER TABLE delta.`{up}` RENAME COLUMN k TO key")
    spark.sql(f"INSERT INTO delta.`{up}` VALUES ('c', 5)")
    assert run_batch(followed, RunOptions(run_id="r"), compute_factory=compute).status == "committed"
    assert {r["k"]: r["v"] for r in rows_of(read_all(DeltaTable(followed.state_path)))} == {"a": 1 + 2**40, "b": 20}
    with pytest.raises(TransformError) as caught:  # the next batch comes with the new name, as a rename does
        run_batch(followed, RunOptions(run_id="r"), compute_factory=compute)
    assert exit_code(caught.value) == 2

