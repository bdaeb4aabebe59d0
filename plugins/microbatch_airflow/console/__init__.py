"""The checkpoint console: the pipelines' ledgers, lag, quarantine and state
versions in the Airflow UI, served by the API server under ``/microbatch``.

`LazyConsole` is what the plugin registers. Every Airflow component loads
plugins (scheduler, workers, dag-processor, triggerer), and only the API
server serves the console, so FastAPI and the auth code are imported on the
first request, not at plugin load.
"""

from __future__ import annotations

from typing import Any

from microbatch_airflow.urls import CONSOLE_PREFIX, RUN_VIEW, airflow_root

__all__ = ["CONSOLE_PREFIX", "RUN_VIEW", "LazyConsole", "airflow_root"]


class LazyConsole:
    """An ASGI app that builds the console's FastAPI app on its first call."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._app is None:
            from microbatch_airflow.console.app import create_app

            self._app = create_app()
        await self._app(scope, receive, send)
