"""Example downstream DAG: runs whenever `clicks_per_user` commits a batch.

Data-aware scheduling on the state table's asset; the triggering events carry
the batch id, offsets and state version as extra.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG, task

from microbatch_airflow.assets import state_asset
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
            seen = []
            for asset, events in (triggering_asset_events or {}).items():
                for event in events:
                    print(f"{asset.name}: batch {event.extra.get('batch_id')} "
                          f"state version {event.extra.get('state_version')} offsets {event.extra.get('end_offsets')}")
                    seen.append(dict(event.extra))
            return seen

        report_new_batches()
