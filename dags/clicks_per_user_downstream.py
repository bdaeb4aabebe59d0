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
from microbatch_airflow.dag_factory import pipelines_dir, scan_specs

# The pipeline as the DAG factory serves it: a spec broken after a valid
# parse is its last valid version (its runs fail, its DAG and this one stay);
# its errors are microbatch_spec_errors.py's to report, not this file's.
UPSTREAM = scan_specs(pipelines_dir(Path(__file__).parent / "pipelines"), names={"clicks_per_user"}).specs.get("clicks_per_user")

if UPSTREAM is not None:
    with DAG(
        dag_id="clicks_per_user_downstream",
        schedule=[state_asset(UPSTREAM)],
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
