"""Airflow DAGs: one per pipeline spec in MICROBATCH_PIPELINES_DIR (default dags/pipelines/).

Thin on purpose: the factory (plugins/microbatch_airflow/dag_factory.py)
builds each DAG from its spec; nothing here touches Delta or Spark.
"""

from __future__ import annotations

from pathlib import Path

from microbatch_airflow.dag_factory import dags_from_folder, pipelines_dir

globals().update(dags_from_folder(pipelines_dir(Path(__file__).parent / "pipelines")))
