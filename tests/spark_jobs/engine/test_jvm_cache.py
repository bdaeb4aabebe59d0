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
    # A long-lived session: the JVM's own compilers and collector, and the archive.
    assert jvm_cache.driver_java_options(short_lived=False) == jvm_cache._mapping(archive)
    monkeypatch.setenv(jvm_cache.OPTIONS_ENV, "-Xmx1g")
    assert jvm_cache.driver_java_options() == "-Xmx1g"


def test_a_catch_up_gets_a_long_lived_session(spec_path):
    """`microbatch run --catch-up` runs many batches on its session: its
    compute (and the driver launched for it) takes the long-lived flags."""
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine import compute_factory
    from spark_jobs.engine.session import session_options

    spec = load_spec(spec_path)
    assert compute_factory(spec, "local[1]", short_lived=False)()._short_lived is False
    assert compute_factory(spec, "local[1]")()._short_lived is True
    options = session_options("local[1]", "catch-up", short_lived=False)
    assert options["spark.sql.adaptive.enabled"] == "true"
    assert jvm_cache.SHORT_JOB_JVM_OPTIONS not in options["spark.driver.extraJavaOptions"]


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


def test_the_launcher_gets_its_archive_unless_the_user_set_its_options(tmp_path, monkeypatch):
    monkeypatch.setenv(jvm_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(jvm_cache.LAUNCHER_ENV, raising=False)
    assert jvm_cache.launcher_java_options() is None  # no archive yet: the launcher as Spark ships it
    archive = jvm_cache.launcher_archive_path()
    assert archive != jvm_cache.archive_path()
    archive.write_bytes(b"x")
    options = jvm_cache.launcher_java_options()
    assert options is not None and f"-XX:SharedArchiveFile={archive}" in options
    monkeypatch.setenv(jvm_cache.LAUNCHER_ENV, "-Xmx64m")
    assert jvm_cache.launcher_java_options() is None


def test_the_archives_follow_the_java_binary(tmp_path, monkeypatch):
    """A new or upgraded JDK (another binary, or the same path rewritten) gets
    new archive names: a stale archive is never even offered to it."""
    monkeypatch.setenv(jvm_cache.CACHE_ENV, str(tmp_path / "cache"))
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("a")
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    jvm_cache._java_identity.cache_clear()
    try:
        first = jvm_cache.archive_path(), jvm_cache.launcher_archive_path()
        java.write_text("an upgrade")
        jvm_cache._java_identity.cache_clear()
        second = jvm_cache.archive_path(), jvm_cache.launcher_archive_path()
        assert first[0] != second[0] and first[1] != second[1]
        monkeypatch.setenv("JAVA_HOME", str(tmp_path / "elsewhere"))
        jvm_cache._java_identity.cache_clear()
        assert jvm_cache.archive_path() not in (first[0], second[0])
    finally:
        jvm_cache._java_identity.cache_clear()
