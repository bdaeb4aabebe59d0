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
    assert {"delta-spark_4.2_2.13", "delta-storage", "spark-sql-kafka-0-10_2.13", "kafka-clients", "hadoop-aws", "s3"} <= artifacts
    assert "bundle" not in artifacts, "the AWS SDK's 686 MB bundle: jars/spark/pom.xml names the modules S3A uses instead"


def test_hadoop_aws_is_the_hadoop_pyspark_ships():
    """S3A is part of Hadoop: hadoop-aws of another release than pyspark's
    hadoop-client-runtime fails at the first s3 read with missing methods."""
    shipped = [j.name for j in (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-runtime-*.jar")]
    fetched = [Path(j).name for j in extra_jars() if Path(j).name.startswith("hadoop-aws-")]
    assert len(shipped) == len(fetched) == 1, (shipped, fetched)
    assert fetched[0].removeprefix("hadoop-aws-") == shipped[0].removeprefix("hadoop-client-runtime-"), \
        f"jars/spark/pom.xml: set hadoop.version to pyspark's {shipped[0]}"


def test_no_fetched_jar_duplicates_a_library_pyspark_ships():
    shipped = {_artifact(j.name) for j in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    fetched = {_artifact(Path(j).name) for j in extra_jars()}
    assert fetched and not fetched & shipped, f"exclude these in jars/spark/pom.xml: {sorted(fetched & shipped)}"


def test_a_session_that_queries_delta_gets_the_jars_and_delta_sql_and_the_jobs_own_do_not(monkeypatch):
    options = session_options("local[1]", "t", short_lived=False, delta=True)
    assert options["spark.jars"].split(",") == extra_jars()
    assert {k: options[k] for k in DELTA_SQL} == DELTA_SQL
    assert options["spark.hadoop.fs.s3.impl"].endswith("S3AFileSystem"), "s3:// locations, as specs name them"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    on_minio = session_options("local[1]", "t", short_lived=False, delta=True)
    assert on_minio["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert on_minio["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert not any("key" in k.lower() or "secret" in k.lower() for k in on_minio), "credentials stay in the AWS chain"
    for short_lived in (True, False):  # a one-batch run, a catch-up
        own = session_options("local[1]", "t", short_lived=short_lived)
        assert "spark.jars" not in own and not DELTA_SQL.keys() & own.keys(), "the job reads Delta with delta-rs"
    monkeypatch.setenv(SPARK_JARS_ENV, "none")
    plain = session_options("local[1]", "t", short_lived=False, delta=True)
    assert "spark.jars" not in plain and not DELTA_SQL.keys() & plain.keys()
