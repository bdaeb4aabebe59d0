"""The driver JVM's console output, relayed to Python logging at its own level.

Spark's JVM writes its log (log4j: ``26/11/23 22:56:47 WARN Logger: ...``)
and a few start-up notices to the standard error it inherits. Under Airflow
that stream is the task's stderr, which Airflow logs at ERROR: every
successful run showed five red lines, none of them an error. So while a
session starts, the JVM is handed a pipe for its standard output and error
instead, and a thread relays each line to the ``microbatch.spark`` logger
at the level log4j gave it. Lines
without a level (a stack trace's frames) keep the level of the record they
continue; the start-up notices no user needs are dropped (`QUIET`).

The JVM keeps the pipe for its whole life, and so do the Python workers it
starts, so their tracebacks are relayed too (at WARNING: they have no level
of their own, and the job reports the failure it causes itself).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["QUIET", "relay_line", "relayed_output"]

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


@contextmanager
def relayed_output() -> Iterator[None]:
    """Processes started inside the block (the driver JVM) write their
    standard output and error to a pipe whose lines are relayed to logging;
    this process's own streams are untouched after the block.

    Standard output goes there too, so that the JVM holds no copy of this
    process's streams: whoever reads them (a shell's pipe, Airflow's task
    supervisor, a benchmark) sees them end when this process ends, not when
    the JVM has finished shutting down half a second later.
    """
    read_fd, write_fd = os.pipe()
    released = threading.Event()
    # Read from the start (a full pipe would stall the JVM), but log only
    # after the block: inside it this process's own streams are the pipe
    # too, and a handler writing there would feed its output back in.
    threading.Thread(target=_relay, args=(read_fd, released), name="jvm-output-relay", daemon=True).start()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd in saved:
        os.dup2(write_fd, fd)
    os.close(write_fd)
    try:
        yield
    finally:
        # The JVM holds its own copies of the write end; once it (and its
        # workers) exit, the relay reads EOF and ends.
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        released.set()


def _relay(read_fd: int, released: threading.Event) -> None:
    level: int | None = None
    held: list[tuple[int, str]] = []
    with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as stream:
        for line in stream:
            level, text = relay_line(line, level)
            if text is None:
                continue
            held.append((level if level is not None else logging.WARNING, text))
            if released.is_set():
                for at, message in held:
                    log.log(at, "%s", message)
                held.clear()
    for at, message in held:
        log.log(at, "%s", message)
