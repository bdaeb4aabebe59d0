"""The driver JVM's output reaches logging at its own level (`jvm_output`)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import uuid

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.engine.jvm_output import relay_line
from tests.conftest import ROOT, assert_exact, marked_processes_left, run_cli

STARTUP = [
    "WARNING: Using incubator modules: jdk.incubator.vector",
    "Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties",
    'Setting default log level to "WARN".',
    "To adjust logging level use sc.setLogLevel(newLevel). For SparkR, use setLogLevel(newLevel).",
    "26/11/23 22:56:47 WARN NativeCodeLoader: Unable to load native-hadoop library for your platform... using builtin-java classes where applicable",
]


def test_startup_notices_are_dropped_and_records_keep_their_level():
    assert all(relay_line(line, None)[1] is None for line in STARTUP)
    level, text = relay_line("26/11/23 22:57:01 ERROR Executor: Exception in task 0.0\n", None)
    assert (level, text) == (logging.ERROR, "Executor: Exception in task 0.0")
    # A stack frame continues the record before it, at its level.
    assert relay_line("\tat org.apache.spark.Foo.bar(Foo.scala:1)", level) == (logging.ERROR, "\tat org.apache.spark.Foo.bar(Foo.scala:1)")
    assert relay_line("26/11/23 22:57:02 WARN TaskSetManager: Lost task", level)[0] == logging.WARNING
    assert relay_line("26/11/23 22:57:02 INFO SparkContext: Running", None)[0] == logging.INFO


def test_a_real_driver_jvm_writes_nothing_to_stderr_and_its_errors_are_logged_as_errors():
    script = textwrap.dedent(
        """
        import logging, time
        logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(name)s|%(message)s")
        from spark_jobs.engine.session import default_session
        spark = default_session("local[1]")
        assert spark.range(5).count() == 5
        spark._jvm.org.apache.log4j.LogManager.getLogger("probe").error("a real error")
        time.sleep(1)
        spark.stop()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    relayed = [line for line in done.stderr.splitlines() if line.startswith(("ERROR|", "WARNING|"))]
    assert relayed == ["ERROR|microbatch.spark|probe: a real error"], done.stderr
    assert "log4j profile" not in done.stderr and "NativeCodeLoader" not in done.stderr


def test_the_driver_jvm_holds_none_of_the_process_streams():
    """Whoever reads a run's output (a shell pipe, Airflow's supervisor) sees it
    end when the run's process ends, not when the JVM has shut down after it."""
    script = textwrap.dedent(
        """
        import os
        from spark_jobs.engine.session import default_session
        spark = default_session("local[1]")
        jvm = spark._jvm.java.lang.ProcessHandle.current().pid()
        print("STREAMS", *[os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)], flush=True)
        print("JVM", *[os.readlink(f"/proc/{jvm}/fd/{fd}") for fd in (1, 2)], flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("STREAMS"))
    jvm = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("JVM"))
    assert len(ours) == 2 and not set(ours) & set(jvm), (ours, jvm)


def test_the_cli_ends_without_teardown_and_its_driver_jvm_ends_by_itself(spec_path):
    """The CLI leaves with `os._exit` once its output is flushed: the output is
    whole, the exit code is the run's, the batch is committed, and the driver
    JVM, which watches its standard input, exits after it."""
    mark = uuid.uuid4().hex
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=50)
    result = run_cli("run", str(spec_path), "--json", env={"MICROBATCH_TEST_MARK": mark})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip().endswith("}") and '"committed"' in result.stdout
    assert_exact(spec_path)
    left = marked_processes_left(mark)
    assert not left, f"still running after the CLI ended: {left}"
    failed = run_cli("run", str(spec_path.parent / "missing.yaml"))
    assert failed.returncode != 0 and failed.stderr.startswith("error:"), failed.stderr[-2000:]
