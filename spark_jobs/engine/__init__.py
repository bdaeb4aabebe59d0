"""The Spark engine: the `Compute` the protocol runs batches on.

`spark_compute` reads a planned range, quarantines bad records and runs the
transform; `session` makes and configures Spark sessions (local, standalone
cluster, Spark Connect); `s3_read` fetches S3 objects on the executors;
`driver` launches the local driver JVM (ahead of need, for a one-batch
process); `jvm_cache` supplies its flags and class archive.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from spark_jobs.core.write_path import read_by_spark

if TYPE_CHECKING:
    from spark_jobs.core.compute import Compute
    from spark_jobs.core.spec import PipelineSpec
    from spark_jobs.engine.driver import EarlyDriver
    from spark_jobs.engine.idle_hint import IdleHint
    from spark_jobs.sources import BatchRange

__all__ = ["SparkFactory", "compute_factory"]

log = logging.getLogger("microbatch")


class SparkFactory:
    """Makes a run's `SparkCompute`; the protocol calls it only when a batch has work.

    Owns the driver JVM launched ahead of need (`start_driver`): the compute
    it makes may take it for its session, and leaving the factory's `with`
    block stops it if none did (nothing new, a dry run, an error).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        master: str | None,
        *,
        process_ends: bool,
        early: EarlyDriver | None,
        short_lived: bool = True,
        delta: bool = False,
        hint: IdleHint | None = None,
    ) -> None:
        #: The spec as runs on this engine read it (`session.with_reader`): run it, not the one given.
        self.spec = spec
        self._master = master
        self._process_ends = process_ends
        self._early = early
        self._short_lived = short_lived
        self._delta = delta
        #: Kept for the next run: whether this one found nothing new (it never made a compute).
        self._hint = hint
        self._made = False

    def expect(self, spec: PipelineSpec, batch: BatchRange) -> None:
        """The first batch this factory's compute runs, before it starts: a
        Delta source's batch that Spark reads (`write_path.read_by_spark`)
        gets a session with delta-spark. Only then: delta-spark made a
        session's start 1.6 s slower (a fifth of a small batch's run)."""
        if read_by_spark(spec, batch):
            self._delta = True

    def __call__(self) -> Compute:
        from spark_jobs.engine.session import redact_master
        from spark_jobs.engine.spark_compute import SparkCompute

        log.info("Spark master: %s", redact_master(self._master))
        self._made = True
        return SparkCompute(
            master=self._master,
            stop_on_close=not self._process_ends,
            early=self._early,
            short_lived=self._short_lived,
            delta=self._delta,
        )

    def __enter__(self) -> SparkFactory:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._early is not None:
            self._early.close()
        if self._hint is not None:
            self._hint.record(idle=kind is None and not self._made)


def compute_factory(
    spec: PipelineSpec,
    master: str | None = None,
    *,
    process_ends: bool = False,
    start_driver: bool = False,
    short_lived: bool = True,
) -> SparkFactory:
    """Spark for `spec`'s runs, on `master` or the one `resolve_master` picks.

    The one place the CLI, the operator and the warm-up choose their engine.
    Returns a factory: the protocol calls it only when a batch has work, so
    a run with nothing new starts no session. `process_ends`: the process
    exits after the run (the CLI), so a driver JVM it started is left to end
    with it rather than stopped first. `start_driver`: for a run that most
    likely has a batch to process, launch the local driver JVM now, so that
    it boots while the run plans (`spark_jobs.engine.driver`); the caller
    runs in the factory's `with` block, whose end stops it if unused.
    `short_lived`: the local session runs one batch (JVM flags for a fast
    start, `spark_jobs.engine.jvm_cache`); False for a run of many batches
    (`catch_up`), whose JVM compiles for the long run. A Delta source read by
    Spark (`source.reader: spark`, or `auto` off `local[*]`) gets a session
    with delta-spark; the factory's `spec` is the one to run, its reader
    resolved. No JVM is launched early when the source looks as it did when
    the last run found nothing new (`idle_hint`): such a run stays JVM-free.
    """
    from spark_jobs.engine.idle_hint import IdleHint
    from spark_jobs.engine.session import launch_driver, resolve_master, with_reader

    resolved = resolve_master(master, spec)
    spec = with_reader(spec, resolved)
    remote = resolved is not None and resolved.startswith("sc://")
    # A run of many batches (`short_lived` False) starts its session once:
    # with delta-spark for a Delta source it may read by Spark (`auto` on
    # `local[*]` chooses per batch); a one-batch run, if its batch needs it
    # (`SparkFactory.expect`).
    may_read = spec.source.type == "delta" and spec.source.reader == "auto"
    delta = (spec.source.type == "delta" and spec.source.reader == "spark") or (not short_lived and may_read)
    hint = IdleHint(spec) if start_driver and not remote else None
    if hint is not None and hint.unchanged():
        log.debug("the source is as the last run, which found nothing new, left it: no early driver launch")
        start_driver = False
    early = launch_driver(resolved, short_lived=short_lived, delta=delta) if start_driver and not remote else None
    return SparkFactory(spec, resolved, process_ends=process_ends, early=early, short_lived=short_lived, delta=delta, hint=hint)
