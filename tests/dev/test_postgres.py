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


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user the data is in the home itself")
def test_a_home_from_before_the_token_keeps_its_database_and_stop_creates_nothing(tmp_path, monkeypatch):
    """Found by trying to break the above: the first start after the change
    deleted a kept home's database (named by the home alone), and `stop` on
    a missing home made the home and deleted its database."""
    pytest.importorskip("pwd").getpwnam("postgres")
    import hashlib
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)
    home = tmp_path / "home"
    home.mkdir()
    (home / "airflow.cfg").write_text("[core]\n")
    legacy = tmp_path / "temp" / f"microbatch-airflow-pg-{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]}"
    legacy.mkdir()
    (legacy / "PG_VERSION").write_text("16")
    assert PostgresServer._root_folder(home) == legacy and (legacy / "PG_VERSION").exists()
    assert PostgresServer._root_folder(home) == legacy, "and keeps it"
    gone = tmp_path / "gone"
    looked = PostgresServer.kept(gone, start=False)
    looked.stop()
    assert not gone.exists() and legacy.exists(), "stop on a missing home makes nothing and removes nothing"
