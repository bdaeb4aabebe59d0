"""`ConsoleLink`: from a task instance of a pipeline to its batch in the micro-batch console."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from microbatch_airflow.urls import RUN_VIEW, airflow_root

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

__all__ = ["ConsoleLink", "console_url"]


def console_url(dag_id: str, run_id: str) -> str:
    """The console page of a run's batch, absolute (for task logs, which
    link only full URLs): where the console itself reaches Airflow."""
    return f"{airflow_root()}{_path(dag_id, run_id)}"


def _path(dag_id: str, run_id: str) -> str:
    """The console's tab on the run's page in Airflow's UI (inside Airflow's
    frame, not the bare console page), its batch highlighted and opened."""
    return f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/plugin/{RUN_VIEW}"


class ConsoleLink(BaseOperatorLink):
    """The console's tab on the task's run, with the batch the run made
    highlighted and opened (the page finds it by run id in the ledger)."""

    name = "Micro-batch console"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return _path(ti_key.dag_id, ti_key.run_id)
