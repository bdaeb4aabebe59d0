"""Stopping a run on SIGTERM at the next protocol boundary.

Airflow stops a task with SIGTERM (and SIGKILL after a grace period), as do
container runtimes. Raising from the signal handler would interrupt whatever
Python is doing, and inside py4j or pyspark that garbles the bridge and
replaces the reason with an unrelated error. So the handler only records the
request; the protocol checks it at its boundaries and stops there with a
clear, retryable error (`spark_jobs.errors.Terminated`). Between boundaries
the current step finishes: a Spark job, a read, or one atomic Delta commit.
If the grace period runs out first, the SIGKILL that follows is safe too
(that is what the fault matrix tests).
"""

from __future__ import annotations

import signal
import threading

from spark_jobs.errors import Terminated

__all__ = ["check", "install", "request", "requested"]

_requested = threading.Event()


def install() -> None:
    """Turn SIGTERM into a stop request (main thread only, as for any handler)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: request())


def request() -> None:
    """Ask the run in this process to stop at its next boundary (what SIGTERM does)."""
    _requested.set()


def requested() -> bool:
    """Whether a stop was requested in this process."""
    return _requested.is_set()


def check(boundary: str, pipeline: str | None = None) -> None:
    """Raise `Terminated` if a stop was requested."""
    if _requested.is_set():
        raise Terminated(
            f"terminated (SIGTERM): stopped {boundary.replace('_', ' ')}; what the run committed "
            "stays committed and nothing after this point was written. The next run resumes from here.",
            pipeline=pipeline,
        )
