"""Which reader a run's Delta source gets (`session.with_reader`)."""

from __future__ import annotations

import pytest

from spark_jobs.core.spec import load_spec
from spark_jobs.engine.session import with_reader
from tests.conftest import chain_specs


@pytest.mark.parametrize(
    ("reader", "master", "resolved"),
    [
        ("auto", "local[*]", "driver"),
        ("auto", "local[2]", "driver"),
        ("auto", "spark://host:7077", "spark"),
        ("auto", "sc://host:15002", "spark"),
        ("auto", None, "driver"),  # under spark-submit, whose classpath may lack delta-spark (found by a review)
        ("driver", "sc://host:15002", "driver"),
        ("spark", "local[*]", "spark"),
    ],
)
def test_auto_reads_on_the_executors_off_local(tmp_path, reader, master, resolved):
    """`auto` keeps a Delta source's rows out of the job's process where that
    process is not the machine the executors run on; a chosen reader stays."""
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
