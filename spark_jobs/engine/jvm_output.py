"""The driver JVM's console output, relayed to Python logging at its own level.

Spark's JVM writes its log (log4j: ``26/11/23 22:56:47 WARN Logger: ...``)
and a few start-up notices to the standard error it inherits. Under Airflow
that stream is the task's stderr, which Airflow logs at ERROR: every
successful run showed five red lines, none of them an error. So the JVM is
launched (`spark_jobs.engine.driver`) with a pipe for its standard output
and error instead (`relay_pipe`), and a thread relays each line to the
``microbatch.spark`` logger at the level log4j gave it. Lines without a
level (a stack trace's frames) keep the level of the record they continue;
the start-up notices no user needs are dropped (`QUIET`).

The JVM keeps the pipe for its whole life, and so do the Python workers it
starts, so their tracebacks are relayed too (at WARNING: they have no level
of their own, and the job reports the failure it causes itself).
"""

from __future__ import annotations

import logging
import os
import re
import threading

__all__ = ["QUIET", "relay_line", "relay_pipe"]

log = logging.getLogger("microbatch.spark")

_RECORD = re.compile(r"^\d{2}/\d{2}/\d{2} \d{2}:\d{2}:\d{2} (TRACE|DEBUG|INFO|WARN|ERROR|FATAL) (.*)$")
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}

#: Start-up notices every run prints and no user acts on: the JVM's note on
#: the vector module Spark enables, log4j's choice of its default profile,
#: how to change the level, and Hadoop's native library (pure Java is fine).
QUIET = (
    re.compile(r"^WARNING: Using incubator modules: "),
    re.compile(r"^Using Spark's default log4j profile: "),
    re.compile(r'^Setting default log level to "\w+"\.$'),
    re.compile(r"^To adjust logging level use sc\.setLogLevel"),
    re.compile(r"NativeCodeLoader: Unable to load native-hadoop library"),
)


def relay_line(line: str, previous: int | None) -> tuple[int | None, str | None]:
    """The level and text to log one JVM line at (text None: dropped), and
    the level a following unlevelled line inherits."""
    line = line.rstrip("\r\n")
    if not line.strip() or any(pattern.search(line) for pattern in QUIET):
        return previous, None
    record = _RECORD.match(line)
    if record:
        level = _LEVELS[record.group(1)]
        return level, record.group(2)
    return previous, line


def relay_pipe() -> int:
    """The write end of a pipe whose lines are relayed to logging, for a
    child process's standard output and error. The caller hands it to the
    child and closes its own copy; the relay ends when every holder has.

    Standard output goes there too, so that the JVM holds no copy of this
    process's streams: whoever reads them (a shell's pipe, Airflow's task
    supervisor, a benchmark) sees them end when this process ends, not when
    the JVM has finished shutting down half a second later.
    """
    read_fd, write_fd = os.pipe()
    threading.Thread(target=_relay, args=(read_fd,), name="jvm-output-relay", daemon=True).start()
    return write_fd


def _relay(read_fd: int) -> None:
    level: int | None = None
    with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as stream:
        for line in stream:
            level, text = relay_line(line, level)
            if text is not None:
                log.log(level if level is not None else logging.WARNING, "%s", text)
