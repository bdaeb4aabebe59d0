"""Airflow DAGs: one per pipeline spec in MICROBATCH_PIPELINES_DIR (default dags/pipelines/).

Thin on purpose: the factory (plugins/microbatch_airflow/dag_factory.py)
builds each DAG from its spec; nothing here touches Delta or Spark.

A task process imports this file to find the one DAG it runs, and Airflow
names it (`get_parsing_context().dag_id`): only that DAG is built there, so
a task's start-up does not grow with the number of pipelines. The
dag-processor (no DAG id) builds them all.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import get_parsing_context

from microbatch_airflow.dag_factory import dags_from_folder, pipelines_dir

globals().update(dags_from_folder(pipelines_dir(Path(__file__).parent / "pipelines"), only=get_parsing_context().dag_id))
