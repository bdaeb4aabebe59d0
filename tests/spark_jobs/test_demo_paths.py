"""The demo finds the example spec it copies (it moved into `spark_jobs/demo/`)."""

from __future__ import annotations


def test_the_demo_example_spec_exists():
    from spark_jobs.demo.__main__ import EXAMPLE

    assert EXAMPLE.is_file(), EXAMPLE
