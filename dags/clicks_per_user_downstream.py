"""Example downstream DAG: runs whenever `clicks_per_user` commits a batch.

Data-aware scheduling on the state table's asset; the triggering events carry
the batch id, offsets and state version as extra. The pipeline adds its
events through an asset alias, and Airflow lists each such event under the
asset *and* under the alias: a consumer must count each event once, by
(pipeline, epoch, batch) as `new_batches` does, or it processes every batch
twice.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG, task

from microbatch_airflow.assets import new_batches, state_asset
from microbatch_airflow.dag_factory import pipelines_dir
from spark_jobs.core.spec import load_spec

SPEC = pipelines_dir(Path(__file__).parent / "pipelines") / "clicks_per_user.yaml"

if SPEC.exists():
    with DAG(
        dag_id="clicks_per_user_downstream",
        schedule=[state_asset(load_spec(SPEC))],
        tags=["microbatch", "example"],
        doc_md=__doc__,
    ):

        @task
        def report_new_batches(triggering_asset_events=None) -> list[dict]:
            """Log (and return) the batches that triggered this run."""
            seen = new_batches(triggering_asset_events)
            for extra in seen:
                print(f"{extra.get('pipeline')}: batch {extra.get('batch_id')} (epoch {extra.get('epoch')}) "
                      f"state version {extra.get('state_version')} offsets {extra.get('end_offsets')}")
            return seen

        report_new_batches()
