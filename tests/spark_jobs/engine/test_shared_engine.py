"""The suite's shared engines (tests/conftest.py): one Spark session, and one
Spark Connect server, per test process. A test that fails on them, or whose
run is killed, leaves them usable, and leaves nothing of its own that the
next test could see: each run is a session of its own on the server, and
each test has its own folders."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from spark_jobs.core.faults import MARKER
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import MicrobatchError
from tests.conftest import ROOT, assert_exact, oracle_spec_dict, run_cli, write_spec

#: A transform Spark analyses and then fails while running (ANSI: an event
#: id is no number): the failure comes from the executors, mid-job.
FAILS_WHILE_RUNNING = "SELECT user_id, sum(CAST(event_id AS INT)) AS events FROM batch GROUP BY user_id"


def _failing_spec(folder):
    base = oracle_spec_dict()
    return write_spec(folder, oracle_spec_dict(transform=FAILS_WHILE_RUNNING, state={**base["state"], "merge": {"events": "sum"}}))


def test_a_failed_and_a_killed_run_leave_the_shared_connect_server_usable(tmp_path, on_connect):
    failing = _failing_spec(tmp_path / "failing")
    write_wave(tmp_path / "failing" / "landing", 0, files=1, records_per_file=50, users=10)
    failed = run_cli("run", str(failing))
    assert failed.returncode in (1, 2) and "CAST_INVALID_INPUT" in failed.stderr, failed.stderr[-2000:]

    killed_spec = write_spec(tmp_path / "killed", oracle_spec_dict(engine={"state_write": "executors"}))
    write_wave(tmp_path / "killed" / "landing", 0, files=2, records_per_file=300, users=40)
    killed = run_cli("run", str(killed_spec), env={"MICROBATCH_FAULT_POINT": "mid_executor_write"})
    assert killed.returncode == -signal.SIGKILL and f"{MARKER} mid_executor_write" in killed.stderr, killed.stderr[-2000:]

    # The same server, right after: a pipeline of another folder runs exact,
    # and so does the killed one's retry.
    fresh = write_spec(tmp_path / "fresh", oracle_spec_dict())
    write_wave(tmp_path / "fresh" / "landing", 0, files=1, records_per_file=200, users=20)
    for spec_path in (fresh, killed_spec):
        done = run_cli("run", str(spec_path), "--json")
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["status"] == "committed"
        assert_exact(spec_path)


_SET = """
import sys
from pyspark.sql import SparkSession
s = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
s.conf.set("microbatch.test.leak", "set by another session")
s.range(3).createOrReplaceTempView("leaked")
"""
_READ = """
import json, sys
from pyspark.sql import SparkSession
s = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
print(json.dumps({"conf": s.conf.get("microbatch.test.leak", None), "views": [t.name for t in s.catalog.listTables()]}))
"""


def test_one_client_s_settings_and_views_are_not_the_next_one_s(on_connect):
    """Each process that connects (a CLI run, an Airflow task) is a session
    of its own: a setting or a temporary view one made is not in another's."""
    for script in (_SET, _READ):
        done = subprocess.run([sys.executable, "-c", script, on_connect], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"conf": None, "views": []}


def test_a_failed_batch_leaves_the_shared_session_usable_and_as_it_was(tmp_path, spark, compute):
    """The in-process tests' one Spark session: a batch that fails mid-job
    changes none of its settings, and the next pipeline commits exact on it."""
    watched = ("spark.sql.session.timeZone", "spark.sql.shuffle.partitions", "spark.sql.ansi.enabled", "spark.sql.files.maxPartitionBytes")
    before = {key: spark.conf.get(key) for key in watched}
    failing = _failing_spec(tmp_path / "failing")
    write_wave(tmp_path / "failing" / "landing", 0, files=1, records_per_file=50, users=10)
    with pytest.raises(MicrobatchError, match="CAST_INVALID_INPUT"):
        run_batch(load_spec(failing), RunOptions(run_id="fails"), compute_factory=compute)
    assert {key: spark.conf.get(key) for key in watched} == before
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []
    fresh = write_spec(tmp_path / "fresh", oracle_spec_dict())
    write_wave(tmp_path / "fresh" / "landing", 0, files=1, records_per_file=200, users=20)
    assert run_batch(load_spec(fresh), RunOptions(run_id="after"), compute_factory=compute).status == "committed"
    assert_exact(fresh)
