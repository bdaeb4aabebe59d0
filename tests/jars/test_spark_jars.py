"""The JARs set-up fetches for Spark (`jars/spark/pom.xml`): present, found
without a network, and none of them a second copy of a library pyspark ships."""

from __future__ import annotations

import re
from pathlib import Path

import pyspark

from spark_jobs.engine.session import DELTA_SQL, SPARK_JARS_ENV, extra_jars, session_options
from spark_jobs.jar_cache import complete_dir

#: A JAR's artifact: its file name without the version and `.jar`.
_ARTIFACT = re.compile(r"^(?P<artifact>.+)-\d+\.\d+[\w.\-]*\.jar$")


def _artifact(name: str) -> str:
    match = _ARTIFACT.match(name)
    assert match, f"not a versioned JAR name: {name}"
    return match["artifact"]


def test_the_spark_jars_are_fetched_and_carry_delta_and_the_kafka_connector():
    folder = complete_dir("spark")
    assert folder is not None, "make test fetches them (python jars/fetch.py spark)"
    artifacts = {_artifact(j.name) for j in folder.glob("*.jar")}
    assert {"delta-spark_4.2_2.13", "delta-storage", "spark-sql-kafka-0-10_2.13", "kafka-clients"} <= artifacts


def test_no_fetched_jar_duplicates_a_library_pyspark_ships():
    shipped = {_artifact(j.name) for j in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    fetched = {_artifact(Path(j).name) for j in extra_jars()}
    assert fetched and not fetched & shipped, f"exclude these in jars/spark/pom.xml: {sorted(fetched & shipped)}"


def test_a_session_that_queries_delta_gets_the_jars_and_delta_sql_and_the_jobs_own_do_not(monkeypatch):
    options = session_options("local[1]", "t", short_lived=False, delta=True)
    assert options["spark.jars"].split(",") == extra_jars()
    assert {k: options[k] for k in DELTA_SQL} == DELTA_SQL
    for short_lived in (True, False):  # a one-batch run, a catch-up
        own = session_options("local[1]", "t", short_lived=short_lived)
        assert "spark.jars" not in own and not DELTA_SQL.keys() & own.keys(), "the job reads Delta with delta-rs"
    monkeypatch.setenv(SPARK_JARS_ENV, "none")
    plain = session_options("local[1]", "t", short_lived=False, delta=True)
    assert "spark.jars" not in plain and not DELTA_SQL.keys() & plain.keys()
