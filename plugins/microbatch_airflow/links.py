"""`ConsoleLink`: from a task instance of a pipeline to its batch in the micro-batch console."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from microbatch_airflow.console import CONSOLE_PREFIX

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

__all__ = ["ConsoleLink"]


class ConsoleLink(BaseOperatorLink):
    """The console page of the task's pipeline, with the batch its run made
    highlighted (the page finds it by run id in the ledger)."""

    name = "Micro-batch console"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return f"{CONSOLE_PREFIX}/?dag_id={quote(ti_key.dag_id)}&run_id={quote(ti_key.run_id)}"
