"""Where a batch's rows go: the engine's choice, kept out of the protocol.

The protocol (`spark_jobs.core.protocol`) commits a batch the same way
whoever wrote its rows; which path they take is decided here, from the
spec, the planned range and what the engine can do:

* **In the job's process**: the compute hands the batch's updates back as
  an Arrow table, and delta-rs writes them (a small batch: a Spark job of
  Python tasks would cost a cold run a third of its time).
* **By the executors** (`executors_write`): Spark's tasks write the updates
  and the bad records as data files (`spark_jobs.core.staged`); the job's
  process sees their names and statistics only.
* **Merged with its changes by the executors** (`merged_with_changes`): a
  merged state with a change data feed has the executors' join write the
  change files with the merged rows, and the job commits them itself
  (`spark_jobs.core.own_commits`: at the checked snapshot's version + 1
  only, put with ``If-None-Match`` on S3), the state fence and the batch's
  metadata in the same entry.
* **Merged by delta-spark** (`merged_by_delta_spark`): the one batch the
  join cannot merge, a big one into such a state whose files carry deletion
  vectors (merge-on-read: the join reads a file's rows as they are, deleted
  ones too), is MERGEd by delta-spark on the executors, in one commit that
  carries the state fence as its ``txn`` and the batch's metadata
  (`spark_jobs.engine.delta_merge`). Not on S3, where delta-spark's commits
  are atomic only within one driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_jobs.core.folding import is_appended
from spark_jobs.storage.s3 import is_s3

if TYPE_CHECKING:
    from spark_jobs.core.spec import PipelineSpec
    from spark_jobs.sources import BatchRange

__all__ = [
    "EXECUTORS_FROM_BYTES", "executors_write", "merged_by_delta_spark", "merged_with_changes", "needs_delta_spark", "read_by_spark",
]

#: `engine.state_write: auto`: a batch reading more than this many bytes has
#: its rows written by Spark's executors. A million keys of Parquet input
#: weigh about 17 MB; their result in this process, about 170 MB.
EXECUTORS_FROM_BYTES = 32 * 1024 * 1024


def executors_write(spec: PipelineSpec, batch: BatchRange, writes_files: bool) -> bool:
    """Whether Spark's executors write this batch's rows (`engine.state_write`),
    on an engine that `writes_files`.

    `auto`: when the batch reads more than `EXECUTORS_FROM_BYTES`, or when
    a Delta source is read by Spark (`source.reader: spark`: its rows were
    never in this process). A smaller batch's result comes back here and is
    written by delta-rs: its rows fit, and a Spark job of Python tasks
    would cost a cold run a third of its time (docs/benchmarks.md)."""
    mode = spec.engine.state_write
    if mode == "driver" or not writes_files:
        return False
    if mode == "executors":
        return True
    if read_by_spark(spec, batch):
        return True
    size = batch.manifest.input_bytes()
    return size is not None and size > EXECUTORS_FROM_BYTES


def read_by_spark(spec: PipelineSpec, batch: BatchRange) -> bool:
    """Whether a Delta source's batch is read by delta-spark on the
    executors: its manifest says who reads it (`DeltaManifest.reader_for`)."""
    reader_for = getattr(batch.manifest, "reader_for", None)
    return reader_for is not None and reader_for(getattr(spec.source, "reader", "driver")) == "spark"


def merged_by_delta_spark(spec: PipelineSpec) -> bool:
    """Whether a big batch into this state, once its files carry deletion
    vectors, is MERGEd by delta-spark (`StateTable._merge_staged`): a merged
    state with a change data feed, not on S3.

    On S3 delta-rs keeps that MERGE (in the job's process): delta-spark's S3
    log store makes a commit atomic only among the writers of one driver
    JVM, and two runs of a pipeline (a retry racing a zombie, a backfill)
    are two drivers; delta-rs's conditional put is safe across them."""
    return merged_with_changes(spec) and not is_s3(spec.state_path)


def needs_delta_spark(spec: PipelineSpec) -> bool:
    """Whether a run's Spark session loads delta-spark to merge this state's
    big batches (`merged_by_delta_spark`): only a state that merges on read
    (`state.deletion_vectors`) gets files with vectors; delta-spark made a
    session's start 1.6 s slower. (A state whose vectors outlive the setting
    turned off has such a batch merged in the job's process, as on S3.)"""
    return merged_by_delta_spark(spec) and spec.state.deletion_vectors


def merged_with_changes(spec: PipelineSpec) -> bool:
    """Whether a batch the executors merge into this state writes its change
    data with the merged rows, committed by the job (`own_commits.commit_rewrite`):
    a merged state with a change data feed. Measured against delta-spark's
    MERGE of the same batch (1M returning keys, docs/benchmarks.md "Chain
    upstream"), its commit took a third of the time; and it fences two
    drivers on S3, where delta-spark cannot."""
    return spec.state.change_feed and not is_appended(spec) and spec.engine.state_write != "driver"
