"""`microbatch_airflow.task_imports` as the LocalExecutor's forkserver uses it:
one process imports it, then tasks are forked from it (the live tests check
that Airflow's workers hold the modules; `tests/plugins/test_airflow_live.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

TASKS = """
import gc, json, os, sys
import microbatch_airflow.task_imports
frozen = gc.get_freeze_count()
tasks = []
for i in range(3):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a task: delta-rs's runtime starts here, after the fork
        import numpy
        import pyarrow as pa
        from deltalake import DeltaTable, QueryBuilder, write_deltalake
        path = f"{sys.argv[1]}/state_{i}"
        write_deltalake(path, pa.table({"key": [f"user{i}", "other"], "total": [i, 1]}))
        write_deltalake(path, pa.table({"key": ["late"], "total": [2]}), mode="append")
        rows = pa.table(QueryBuilder().register("s", DeltaTable(path)).execute("SELECT sum(total) AS t, count(*) AS n FROM s").read_all())
        frozen_now = gc.get_freeze_count()
        # A run_on_data pipeline's source asset: its scheme's normalizer is
        # looked up among the providers', discovered by the preload.
        from airflow.sdk import Asset
        before = set(sys.modules)
        source = Asset(name=f"microbatch.p{i}.new_data", uri=f"microbatch://p{i}/new_data")
        asset_imports = sorted(set(sys.modules) - before)
        parse_counted = None
        if "microbatch_airflow.dag_factory" in sys.modules:
            # The DAG file's parse knows the imports are frozen without
            # counting them (a walk over every frozen object).
            from microbatch_airflow.dag_factory import _older_objects_frozen
            counted = []
            gc.get_freeze_count = lambda: counted.append(1) or frozen_now
            with _older_objects_frozen():
                pass
            parse_counted = len(counted)
        os.write(write, json.dumps({"rows": rows.to_pylist(), "frozen": frozen_now, "parse_counted": parse_counted, "asset_imports": asset_imports, "asset_uri": source.uri, "random": numpy.random.rand()}).encode())
        os._exit(0)
    tasks.append((pid, read))
done = []
for pid, read in tasks:
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    done.append(json.loads(os.read(read, 10000)))
print(json.dumps({"frozen": frozen, "tasks": done, "modules": sorted(m for m in ("airflow.dag_processing.dagbag", "deltalake", "grpc", "pandas", "microbatch_airflow.dag_factory") if m in sys.modules)}))
"""


def _run(tmp_path, **env: str) -> dict:
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path / "home"), "PYTHONPATH": f"{ROOT / 'plugins'}{os.pathsep}{ROOT}", **env}
    done = subprocess.run([sys.executable, "-c", TASKS, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # (Where the warning goes is Airflow's logging's choice: either stream.)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "said": done.stdout + done.stderr}


def test_tasks_forked_after_the_imports_write_and_read_delta_tables(tmp_path):
    found = _run(tmp_path)
    # (The task runner's own parse of the DAG file imports Airflow's DagBag: 0.5 CPU-s.)
    assert found["modules"] == ["airflow.dag_processing.dagbag", "deltalake", "grpc", "microbatch_airflow.dag_factory", "pandas"]
    # Three tasks at once, each wrote and read its own table.
    assert [task["rows"] for task in found["tasks"]] == [[{"t": i + 3, "n": 3}] for i in range(3)]
    # The imports' objects stay frozen out of garbage collection in the tasks.
    assert found["frozen"] > 100_000 and all(task["frozen"] > found["frozen"] // 2 for task in found["tasks"])
    assert [task["parse_counted"] for task in found["tasks"]] == [0, 0, 0]
    # The providers' asset URI handlers were found once, before the fork:
    # a task's first asset imports nothing.
    assert [task["asset_imports"] for task in found["tasks"]] == [[], [], []]
    assert [task["asset_uri"] for task in found["tasks"]] == [f"microbatch://p{i}/new_data" for i in range(3)]
    # numpy is seeded again in each task, as Python's random is: no two draw the same.
    assert len({task["random"] for task in found["tasks"]}) == 3


def test_a_module_that_fails_to_import_is_left_to_the_tasks(tmp_path):
    """A broken setting read at import (here by the sensor's class) must not
    stop the forkserver, and so every worker: it is logged, the rest are
    imported, and the tasks import that module themselves."""
    found = _run(tmp_path, AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE="maybe")
    assert "not imported ahead of the tasks: microbatch_airflow.dag_factory" in found["said"], found["said"][-3000:]
    assert "default_deferrable" in found["said"]
    assert found["modules"] == ["airflow.dag_processing.dagbag", "deltalake", "grpc", "pandas"]
    assert [task["rows"] for task in found["tasks"]] == [[{"t": i + 3, "n": 3}] for i in range(3)]


ONCE_BROKEN = """
import json, os, sys
class Broken:  # the S3 handler's module fails to import while the forkserver starts, once
    def find_spec(self, name, path=None, target=None):
        if name == "airflow.providers.amazon.aws.assets.s3":
            raise ImportError("a passing failure")
sys.meta_path.insert(0, Broken())
import microbatch_airflow.task_imports
sys.meta_path.pop(0)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    from airflow.sdk import Asset
    try:  # the S3 handler refuses a URI without a bucket
        found = Asset(name="state", uri="s3:///lake/state").uri
    except ValueError as exc:
        found = f"refused: {exc}"
    os.write(write, found.encode())
    os._exit(0)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
print(json.dumps({"uri": os.read(read, 1000).decode()}))
"""


def test_a_handler_missing_at_the_preload_is_looked_for_by_each_task(tmp_path):
    """Airflow records its providers' discovery as done even when a
    handler's module failed to import: inherited, every task would keep an
    S3 state asset's URI as written, unlike the dag-processor's, until the
    forkserver restarts (``s3:///lake/state`` taken as ``s3:/lake/state``).
    The preload drops such a discovery instead."""
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path / "home"), "PYTHONPATH": f"{ROOT / 'plugins'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", ONCE_BROKEN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["uri"].startswith("refused: "), done.stdout[-2000:]
    assert "no asset URI handler found ahead of the tasks for s3" in done.stdout + done.stderr
