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
* **Merged by the executors' join, committed by the job** (`merged_by_join`):
  a big batch into a merged state with a change data feed, or whose files
  carry deletion vectors (merge-on-read), is merged by the executors' join,
  which writes the change files with the merged rows and reads each file
  without the rows its vector deletes; the job commits the entry itself
  (`spark_jobs.core.own_commits`: at the checked snapshot's version + 1
  only, put with ``If-None-Match`` on S3), the state fence and the batch's
  metadata in it: delta-rs can commit neither change files written by
  others nor the removal of a file with a vector.

No batch is MERGEd by delta-spark: its MERGE of a change-feed state took
three times the join's commit, 82-94 s a batch over vectors at 20M keys,
and its commits are atomic on S3 only among one driver's writers
(docs/benchmarks.md "Chain upstream").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_jobs.core.folding import is_appended

if TYPE_CHECKING:
    from spark_jobs.core.spec import PipelineSpec
    from spark_jobs.sources import BatchRange

__all__ = [
    "EXECUTORS_FROM_BYTES", "executors_write", "merged_by_join", "read_by_spark",
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


def merged_by_join(spec: PipelineSpec) -> bool:
    """Whether a batch the executors merge into this state is merged by
    their join and committed by the job (`own_commits.commit_rewrite`): a
    merged state with a change data feed (the join writes its change data
    with the merged rows) or merged on read (`state.deletion_vectors: true`:
    the join reads its files without the rows their vectors delete; a state
    whose vectors outlived the setting, or that `auto` turned them on in,
    is seen in its log, `StateTable._merge_staged`). Measured against delta-spark's MERGE of
    the same batch (1M returning keys, docs/benchmarks.md "Chain
    upstream"), its commit took a third of the time; and it fences two
    drivers on S3, where delta-spark cannot."""
    merges = spec.state.change_feed or spec.state.deletion_vectors is True
    return merges and not is_appended(spec) and spec.engine.state_write != "driver"
