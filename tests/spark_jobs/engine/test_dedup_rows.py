"""`dedup_rows.together` and `apart`: a batch's result and its ids from one
job, each as its own `toArrow` would have given it (real Spark)."""

from __future__ import annotations

import pyarrow as pa

from spark_jobs.engine import dedup_rows


def _schema(frame) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(frame.schema, error_on_duplicated_field_names_in_struct=True, timezone="UTC")


def test_apart_gives_each_frame_s_own_rows_and_types_nullability_included(spark):
    from pyspark.sql import functions as F

    records = spark.createDataFrame(
        [("e1", "u1", "2026-12-01 10:00:00"), ("e2", "u1", "2026-12-01 10:01:00"), ("e3", "u.2", "2026-12-01 10:02:00")],
        "event_id STRING, user_id STRING, ts STRING",
    ).withColumn("ts", F.to_timestamp("ts"))
    # A count (never null), a struct whose fields are never null, a map, and a name with a dot.
    result = records.groupBy("user_id").agg(
        F.count(F.lit(1)).alias("clicks"),
        F.struct(F.count(F.lit(1)).alias("n"), F.lit("x").alias("tag")).alias("detail"),
        F.create_map(F.lit("k"), F.count(F.lit(1))).alias("by kind"),
        F.max("ts").alias("last.seen"),
    )
    ids = records.select(F.col("event_id").alias("id"), F.col("ts").alias("event_time"))
    both = dedup_rows.together(result, ids).toArrow()
    mine, theirs = dedup_rows.apart(both, _schema(result), _schema(ids))
    expected_result, expected_ids = result.toArrow(), ids.toArrow()
    assert mine.schema == expected_result.schema
    assert not mine.schema.field("clicks").nullable and not mine.schema.field("detail").type.field("n").nullable
    assert theirs.schema == expected_ids.schema
    assert mine.sort_by("user_id").equals(expected_result.sort_by("user_id"))
    assert theirs.sort_by("id").equals(expected_ids.sort_by("id"))


def test_apart_of_an_empty_side_is_an_empty_table_of_its_schema(spark):
    from pyspark.sql import functions as F

    records = spark.createDataFrame([("e1", "u1")], "event_id STRING, user_id STRING")
    result = records.where(F.lit(False)).groupBy("user_id").agg(F.count(F.lit(1)).alias("clicks"))
    ids = records.select(F.col("event_id").alias("id"))
    mine, theirs = dedup_rows.apart(dedup_rows.together(result, ids).toArrow(), _schema(result), _schema(ids))
    assert (mine.num_rows, mine.schema) == (0, result.toArrow().schema)
    assert theirs.column("id").to_pylist() == ["e1"]


def test_the_result_and_the_ids_read_the_records_once(spark, tmp_path):
    """The point of `together`: the window over the ids is computed once
    (its exchange reused by the ids' branch), so the batch's file is scanned
    once, with or without adaptive execution (a one-batch process runs
    without it)."""
    from pyspark.sql import functions as F

    from spark_jobs.core.dedup import Remembered
    from spark_jobs.core.spec import load_spec
    from tests.conftest import write_spec

    spec = load_spec(write_spec(tmp_path, {
        "name": "deduped",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "event_id STRING, user_id STRING"},
        "transform": "SELECT user_id, count(*) AS clicks FROM batch GROUP BY user_id",
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"clicks": "sum"}},
        "checkpoint": "lake/_checkpoints/deduped",
        "dedup": {"key": ["event_id"]},
    }))
    (tmp_path / "landing" / "b0.json").write_text('{"event_id": "e1", "user_id": "u1"}\n{"event_id": "e1", "user_id": "u1"}\n')
    valid = spark.read.schema("event_id STRING, user_id STRING").json(str(tmp_path / "landing"))
    nothing = Remembered(str(tmp_path / "no-ids-yet"), "deduped", "true", None)
    adaptive = spark.conf.get("spark.sql.adaptive.enabled")
    try:
        for setting in ("false", "true"):
            spark.conf.set("spark.sql.adaptive.enabled", setting)
            deduped = dedup_rows.deduplicated(spark, spec, valid, ["event_id", "user_id"], nothing, {})
            result = deduped.kept.groupBy("user_id").agg(F.count(F.lit(1)).alias("clicks"))
            both = dedup_rows.together(result, deduped.ids)
            mine, theirs = dedup_rows.apart(both.toArrow(), _schema(result), _schema(deduped.ids))
            plan = both._jdf.queryExecution().executedPlan().toString()
            assert "ReusedExchange" in plan, (setting, plan)
            assert (mine.to_pylist(), theirs.column("id").to_pylist()) == ([{"user_id": "u1", "clicks": 1}], ['{"event_id":"e1"}'])
    finally:
        spark.conf.set("spark.sql.adaptive.enabled", adaptive)
