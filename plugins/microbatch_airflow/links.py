"""`ConsoleLink`: from a task instance of a pipeline to its batch in the micro-batch console."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from microbatch_airflow.console import CONSOLE_PREFIX, airflow_root

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

__all__ = ["ConsoleLink", "console_url"]


def console_url(dag_id: str, run_id: str) -> str:
    """The console page of a run's batch, absolute (for task logs, which
    link only full URLs): where the console itself reaches Airflow."""
    return f"{airflow_root()}{_path(dag_id, run_id)}"


def _path(dag_id: str, run_id: str) -> str:
    return f"{CONSOLE_PREFIX}/?dag_id={quote(dag_id)}&run_id={quote(run_id)}"


class ConsoleLink(BaseOperatorLink):
    """The console page of the task's pipeline, with the batch its run made
    highlighted (the page finds it by run id in the ledger)."""

    name = "Micro-batch console"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return _path(ti_key.dag_id, ti_key.run_id)
