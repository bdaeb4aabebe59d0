"""Import errors for broken pipeline specs, kept apart from the pipelines' DAGs.

Airflow's dag-processor marks every DAG of a file with an import error stale
(gone from the UI, not triggerable). Raising here, in a file that defines no
DAG, shows each broken spec's file, line and field under "DAG Import Errors"
while `microbatch_pipelines.py` keeps serving the valid pipelines.
"""

from __future__ import annotations

from pathlib import Path

from microbatch_airflow.dag_factory import pipelines_dir, raise_spec_errors

raise_spec_errors(pipelines_dir(Path(__file__).parent / "pipelines"))
