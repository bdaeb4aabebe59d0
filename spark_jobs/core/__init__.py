"""The checkpoint core: spec, the commit protocol and its steps, the tables.

Start at `spark_jobs.core.protocol`: its docstring tells the protocol as five
numbered steps, and the module implements them as five functions. The rest
of this package is what those steps stand on: the offset ledger
(`ledger`), the keyed state (`state`), the quarantine (`quarantine`), fences
(`fencing`), the typed commit metadata (`commits`) and delta-rs helpers
(`delta_io`). Nothing here imports Spark or Airflow; compute and sources
come in through the `Compute` and `Source` protocols.
"""
