"""Airflow glue for `spark_jobs`: operator, sensor, trigger, assets, DAG factory.

Lives in the plugins folder, which Airflow puts on `sys.path` for the
scheduler, dag-processor, workers and triggerer alike (the triggerer must be
able to import the trigger class by its path). Nothing here opens a Delta
table or starts Spark at import time: delta-rs's runtime is not fork-safe and
DAG parsing must stay fast.
"""
