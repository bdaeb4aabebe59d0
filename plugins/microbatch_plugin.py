"""Registers the micro-batch console and the operator's console link with Airflow.

The one module of the plugins folder Airflow's plugin loader imports
(`.airflowignore` leaves the `microbatch_airflow` package to ordinary
imports). The console's FastAPI app is built on its first request
(`LazyConsole`), so the scheduler, workers and dag-processor, which load
plugins too, never import it.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from microbatch_airflow.console import CONSOLE_PREFIX, RUN_VIEW, LazyConsole
from microbatch_airflow.links import ConsoleLink


class MicrobatchPlugin(AirflowPlugin):
    name = "microbatch"
    fastapi_apps = [{"app": LazyConsole(), "url_prefix": CONSOLE_PREFIX, "name": "Micro-batch console"}]
    external_views = [
        {
            # Airflow's side navigation cuts labels at about nine characters
            # ("Micro-bat..."); the DAG's tab has room for the full name.
            "name": "Batches",
            "href": f"{CONSOLE_PREFIX}/",
            "destination": "nav",
            "url_route": "microbatch",
            "icon": f"{CONSOLE_PREFIX}/static/icon.svg",
        },
        {
            "name": "Micro-batches",
            "href": f"{CONSOLE_PREFIX}/?dag_id={{DAG_ID}}",
            "destination": "dag",
            "url_route": "microbatch-dag",
            "icon": f"{CONSOLE_PREFIX}/static/icon.svg",
        },
        {
            # A run's batch, opened: where task logs and the task's extra link point.
            "name": "Micro-batch",
            "href": f"{CONSOLE_PREFIX}/?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
            "destination": "dag_run",
            "url_route": RUN_VIEW,
            "icon": f"{CONSOLE_PREFIX}/static/icon.svg",
        },
    ]
    operator_extra_links = [ConsoleLink()]
