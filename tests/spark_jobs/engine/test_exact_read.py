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
