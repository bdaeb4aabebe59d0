"""Airflow fixtures: a migrated SQLite metadata database in the session's AIRFLOW_HOME."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def airflow_db():
    result = subprocess.run([str(BIN / "airflow"), "db", "migrate"], capture_output=True, text=True, env=os.environ.copy())
    assert result.returncode == 0, result.stderr[-3000:]
    return os.environ["AIRFLOW_HOME"]
