"""Exactly-once Spark micro-batches with a Delta offset ledger and Delta state.

`spark_jobs` has no Airflow imports: the orchestrator passes the window and
run identity in (`protocol.RunOptions`). Start reading at `protocol`.
"""

from __future__ import annotations

__version__ = "0.1.0"
