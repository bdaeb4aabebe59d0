"""Which failures of a batch in Spark a retry cannot fix.

A batch that failed is replayed by the next run with the same plan: the
same records, through the same SQL and the same code. Most failures in
Spark (a lost executor, a full disk, a store that timed out) may pass, and
are retried (`ComputeError`, exit 1). Two kinds fail the replay the same
way every time, and are terminal (exit 2), with a message that says what
to change:

* Spark's data exceptions (SQLSTATE class 22: a value that does not cast,
  a division by zero, an arithmetic overflow under ANSI SQL) on this
  batch's records: the transform must tolerate them (`try_cast`, a `CASE`).
* A mistake in this project's own code (an `AssertionError`, a
  `TypeError`, ...), in the job's process or in a task on the executors
  (whose traceback names this package's files): the way around it while it
  is fixed is the other write path (`engine.state_write: driver`).
"""

from __future__ import annotations

import re
import traceback

from spark_jobs.core.spec import PipelineSpec
from spark_jobs.errors import InternalError, MicrobatchError, TransformError, first_line

__all__ = ["never_retried"]

#: Python exceptions that are a mistake in code, not a state of the world.
BUGS = (AssertionError, AttributeError, IndexError, KeyError, NameError, NotImplementedError, OverflowError, TypeError, ZeroDivisionError)
_BUG_LINE = re.compile(rf"^\s*({'|'.join(b.__name__ for b in BUGS)}): ?(.*)$", re.M)
_OUR_FRAME = re.compile(r'File "([^"]*spark_jobs/[^"]+)", line (\d+), in (\w+)')
#: Where a task's traceback ends: pyspark's own lines about it come after.
_TRACEBACK = "Traceback (most recent call last)"


def never_retried(spec: PipelineSpec, exc: BaseException) -> MicrobatchError | None:
    """The terminal error for a failure a replay meets again, or None (retry)."""
    if isinstance(exc, MicrobatchError):
        return None
    state = _sql_state(exc)
    if state is not None and state.startswith("22"):
        return TransformError(
            f"pipeline {spec.name}: Spark failed on this batch's records ({first_line(exc, 1000)}). A retry reads the "
            "same records through the same SQL and fails the same way, so the run stops here; nothing was committed. "
            "Make the transform tolerate such values (`try_cast`, a `CASE`, `try_divide`), then run again: the "
            "batch replays its planned records.",
            pipeline=spec.name,
        )
    bug = _our_bug(exc)
    if bug is None:
        return None
    return InternalError(
        f"pipeline {spec.name}: the batch failed in microbatch's own code ({bug}). A retry replays the same plan "
        "through the same code and fails the same way, so the run stops here; nothing was committed. While it is "
        "fixed, `engine.state_write: driver` in the spec writes the batch in the job's process instead of on the "
        "executors (a free change: the next run replays the batch); and please report it with this message.",
        pipeline=spec.name,
    )


def _sql_state(exc: BaseException) -> str | None:
    """The SQLSTATE of a Spark error (classic or Spark Connect), if it has one."""
    get = getattr(exc, "getSqlState", None)
    try:
        return get() if callable(get) else None
    except Exception:  # noqa: BLE001 - an error without a state
        return None


def _our_bug(exc: BaseException) -> str | None:
    """'Type: message at file:line in function' for a mistake in this
    package's code: raised in this process, or in a task (its traceback in
    the Spark error's text names a file of this package)."""
    if isinstance(exc, BUGS) and _sql_state(exc) is None:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "spark_jobs/" in f.filename]
        where = f" at {frames[-1].filename.rsplit('spark_jobs/', 1)[1]}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        return f"{type(exc).__name__}: {first_line(exc)}{where}" if frames else None
    text = str(exc)
    if _TRACEBACK not in text:
        return None
    task = text[text.index(_TRACEBACK):]
    frames = _OUR_FRAME.findall(task)
    found = _BUG_LINE.search(task)
    if not frames or found is None:
        return None
    path, line, function = frames[-1]
    return f"{found.group(1)}: {found.group(2)[:300]} at {path.rsplit('spark_jobs/', 1)[1]}:{line} in {function}, in a task on the executors"
