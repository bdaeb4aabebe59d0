"""The files Spark's executors write (`spark_jobs.engine.spark_files`): their row groups.

A task gets its rows in Arrow batches of 10,000; each used to be a row
group of its own. Now a file's groups hold `ROW_GROUP_ROWS` rows (or fewer,
holding `ROW_GROUP_BYTES`), its last one the rest. Real Spark (the suite's
session) and real files in `tmp_path`; the rows and statistics read back.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_jobs.engine import spark_files
from spark_jobs.engine.spark_files import ROW_GROUP_ROWS

SCHEMA = pa.schema([("user_id", pa.string()), ("clicks", pa.int64())])


def _rows(count: int) -> pa.Table:
    numbers = np.arange(count)
    return pa.table([pa.array([f"u{n:09d}" for n in numbers]), pa.array(numbers, pa.int64())], schema=SCHEMA)


def _groups(path) -> list[int]:
    metadata = pq.ParquetFile(path).metadata
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def test_the_executors_write_a_file_in_row_groups_of_a_quarter_million_rows_not_one_a_spark_batch(tmp_path, spark):
    count = ROW_GROUP_ROWS + 37_856
    frame = spark.range(0, count, numPartitions=1).selectExpr("format_string('u%09d', id) AS user_id", "id AS clicks")

    (file,) = spark_files.write_files(frame, str(tmp_path), SCHEMA, {})

    path = tmp_path / file.path
    assert _groups(path) == [ROW_GROUP_ROWS, 37_856]  # (one a Spark batch: 27 groups)
    assert pq.read_table(path).sort_by("clicks").equals(_rows(count))
    stats = json.loads(file.stats)
    assert (file.records, stats["numRecords"]) == (count, count)
    assert (stats["minValues"]["clicks"], stats["maxValues"]["clicks"]) == (0, count - 1)


def test_a_file_of_rows_in_this_process_has_the_same_groups_and_every_row(tmp_path):
    rows = _rows(2 * ROW_GROUP_ROWS + 75_712)

    (file,) = spark_files.write_table(rows, str(tmp_path), SCHEMA, {})

    assert _groups(tmp_path / file.path) == [ROW_GROUP_ROWS, ROW_GROUP_ROWS, 75_712]
    assert pq.read_table(tmp_path / file.path).equals(rows)
    assert json.loads(file.stats)["maxValues"]["user_id"] == f"u{rows.num_rows - 1:09d}"


def test_wide_rows_make_smaller_groups_and_none_is_lost(tmp_path, monkeypatch):
    # (In this process the module's bound is read when a batch is written.)
    monkeypatch.setattr(spark_files, "ROW_GROUP_BYTES", 1024 * 1024)
    rows = _rows(100_000)
    wide = rows.set_column(0, "user_id", pa.array([f"{u}-{'x' * 90}" for u in rows.column(0).to_pylist()]))
    wide = pa.Table.from_batches(wide.to_batches(max_chunksize=10_000))  # (as Spark hands them: about 1 MB each)

    (file,) = spark_files.write_table(wide, str(tmp_path), SCHEMA, {})

    groups = _groups(tmp_path / file.path)
    assert len(groups) > 5 and max(groups) < ROW_GROUP_ROWS and sum(groups) == 100_000
    assert pq.read_table(tmp_path / file.path).equals(wide)
    assert file.records == 100_000


def test_no_rows_is_no_file(tmp_path):
    assert spark_files.write_table(SCHEMA.empty_table(), str(tmp_path), SCHEMA, {}) == ()
    assert not any(tmp_path.iterdir())
