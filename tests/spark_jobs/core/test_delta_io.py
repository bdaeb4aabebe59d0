"""`spark_jobs.core.delta_io`: how the job reads a commit's metadata."""

from __future__ import annotations

import json

from spark_jobs.core.commits import METADATA_KEY
from spark_jobs.core.delta_io import with_user_metadata
from spark_jobs.core.fencing import STATE_FENCE


def test_a_commit_by_delta_spark_reads_as_the_job_s_own_and_a_user_s_as_theirs():
    """A state whose big batches an earlier version had delta-spark MERGE
    (until 2026-12-04) holds commits whose batch metadata is in delta-spark's
    `userMetadata`: `with_user_metadata` reads it as delta-rs's commit info
    holds it, only when the commit's own `txn` moves the state fence to that
    metadata's position. A user's write whose text names `microbatch` stays
    an outside change (found by a review: a user's UPDATE with
    `{"microbatch": "hotfix"}` was taken for the job's and merged over)."""
    ours = json.dumps({"txn": 5, "pipeline": "p"})
    fenced = [{"txn": {"appId": STATE_FENCE, "version": 5}}]
    info = {"operation": "MERGE", "userMetadata": json.dumps({METADATA_KEY: ours})}
    assert with_user_metadata(info, fenced)[METADATA_KEY] == ours
    assert METADATA_KEY not in with_user_metadata(info, []), "no txn: a user's"
    assert METADATA_KEY not in with_user_metadata(info, [{"txn": {"appId": STATE_FENCE, "version": 6}}])
    for text in ('{"microbatch": "hotfix by ops"}', "{not json", "nightly load", '{"microbatch": "{}"}', "[1]"):
        assert METADATA_KEY not in with_user_metadata({"userMetadata": text}, fenced), text
