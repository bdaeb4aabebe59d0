"""`microbatch_airflow.celery_config`: Airflow's Celery settings, plus a task's imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SHOW = """
import json
import airflow
from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from microbatch_airflow.celery_config import CELERY_CONFIG
print(json.dumps({"differ": sorted(k for k in CELERY_CONFIG.keys() | DEFAULT_CELERY_CONFIG.keys()
                                    if CELERY_CONFIG.get(k) != DEFAULT_CELERY_CONFIG.get(k)),
                  "imports": list(CELERY_CONFIG["imports"])}))
"""


@pytest.mark.parametrize(("extra", "imports"), [
    ("{}", ["microbatch_airflow.task_imports"]),
    # Celery takes one module name as a string: it stays one name.
    ('{"imports": "json"}', ["json", "microbatch_airflow.task_imports"]),
    ('{"imports": ["json", "csv"]}', ["json", "csv", "microbatch_airflow.task_imports"]),
])
def test_airflows_celery_settings_with_a_tasks_imports_added(tmp_path, extra, imports):
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CELERY__EXTRA_CELERY_CONFIG": extra,
           "PYTHONPATH": f"{ROOT / 'plugins'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"differ": ["imports"], "imports": imports}
