"""The driver JVM launched ahead of need (`spark_jobs.engine.driver`): used
by the batch that needs it, stopped by a run that does not, and a JVM that
cannot start says why."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.engine.driver import DriverExitedError, DriverLaunch
from spark_jobs.engine.session import EARLY_DRIVER_ENV, launch_driver, session_options
from tests.conftest import ROOT, assert_exact, marked_processes_left, run_cli


def test_a_run_with_nothing_new_stops_the_driver_it_launched(spec_path, tmp_path):
    """The CLI launches the driver before it knows whether there is work. A
    batch uses it; a run that then finds nothing new stops it and removes
    the launch's files, and says nothing about it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=40)
    first = run_cli("run", str(spec_path), "--json", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads(first.stdout)["status"] == "committed"
    assert_exact(spec_path)

    mark = uuid.uuid4().hex
    idle = run_cli("run", str(spec_path), "--json", env={**env, "MICROBATCH_TEST_MARK": mark})
    assert idle.returncode == 0, idle.stderr[-2000:]
    assert json.loads(idle.stdout)["status"] == "no_new_data"
    assert "Spark" not in idle.stderr, idle.stderr  # no session, no JVM output relayed
    assert not marked_processes_left(mark), "the driver launched ahead of need is still running"
    assert not list(scratch.glob("microbatch-driver-*"))
    assert_exact(spec_path)


def test_a_cancelled_launch_ends_its_jvm_and_cannot_be_attached_to(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mark = uuid.uuid4().hex
    monkeypatch.setenv("MICROBATCH_TEST_MARK", mark)
    launch = DriverLaunch(session_options("local[1]", "cancelled", short_lived=True))
    time.sleep(0.5)  # mid-boot
    launch.cancel()
    with pytest.raises(DriverExitedError, match="cancelled"):
        launch.gateway()
    monkeypatch.delenv("MICROBATCH_TEST_MARK")
    assert not marked_processes_left(mark), "the cancelled driver JVM is still running"
    assert not list(tmp_path.glob("microbatch-driver-*"))


def test_a_driver_that_cannot_start_says_what_to_check(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk-here"))
    launch = DriverLaunch(session_options("local[1]", "no-java", short_lived=True))
    with pytest.raises(DriverExitedError, match=r"exited with code \d+ before it started.*Java 17"):
        launch.gateway()


def test_the_early_launch_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(EARLY_DRIVER_ENV, "0")
    assert not launch_driver("local[1]").pending


def test_a_process_keeps_its_one_jvm_across_sessions():
    """pyspark starts a new context on the JVM of a stopped one: no second
    JVM is launched, early or late, and none is left behind."""
    script = textwrap.dedent(
        """
        from spark_jobs.engine.session import default_session, launch_driver
        first = default_session("local[1]")
        jvm = first._jvm.java.lang.ProcessHandle.current().pid()
        first.stop()
        assert not launch_driver("local[1]").pending
        second = default_session("local[1]")
        assert second.range(3).count() == 3
        print("JVMS", jvm, second._jvm.java.lang.ProcessHandle.current().pid(), flush=True)
        """
    )
    mark = uuid.uuid4().hex
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "MICROBATCH_TEST_MARK": mark})
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("JVMS"))
    assert first == second
    assert not marked_processes_left(mark)


def test_the_pyspark_internals_the_launch_copies_are_still_pyspark_s():
    """`DriverLaunch` does what `pyspark.java_gateway.launch_gateway` does,
    by hand (so this process holds the JVM and its output). A pyspark
    upgrade that changes what it copies must fail here, not in a run: the
    environment variable naming the connection file, the file's format
    (a big-endian int port, then a length-prefixed UTF-8 secret), the
    classes imported into the gateway's view, and the `gateway` parameter
    a session attaches through (`SparkContext._ensure_initialized`)."""
    import pyspark.java_gateway as java_gateway
    from pyspark import SparkContext
    from pyspark.serializers import UTF8Deserializer, read_int

    from spark_jobs.engine import driver

    source = inspect.getsource(java_gateway.launch_gateway)
    assert 'env["_PYSPARK_DRIVER_CONN_INFO_PATH"] = conn_info_file' in source
    assert re.search(r"gateway_port = read_int\(info\)\s+gateway_secret = UTF8Deserializer\(\)\.loads\(info\)", source)
    assert tuple(re.findall(r'java_import\(gateway\.jvm, "([^"]+)"\)', source)) == driver._JAVA_IMPORTS
    assert "gateway" in inspect.signature(SparkContext._ensure_initialized).parameters

    # The format, both ways: what pyspark's readers read from bytes our reader reads.
    secret = "s3cr\u00e9t"
    encoded = secret.encode("utf-8")
    blob = struct.pack("!i", 41234) + struct.pack("!i", len(encoded)) + encoded
    ours = io.BytesIO(blob)
    theirs = io.BytesIO(blob)
    assert (driver._read_int(ours), ours.read(driver._read_int(ours)).decode("utf-8")) == (
        read_int(theirs),
        UTF8Deserializer().loads(theirs),
    )
