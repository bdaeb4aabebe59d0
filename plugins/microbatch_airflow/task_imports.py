"""What a micro-batch task imports, for the process that forks the tasks to import first.

Airflow's LocalExecutor runs each task in a process forked from one of its
long-lived workers: whatever that worker imported, a task has at no cost, and
whatever it did not, every task imports again. A batch on the shared Spark
Connect engine imported about 2 CPU-s of modules (the DAG factory and the
operator, the protocol and delta-rs, pyarrow, pandas, gRPC and Spark
Connect's client): more than the batch's own work, on every file of a fleet
(docs/fleet.md, "Where a task's CPU goes").

Airflow 3.3 can start those workers from a forkserver that imports a list of
modules once (``[scheduler] mp_start_method = forkserver`` and
``mp_forkserver_preload = airflow,microbatch_airflow.task_imports``: set by
`make airflow`, the compose file and the live tests; docs/fleet.md says how
to set it elsewhere); a Celery worker imports it before it forks its pool
(`microbatch_airflow.celery_config`). ``airflow`` comes first because Python
3.11's forkserver starts with the interpreter's own `sys.path`, not the
scheduler's: importing Airflow puts the plugins folder on it, and only then
can this module be found. A preload module that cannot be found is skipped
without a word (Python's rule): `tests/plugins/test_airflow_live.py` checks
that the workers hold these modules.

After the modules, the preload has Airflow find its providers' asset URI
handlers, which Airflow does once a process, at the first asset with a
scheme other than ``file`` (a `run_on_data` pipeline's source asset is
``microbatch://``): the modules that hold them are imported (boto3's and
botocore's among them, for ``s3``). In each task that was about 0.1
CPU-s here, and under a fleet's load 40% of the task process's profile
(docs/fleet.md, "What a task pays before its batch"). Airflow records
the discovery as done even when a handler's module failed to import (it
logs it), and a task would then keep a URI that handler normalizes as
written, for as long as the forkserver lives: so when a provider's
declared scheme has no handler afterwards, the discovery is dropped and
each task makes its own, as without the preload.

Each module is imported on its own, and one that fails (a broken setting
read at import, say) is logged and left to the tasks, which then import it
themselves and fail with its error as before: an exception out of a
forkserver's preload would stop it, and with it every worker's start.

Nothing here opens a table or a session, so forking after it stays safe
(delta-rs's runtime, which is not fork-safe, starts at a table's first open,
inside the task). The imports do start native threads of their own (the
allocators' background threads of pyarrow and delta-rs, numpy's BLAS
pool); a fork copies only the calling thread, and on Python 3.11 that is
all. Then:

* numpy's global random state, seeded once at its import, is seeded again
  in each forked child, as Python's `random` is: otherwise every task of
  the LocalExecutor, of any DAG, would draw the same numbers.
* the objects made so far are frozen out of garbage collection
  (`gc.freeze`), as Airflow's LocalExecutor does before it forks its
  workers: a task, forked with them frozen, never walks them again.
  Unfrozen, each full collection in a task walked the quarter of a million
  objects these imports make, 0.3 CPU-s each (0.001 frozen), and touched
  every page they sit on, copying it into the task.

The forking process keeps the modules it imported: after an upgrade of the
project's code, restart the scheduler (or the Celery workers) for tasks to
run the new code.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys

__all__ = ["MODULES"]

#: What a task imports, heaviest first.
MODULES = (
    "airflow.sdk.execution_time.supervisor",  # the worker's side of a task
    "airflow.sdk.execution_time.task_runner",  # the task's side
    # The task runner imports it to parse the DAG file: Airflow's ORM models
    # and serialization, about 0.3 CPU-s a task (docs/fleet.md).
    "airflow.dag_processing.dagbag",
    "pyspark.sql",  # a driver of the task's own (engine local[*], spark://)
    "pyspark.sql.connect.session",  # pandas, pyarrow, gRPC: the Connect client
    "microbatch_airflow.dag_factory",  # the DAG file's import: operators, specs
    "microbatch_airflow.lineage_facet",  # OpenLineage's client, where lineage is sent
    "spark_jobs.core.protocol",  # the protocol, the ledger, delta-rs
    "spark_jobs.engine.spark_compute",
    "spark_jobs.sources",
    "pyarrow.dataset",  # the batch's reads and the state's merge
)

log = logging.getLogger(__name__)

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:
        log.warning("not imported ahead of the tasks: %s (each task imports it itself)", _name, exc_info=True)


def _find_asset_uri_handlers() -> None:
    """Have Airflow find its providers' asset URI handlers, in the singleton
    the tasks forked after this inherit; drop that discovery again when a
    provider's scheme has no handler (its module failed to import)."""
    try:
        from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

        manager = ProvidersManagerTaskRuntime()
        declared = {
            scheme
            for provider in manager.providers.values()
            for uris in provider.data.get("asset-uris", [])
            if "handler" in uris
            for scheme in uris.get("schemes", [])
        }
        missing = sorted(declared - set(manager.asset_uri_handlers))
        if not missing:
            return
        log.warning("no asset URI handler found ahead of the tasks for %s (each task looks)", ", ".join(missing))
    except Exception:
        log.warning("providers' asset URI handlers not found ahead of the tasks (each task looks)", exc_info=True)
    runtime = sys.modules.get("airflow.sdk.providers_manager_runtime")
    if runtime is not None:  # a singleton of its own for each task, as without the preload
        runtime.ProvidersManagerTaskRuntime._instance = None
        runtime.ProvidersManagerTaskRuntime._initialized = False


_find_asset_uri_handlers()


def _reseed_numpy() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


os.register_at_fork(after_in_child=_reseed_numpy)
gc.freeze()
