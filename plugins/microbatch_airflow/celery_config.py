"""The CeleryExecutor's Celery settings: Airflow's own, and a task's imports made once per worker.

A Celery worker forks its pool processes, and each task is forked again
from one of them: what the worker's main process imported before it forked
its pool, a task has at no cost. Celery imports the modules of its
``imports`` setting there, at the worker's start, so
``[celery] celery_config_options = microbatch_airflow.celery_config.CELERY_CONFIG``
does for Celery what the forkserver's preload does for the LocalExecutor
(`microbatch_airflow.task_imports`). Set by `make airflow EXECUTOR=celery`,
the compose file's `celery` profile and the live Celery tests.

It is the global configuration with one setting added, so it is not for
one team of a multi-team deployment (``AIRFLOW__<TEAM>___CELERY__...``):
Airflow gives a team its own broker only when the option names Airflow's
default object, and this is a copy.
"""

from __future__ import annotations

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.utils.functional import maybe_list

__all__ = ["CELERY_CONFIG"]

CELERY_CONFIG = {
    **DEFAULT_CELERY_CONFIG,
    # Celery takes one module name as a string too ([celery] extra_celery_config).
    "imports": [*(maybe_list(DEFAULT_CELERY_CONFIG.get("imports")) or ()), "microbatch_airflow.task_imports"],
}
