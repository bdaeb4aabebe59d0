"""The driver's class-data archive: used when present, harmless when wrong."""

from __future__ import annotations

from spark_jobs.engine import jvm_cache
from spark_jobs.demo.clickstream import write_wave
from tests.conftest import assert_exact, run_cli


def test_options_use_the_archive_only_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv(jvm_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(jvm_cache.OPTIONS_ENV, raising=False)
    assert jvm_cache.driver_java_options() == jvm_cache.SHORT_JOB_JVM_OPTIONS
    archive = jvm_cache.archive_path()
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(b"x")
    assert f"-XX:SharedArchiveFile={archive}" in jvm_cache.driver_java_options()
    assert jvm_cache.SHORT_JOB_JVM_OPTIONS not in jvm_cache.driver_java_options(short_lived=False)
    monkeypatch.setenv(jvm_cache.OPTIONS_ENV, "-Xmx1g")
    assert jvm_cache.driver_java_options() == "-Xmx1g"


def test_a_corrupt_archive_does_not_break_a_run(spec_path, tmp_path, monkeypatch):
    monkeypatch.setenv(jvm_cache.CACHE_ENV, str(tmp_path / "cache"))  # inherited by the CLI process
    monkeypatch.delenv(jvm_cache.OPTIONS_ENV, raising=False)
    archive = jvm_cache.archive_path()
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"not a class data archive" * 1000)
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=50)
    result = run_cli("run", str(spec_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "committed" in result.stdout
    assert_exact(spec_path)
