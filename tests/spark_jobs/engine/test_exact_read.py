"""The exact read's plan: what each line's row carries."""

from __future__ import annotations

import re

from spark_jobs.core.spec import load_spec
from spark_jobs.engine import exact_read
from tests.conftest import oracle_spec_dict, write_spec


def test_a_line_does_not_carry_its_whole_file(tmp_path, spark):
    """Splitting a file into lines must not copy the file into every line's row.

    It did once: the file's UTF-8 check, written next to the explode in one
    select, was computed after it, so the explode kept the file's text in
    each row; 3 files of 5,000 records (the demo) ran the driver out of heap.
    """
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict()))
    path = tmp_path / "landing" / "a.json"
    path.write_text('{"event_id":"1","user_id":"u","amount":1}\nnot json\n')
    records = exact_read.text_records(spark, spec, [str(path)])
    plan = records._jdf.queryExecution().executedPlan().toString()
    # "Generate posexplode(split(value#0, <pattern>, -1)), [<columns each row keeps>], false, ..."
    generate = re.search(r"Generate posexplode\(.*?\)\), \[(.*?)\], false", plan, re.DOTALL)
    assert generate is not None, plan
    assert generate.group(1).startswith("__file#") and "value#" not in generate.group(1), generate.group(0)
    assert records.count() == 2


def test_a_parquet_column_of_the_specs_type_is_not_read_for_a_check(tmp_path, spark):
    """A Parquet column already of its `source.schema` type needs no
    conversion check, so a transform that does not use it does not read it
    (at 30M rows, the unused `event_id` was the biggest column read); a
    column stored as another type is still checked, and quarantined by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_jobs.engine.parse import REASON

    source = {"type": "files", "path": "landing", "format": "parquet", "schema": "event_id STRING, user_id STRING, amount DOUBLE"}
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(source=source)))
    path = tmp_path / "landing" / "a.parquet"
    pq.write_table(pa.table({"event_id": ["e1", "e2"], "user_id": ["u1", "u2"], "amount": ["1.5", "x"]}), path)
    records = exact_read.parquet_records(spark, spec, [str(path)])
    valid = records.where(records[REASON].isNull()).select("user_id", "amount")
    scan = re.search(r"ReadSchema: (struct<[^>]*>)", valid._jdf.queryExecution().executedPlan().toString())
    assert scan is not None and "event_id" not in scan.group(1) and "amount" in scan.group(1), scan
    assert [(r.user_id, r.amount) for r in valid.collect()] == [("u1", 1.5)]
    assert [r[REASON] for r in records.where(records[REASON].isNotNull()).collect()] == ["field amount: value cannot be converted to DOUBLE"]
