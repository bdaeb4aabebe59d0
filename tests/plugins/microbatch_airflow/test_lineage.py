"""OpenLineage events for micro-batch tasks, through Airflow's OpenLineage
provider and its file transport, from a real `airflow dags test` process."""

from __future__ import annotations

import json
import os
import subprocess

from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from tests.conftest import ROOT
from tests.plugins.conftest import BIN


def _dags_test(spec_path, events) -> subprocess.CompletedProcess[str]:
    transport = {"type": "file", "log_file_path": str(events), "append": True}
    env = {
        **os.environ,
        "MICROBATCH_PIPELINES_DIR": str(spec_path.parent),
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "microbatch-tests",
        # Emit from a thread of the task process, not a fork of it: the
        # process holds a JVM and delta-rs's runtime, neither fork-safe.
        "AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD": "True",
    }
    return subprocess.run(
        [str(BIN / "airflow"), "dags", "test", load_spec(spec_path).name],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )


def _task_events(events, state: str) -> list[dict]:
    lines = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return [e for e in lines if e["eventType"] == state and e["job"]["name"].endswith(".run_batch")]


def test_a_committed_batch_is_reported_with_source_state_and_its_offsets(spec_path, airflow_db, tmp_path, on_connect):
    """The task's batch runs on the test process's shared Connect server
    (`on_connect`, inherited by `airflow dags test`): the events are the
    task's, whatever engine ran its batch."""
    events = tmp_path / "lineage.jsonl"
    write_wave(spec_path.parent / "landing", 0, files=2, records_per_file=100, bad_every=50)
    done = _dags_test(spec_path, events)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    spec = load_spec(spec_path)
    (complete,) = _task_events(events, "COMPLETE")
    assert [(d["namespace"], d["name"]) for d in complete["inputs"]] == [("file", spec.source_path)]
    assert [(d["namespace"], d["name"]) for d in complete["outputs"]] == [("file", spec.state_path)]
    facet = complete["run"]["facets"]["microbatch"]
    assert facet["status"] == "committed" and (facet["epoch"], facet["batchId"]) == (0, 1)
    assert facet["startOffsets"] == {"files": 0} and facet["endOffsets"] == {"files": 2}
    assert (facet["recordsIn"], facet["recordsQuarantined"], facet["stateVersion"]) == (200, 4, 1)
    assert facet["_schemaURL"].endswith("#/$defs/RunFacet")

    # Nothing new: the task is skipped, and its event says what it found.
    events.unlink()
    again = _dags_test(spec_path, events)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    (skipped,) = [e for e in _task_events(events, "COMPLETE") + _task_events(events, "ABORT") if "microbatch" in e["run"]["facets"]]
    assert skipped["run"]["facets"]["microbatch"]["status"] == "no_new_data"
