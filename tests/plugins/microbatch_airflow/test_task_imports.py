"""`microbatch_airflow.task_imports` as the LocalExecutor's forkserver uses it:
one process imports it, then tasks are forked from it (the live tests check
that Airflow's workers hold the modules; `tests/plugins/test_airflow_live.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

TASKS = """
import gc, os, sys
import microbatch_airflow.task_imports
frozen = gc.get_freeze_count()
tasks = []
for i in range(3):
    pid = os.fork()
    if pid == 0:  # a task: delta-rs's runtime starts here, after the fork
        import pyarrow as pa
        from deltalake import DeltaTable, QueryBuilder, write_deltalake
        path = f"{sys.argv[1]}/state_{i}"
        write_deltalake(path, pa.table({"key": [f"user{i}", "other"], "total": [i, 1]}))
        write_deltalake(path, pa.table({"key": ["late"], "total": [2]}), mode="append")
        rows = pa.table(QueryBuilder().register("s", DeltaTable(path)).execute("SELECT sum(total) AS t, count(*) AS n FROM s").read_all())
        os._exit(0 if rows.to_pylist() == [{"t": i + 3, "n": 3}] and gc.get_freeze_count() > frozen // 2 else 3)
    tasks.append(pid)
print(frozen, [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in tasks])
"""


def test_tasks_forked_after_the_imports_write_and_read_delta_tables(tmp_path):
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path / "home"), "PYTHONPATH": f"{ROOT / 'plugins'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", TASKS, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    frozen, codes = done.stdout.strip().splitlines()[-1].split(" ", 1)
    # The imports' objects are frozen out of garbage collection, and each task
    # (three at once) wrote and read its own table.
    assert int(frozen) > 100_000 and codes == "[0, 0, 0]", done.stdout
