"""The demo finds the example specs it copies (it moved into `spark_jobs/demo/`), and they load."""

from __future__ import annotations


def test_the_demo_example_specs_exist_and_load():
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.__main__ import EXAMPLE, WINDOWED

    for example in (EXAMPLE, WINDOWED):
        assert example.is_file(), example
        load_spec(example)
    assert load_spec(WINDOWED).event_time is not None
