"""A batch MERGEd into a merged state by delta-spark, on the executors.

For a state with a change data feed (`write_path.merged_by_delta_spark`):
the executors have written the batch's updates as Parquet files into the
state's folder (`spark_jobs.core.staged`); one ``MERGE INTO`` by delta-spark
then merges them into the state by the spec's rules
(`state.merge_expression`) and writes the change files (``update_preimage``
/ ``update_postimage`` / ``insert``) with the rows, on the executors. The
driver commits one version.

The protocol's commit point is unchanged: delta-spark's idempotent writes
(``spark.databricks.delta.write.txnAppId`` / ``txnVersion``, delta-io/delta
PR 1555) put the state fence's ``txn`` action in that commit, and
``spark.databricks.delta.commitInfo.userMetadata`` the batch's metadata
(`spark_jobs.core.delta_io.commit_info` reads it back as delta-rs's own).
What the fence relies on, verified here with delta-spark 4.4 on a table
delta-rs created (tests/spark_jobs/engine/test_delta_merge.py repeats it):

* a MERGE whose fence version the table already holds, or a later one, is
  skipped: no commit (a run that lost the race does nothing);
* a commit carrying the same app id that lands while the MERGE runs, at any
  version, fails it with ``ConcurrentTransactionException`` (delta-spark
  reads the app id's version when it checks for the skip, and its conflict
  checker fails a transaction whose read app id a winner wrote): a zombie,
  or a racing run, cannot commit, as with delta-rs (`spark_jobs.core.fencing`);
* a compaction that lands meanwhile fails it with
  ``ConcurrentAppendException``: step 4 merges again from a fresh snapshot,
  as after delta-rs's conflict;
* a blind append of no fence (a tool's) lets it commit after it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from spark_jobs.core.spec import BATCH_COLUMN, PipelineSpec
from spark_jobs.core.sql_text import spark_identifier
from spark_jobs.core.staged import Staged
from spark_jobs.core.state import merge_expression

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["TXN_APP_ID", "TXN_VERSION", "USER_METADATA", "has_delta_spark", "merge"]

log = logging.getLogger("microbatch")

TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


def has_delta_spark(spark: SparkSession) -> bool:
    """Whether `spark` runs Delta's SQL (its extension is set: a session
    started with delta-spark, or a Connect server that was)."""
    try:
        return "DeltaSparkSessionExtension" in (spark.conf.get("spark.sql.extensions", "") or "")
    except Exception:  # noqa: BLE001 - a server that will not say has none for us
        return False


def merge(spark: SparkSession, spec: PipelineSpec, updates: Staged, fence: tuple[str, int], user_metadata: str) -> None:
    """`updates` (files in the state's folder, in its types, `_batch_id`
    last) MERGEd into the state table `spec.state_path` by delta-spark, in
    one commit carrying `fence` and `user_metadata`; or skipped, if the
    table's fence reads that version or a later one. Raises delta-spark's
    concurrency errors as they come (`delta_io.is_commit_conflict` knows them)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    spark = _own_settings(spark)
    root = Path(spec.state_path)
    source = spark.read.schema(from_arrow_schema(updates.schema)).parquet(*(str(root / f.path) for f in updates.files))
    view = f"microbatch_merge_{uuid.uuid4().hex}"
    source.createOrReplaceTempView(view)
    try:
        with _fenced(spark, fence, user_metadata):
            spark.sql(merge_sql(spec, [f.name for f in updates.schema], str(root.resolve()), view))
    finally:
        spark.catalog.dropTempView(view)


def merge_sql(spec: PipelineSpec, columns: list[str], path: str, view: str) -> str:
    """The MERGE of the batch's rows in `view` into the Delta table at `path`,
    by the spec's rules: what delta-rs's MERGE does (`StateTable.commit_batch`),
    in Spark's dialect."""
    q = spark_identifier
    on = " AND ".join(f"t.{q(k)} = s.{q(k)}" for k in spec.state.keys)
    sets = [f"t.{q(c)} = {merge_expression(c, rule, quote=q)}" for c, rule in spec.state.merge.items() if c in columns]
    sets.append(f"t.{q(BATCH_COLUMN)} = s.{q(BATCH_COLUMN)}")
    names = ", ".join(q(c) for c in columns)
    values = ", ".join(f"s.{q(c)}" for c in columns)
    table = "`" + path.replace("`", "``") + "`"
    return (
        f"MERGE INTO delta.{table} AS t USING {view} AS s ON {on} "
        f"WHEN MATCHED THEN UPDATE SET {', '.join(sets)} "
        f"WHEN NOT MATCHED THEN INSERT ({names}) VALUES ({values})"
    )


def _own_settings(spark: SparkSession) -> SparkSession:
    """A session whose settings are this MERGE's alone: the fence's settings
    hold for the whole session, and another thread's write in it (an
    application that shares one session between pipelines) must not carry
    them. A classic session's `newSession` shares the JVM, the cache and
    Delta's extension; a Spark Connect client has no such thing, and each
    client is a session of its own on the server."""
    try:
        return spark.newSession()
    except Exception:  # noqa: BLE001 - Spark Connect: not supported, the client's own session
        return spark


@contextmanager
def _fenced(spark: SparkSession, fence: tuple[str, int], user_metadata: str) -> Iterator[None]:
    """The session's next Delta commit carries `fence` and `user_metadata`;
    the settings are gone after it, whatever happened (a later write of the
    session must not carry them)."""
    app_id, version = fence
    spark.conf.set(TXN_APP_ID, app_id)
    spark.conf.set(TXN_VERSION, str(version))
    spark.conf.set(USER_METADATA, user_metadata)
    try:
        yield
    finally:
        for key in (TXN_VERSION, TXN_APP_ID, USER_METADATA):
            spark.conf.unset(key)
