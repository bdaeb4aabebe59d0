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
to set it elsewhere). This module is that list. ``airflow`` comes first
because Python 3.11's forkserver starts with the interpreter's own
`sys.path`, not the scheduler's: importing Airflow puts the plugins folder
on it, and only then can this module be found. A module the forkserver
cannot import is skipped without a word (Python's rule) and every task
imports it itself, as before: `tests/plugins/test_airflow_live.py` checks
that the workers hold these modules.

It only imports: no session, no table, no client is made, so forking after
it stays safe (delta-rs's runtime, which is not fork-safe, starts at a
table's first open, inside the task). Then it freezes the objects made so
far out of garbage collection (`gc.freeze`), as Airflow's LocalExecutor does
before it forks its workers: a task, forked with them frozen, never walks
them again. Unfrozen, each full collection in a task walked the quarter of
a million objects these imports make, 0.3 CPU-s each (0.001 frozen), and
touched every page they sit on, copying it into the task.
"""

from __future__ import annotations

import gc

import airflow.sdk.execution_time.supervisor  # noqa: F401 - the worker's side of a task
import airflow.sdk.execution_time.task_runner  # noqa: F401 - the task's side
import pyspark.sql  # noqa: F401 - a driver of the task's own (engine local[*], spark://)
import pyspark.sql.connect.session  # noqa: F401 - pandas, pyarrow, gRPC: the Connect client

import microbatch_airflow.dag_factory  # noqa: F401 - the DAG file's import: operators, specs
import microbatch_airflow.lineage_facet  # noqa: F401 - OpenLineage's client, where lineage is sent
import spark_jobs.core.protocol  # noqa: F401 - the protocol, the ledger, delta-rs
import spark_jobs.engine.spark_compute  # noqa: F401
import spark_jobs.sources  # noqa: F401

gc.freeze()
