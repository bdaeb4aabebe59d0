"""The CeleryExecutor's Celery settings: Airflow's own, and a task's imports made once per worker.

A Celery worker forks its pool processes, and each task is forked again
from one of them: what the worker's main process imported before it forked
its pool, a task has at no cost. Celery imports the modules of its
``imports`` setting there, at the worker's start, so
``[celery] celery_config_options = microbatch_airflow.celery_config.CELERY_CONFIG``
does for Celery what the forkserver's preload does for the LocalExecutor
(`microbatch_airflow.task_imports`). Set by `make airflow EXECUTOR=celery`,
the compose file's `celery` profile and the live Celery tests.
"""

from __future__ import annotations

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

__all__ = ["CELERY_CONFIG"]

CELERY_CONFIG = {
    **DEFAULT_CELERY_CONFIG,
    "imports": [*DEFAULT_CELERY_CONFIG.get("imports", ()), "microbatch_airflow.task_imports"],
}
