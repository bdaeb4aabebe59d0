"""A run that will likely find nothing new launches no driver JVM (`engine/idle_hint.py`).

Real CLI runs on a real folder and a real Delta table in `tmp_path`; the
hint's folder is the test's own (`MICROBATCH_CACHE_DIR`)."""

from __future__ import annotations

import json
import os

import yaml

from deltalake import DeltaTable

from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.engine.idle_hint import IdleHint
from tests.conftest import assert_exact, chain_specs, oracle_spec_dict, run_cli, write_spec

SKIPPED = "no early driver launch"  # logged at DEBUG: `--verbose`


def _run(spec_path, env) -> tuple[str, str]:
    result = run_cli("--verbose", "run", str(spec_path), "--json", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)["status"], result.stderr


def test_idle_runs_launch_no_jvm_until_data_lands_or_a_rewind(tmp_path, monkeypatch, compute):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    env = {**os.environ, "MICROBATCH_CACHE_DIR": str(tmp_path / "cache")}
    spec_path = write_spec(tmp_path, oracle_spec_dict())
    landing = tmp_path / "landing"
    write_wave(landing, 0, files=1, records_per_file=100, users=10)
    # The first batch in process (the JVMs started here are the subject: each costs seconds).
    assert run_batch(load_spec(spec_path), RunOptions(run_id="first"), compute_factory=compute).status == "committed"
    status, err = _run(spec_path, env)
    assert status == "no_new_data" and SKIPPED not in err, "no hint yet: launched early as before"
    status, err = _run(spec_path, env)
    assert status == "no_new_data" and SKIPPED in err, "nothing arrived since a run found nothing: no JVM"
    write_wave(landing, 1, files=1, records_per_file=100, users=10)
    status, err = _run(spec_path, env)
    assert status == "committed" and SKIPPED not in err, "a file landed: the listing changed"
    assert not list((tmp_path / "cache" / "idle").iterdir()), "a run that processed a batch forgets the hint"
    # The hint a run that found nothing leaves (the second run's, above).
    IdleHint(load_spec(spec_path)).record(idle=True)
    # A rewind makes consumed files new again without touching the folder;
    # it writes the ledger, whose newest entry is in the fingerprint.
    assert run_cli("rewind", str(spec_path), "--to-batch", "1", env=env).returncode == 0
    status, err = _run(spec_path, env)
    assert status == "committed" and SKIPPED not in err
    assert_exact(spec_path)
    # And a run that finds a batch while the hint says idle (the hint left by
    # a run on another copy of the folder, say) still processes it.
    assert run_cli("rewind", str(spec_path), "--to-batch", "1", env=env).returncode == 0
    IdleHint(load_spec(spec_path)).record(idle=True)
    status, err = _run(spec_path, env)
    assert status == "committed" and SKIPPED in err
    assert_exact(spec_path)


def test_fingerprints_follow_the_source_and_exist_only_where_they_are_local(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(tmp_path / "cache"))
    upstream, downstream = chain_specs(tmp_path)
    files = load_spec(upstream)
    (tmp_path / "landing").mkdir(exist_ok=True)
    IdleHint(files).record(idle=True)
    assert IdleHint(files).unchanged()
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=10, users=2)
    assert not IdleHint(files).unchanged(), "a new file changes the folder's fingerprint"

    delta = load_spec(downstream)
    DeltaTable.create(delta.source_path, _schema())
    IdleHint(delta).record(idle=True)
    assert IdleHint(delta).unchanged()
    DeltaTable(delta.source_path).alter.set_table_properties({"delta.appendOnly": "false"})  # a new log entry
    assert not IdleHint(delta).unchanged(), "a new version changes a Delta source's fingerprint"

    kafka_file = tmp_path / "kafka.yaml"
    kafka_file.write_text(yaml.safe_dump({**oracle_spec_dict(), "source": {
        "type": "kafka", "bootstrap_servers": "127.0.0.1:1", "topic": "t", "format": "text"}}))
    kafka = load_spec(kafka_file)
    s3 = load_spec(write_spec(tmp_path, oracle_spec_dict(source={**oracle_spec_dict()["source"], "path": "s3://b/landing"}), "s3.yaml"))
    for remote in (kafka, s3):
        IdleHint(remote).record(idle=True)
        assert not IdleHint(remote).unchanged(), f"{remote.source.type}: no fingerprint, so always launched early"


def _schema():
    import pyarrow as pa

    return pa.schema([("k", pa.string())])
