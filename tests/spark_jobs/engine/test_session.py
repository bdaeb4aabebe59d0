"""Which reader a run's Delta source gets (`session.with_reader`)."""

from __future__ import annotations

import pytest

from spark_jobs.core.spec import load_spec
from spark_jobs.engine.session import with_reader
from tests.conftest import chain_specs


@pytest.mark.parametrize(
    ("reader", "master", "resolved"),
    [
        ("auto", "local[*]", "auto"),  # each batch by its size (tests/spark_jobs/sources/test_delta_by_size.py)
        ("auto", "local[2]", "auto"),
        ("auto", "spark://host:7077", "spark"),
        ("auto", "sc://host:15002", "spark"),
        ("auto", None, "driver"),  # under spark-submit, whose classpath may lack delta-spark (found by a review)
        ("driver", "sc://host:15002", "driver"),
        ("spark", "local[*]", "spark"),
    ],
)
def test_auto_reads_on_the_executors_off_local(tmp_path, reader, master, resolved):
    """`auto` keeps a Delta source's rows out of the job's process where that
    process is not the machine the executors run on, and leaves the choice
    to each batch's size on `local[*]`; a chosen reader stays."""
    _, downstream = chain_specs(tmp_path, reader=reader)
    spec = load_spec(downstream)
    run = with_reader(spec, master)
    assert run.source.reader == resolved
    assert run.name == spec.name and run.base_dir == spec.base_dir and run.spec_path == spec.spec_path


def test_the_default_is_auto_and_other_sources_are_untouched(tmp_path):
    from spark_jobs.core.spec import DeltaSourceSpec

    assert DeltaSourceSpec(type="delta", path="lake/state").reader == "auto"
    upstream, _ = chain_specs(tmp_path)
    files = load_spec(upstream)
    assert with_reader(files, "sc://host:15002") is files


def test_a_big_read_is_split_into_more_tasks_than_cores(spark, tmp_path):
    """A batch of more than 32 MB a core is read in splits of at most 32 MB,
    not in one split a core (Spark's default, up to 128 MB): 125 MB on two
    cores is 4 tasks, not 2, so the tasks balance over the cores
    and their aggregation maps fit in memory (measured in state-at-scale.md)."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "big.parquet"
    rows = 5_000  # 25 row groups of 5 MB each, incompressible
    with pq.ParquetWriter(path, pa.schema([("blob", pa.binary())]), compression="none") as writer:
        for _ in range(25):
            writer.write_table(pa.table({"blob": [os.urandom(1_000) for _ in range(rows)]}), row_group_size=rows)
    assert spark.sparkContext.defaultParallelism == 2 and path.stat().st_size > 115 * 2**20
    assert spark.read.parquet(str(path)).rdd.getNumPartitions() == 4


def test_a_split_size_already_set_stays(spark):
    """The job's 32 MB splits replace Spark's default only: a split size set
    on the session (by its owner, or through spark-submit's ``--conf`` and
    spark-defaults.conf, which a session starts with) is kept."""
    from spark_jobs.engine.session import SPLIT_BYTES, split_reads

    key = "spark.sql.files.maxPartitionBytes"
    before = spark.conf.get(key)
    try:
        spark.conf.set(key, "256m")
        split_reads(spark)
        assert spark.conf.get(key) == "256m"
        spark.conf.unset(key)
        assert spark.conf.get(key) == "134217728b"  # Spark's default, as a session spells it
        split_reads(spark)
        assert spark.conf.get(key) == SPLIT_BYTES
    finally:
        spark.conf.set(key, before)


def test_a_split_size_in_spark_defaults_is_kept_by_the_jobs_session(tmp_path):
    """A new process's session, as a run makes it, with spark-defaults.conf
    setting the split size (found by a review: the job used to overwrite it)."""
    import os
    import subprocess
    import sys

    (tmp_path / "spark-defaults.conf").write_text("spark.sql.files.maxPartitionBytes 256m\n")
    script = (
        "from spark_jobs.engine.session import default_session\n"
        "s = default_session('local[1]')\n"
        "print('SPLIT', s.conf.get('spark.sql.files.maxPartitionBytes'))\n"
        "s.stop()\n"
    )
    env = {**os.environ, "SPARK_CONF_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "SPLIT 256m" in out.stdout, out.stdout + out.stderr[-2000:]


def test_auto_on_local_stays_with_the_driver_without_delta_spark_s_jars(tmp_path, monkeypatch):
    """Without delta-spark's JARs (`MICROBATCH_SPARK_JARS=none`, or never
    fetched) a big batch cannot be read by Spark: `auto` on `local[*]` is
    the driver's, as before issue 64 (found by its review: such a run
    failed, and every rerun of the planned batch with it)."""
    from spark_jobs.engine.session import SPARK_JARS_ENV

    monkeypatch.setenv(SPARK_JARS_ENV, "none")
    _, downstream = chain_specs(tmp_path, reader="auto")
    assert with_reader(load_spec(downstream), "local[*]").source.reader == "driver"
