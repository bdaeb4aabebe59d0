"""`make airflow`'s kept PostgreSQL: where its data lives, and what deleting the Airflow home does."""

from __future__ import annotations

import os
import shutil

import pytest

from dev.postgres import PostgresServer


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user the data is in the home itself")
def test_deleting_the_airflow_home_as_root_starts_a_fresh_database(tmp_path):
    """Issue 49: run as root, the data lived in a temp folder named by the
    home's path only, so `rm -rf .airflow` kept the old runs."""
    pytest.importorskip("pwd").getpwnam("postgres")  # `make tools` installs the server and its user
    home = tmp_path / "home"
    first = PostgresServer._root_folder(home)
    first.mkdir()
    (first / "PG_VERSION").write_text("old")
    assert PostgresServer._root_folder(home) == first, "the same home keeps its database"
    shutil.rmtree(home)
    second = PostgresServer._root_folder(home)
    assert second != first and not first.exists(), "a new home has a new database, and the old one is gone"
    assert str(second).startswith(str(first)[: -len(first.name.rsplit("-", 1)[1])])
