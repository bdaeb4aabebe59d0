"""The console's own calls to Airflow (its pages and API are tested in a live
Airflow and in Chromium: tests/plugins/test_airflow_live.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("settings", "root"),
    [
        ({"AIRFLOW__API__BASE_URL": "https://airflow.example.com/team/"}, "https://airflow.example.com/team"),
        ({"AIRFLOW__API__HOST": "0.0.0.0", "AIRFLOW__API__PORT": "8793"}, "http://127.0.0.1:8793"),
        ({"AIRFLOW__API__HOST": "10.1.2.3", "AIRFLOW__API__PORT": "9000", "AIRFLOW__API__BASE_URL": "/airflow"}, "http://10.1.2.3:9000/airflow"),
        ({"AIRFLOW__API__HOST": "::1", "AIRFLOW__API__PORT": "8080", "AIRFLOW__API__SSL_CERT": "/etc/cert.pem"}, "https://[::1]:8080"),
    ],
    ids=["base_url", "any-address", "path-only-base_url", "ipv6-tls"],
)
def test_the_rewind_calls_airflow_where_the_configuration_says(monkeypatch, settings, root):
    """Not where the request's Host header says: a forged Host would get the
    caller's token and the trigger (the live test forges one)."""
    from microbatch_airflow.console import airflow_root

    for name in ("AIRFLOW__API__BASE_URL", "AIRFLOW__API__HOST", "AIRFLOW__API__PORT", "AIRFLOW__API__SSL_CERT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    assert airflow_root() == root


def test_a_probe_that_hangs_shows_as_probing_and_holds_up_no_other():
    """The console's status probes: in parallel, answered from cache, and a
    source that does not answer is shown as "probing" until it does."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from microbatch_airflow.console.probes import Probes

    release = threading.Event()
    calls: list[str] = []

    def probe(spec):
        calls.append(spec.name)
        if spec.name == "unreachable" and not release.is_set():
            release.wait(30)
        return {"name": spec.name, "status": "up to date", "answer": len(calls)}

    specs = [SimpleNamespace(name=n, spec_path=f"/specs/{n}.yaml") for n in ("a", "unreachable", "b")]
    probes = Probes(probe, workers=4, fresh_s=3600, wait_s=0.5)
    try:
        first = asyncio.run(probes.summaries(specs))
        assert [(s["name"], s["status"], s["probing"]) for s in first] == [
            ("a", "up to date", False), ("unreachable", "probing", True), ("b", "up to date", False),
        ]
        assert first[1]["probed_at"] is None and first[0]["probed_at"] is not None
        # Fresh values are not probed again; the hung probe is not started twice.
        again = asyncio.run(probes.summaries(specs))
        assert sorted(calls) == ["a", "b", "unreachable"] and again[1]["status"] == "probing"
        release.set()
        for _ in range(100):
            if not asyncio.run(probes.summaries(specs))[1]["probing"]:
                break
            threading.Event().wait(0.05)
        last = asyncio.run(probes.summaries(specs))
        assert last[1]["status"] == "up to date" and last[1]["probe_age_s"] is not None
        # A stale value is shown at once, with its age, while it is probed again.
        probes.fresh_s = probes.mean_probe_s = 0
        (stale,) = asyncio.run(probes.summaries(specs[:1]))
        assert stale["name"] == "a" and stale["probed_at"] == last[0]["probed_at"] and stale["probe_age_s"] is not None
        for _ in range(100):
            if calls.count("a") == 2:
                break
            threading.Event().wait(0.05)
        assert calls.count("a") == 2
        # A caller who sees fewer pipelines forgets nobody's; a spec that is gone is forgotten.
        probes.fresh_s = 3600
        asyncio.run(probes.summaries(specs[1:]))
        assert asyncio.run(probes.summaries(specs[:1]))[0]["probed_at"] is not None and calls.count("a") == 2
        probes.forget_all_but(specs[1:])
        asyncio.run(probes.summaries(specs[:1]))
        assert calls.count("a") == 3  # probed anew
    finally:
        release.set()
        probes.close()


def test_a_downstream_whose_upstream_has_no_table_yet_is_waiting_not_broken(tmp_path):
    """Issue 49: it showed a red "problem" ("is not a Delta table ... create
    it, or fix source.path"); it is only waiting for its upstream."""
    from microbatch_airflow.console.app import _waiting_for_upstreams
    from spark_jobs.core.spec import load_spec
    from tests.conftest import oracle_spec_dict, write_spec

    up = load_spec(write_spec(tmp_path, oracle_spec_dict(name="up"), "up.yaml"))
    def reading(name: str, source: str):
        """A pipeline whose Delta source is the table at `source`."""
        return load_spec(write_spec(tmp_path, {
            "name": name,
            "source": {"type": "delta", "path": source},
            "transform": "SELECT user_id, events FROM batch",
            "state": {"path": f"lake/{name}", "keys": ["user_id"], "merge": {"events": "sum"}},
            "checkpoint": f"lake/_checkpoints/{name}",
        }, f"{name}.yaml"))

    down, lost = reading("down", "lake/state"), reading("lost", "lake/nowhere")
    missing = "source table file:///x is not a Delta table (or does not exist yet); create it, or fix source.path"
    results = [
        {"name": "up", "status": "new", "problems": []},
        {"name": "down", "status": "problem", "problems": [missing]},
        {"name": "lost", "status": "problem", "problems": [missing]},
    ]
    _waiting_for_upstreams(results, {s.name: s for s in (up, down, lost)})
    assert results[1] == {"name": "down", "status": "waiting", "problems": [
        "waiting for up's first batch: its state table, this pipeline's source, does not exist yet"]}
    assert results[2]["status"] == "problem", "no pipeline writes that table: a real problem"
    assert results[0]["status"] == "new"


def test_a_commit_is_shown_on_the_next_request_even_beside_a_probe_that_hangs(tmp_path):
    """Issue 65: the row said "batch 1 (checked 5 min ago)" 44 s after batch 2
    committed, beside a batch table showing batch 2. A value probed before
    the ledger moved is never reused: the next request probes again (even
    while an older probe hangs) and waits for that answer."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from microbatch_airflow.console.probes import Probes, ledger_mark

    log = tmp_path / "offsets" / "_delta_log"
    spec = SimpleNamespace(name="p", spec_path="/specs/p.yaml", ledger_path=str(tmp_path / "offsets"))
    assert ledger_mark(spec) is None  # no ledger yet
    release = threading.Event()
    calls: list[object] = []

    def probe(spec):
        mark = ledger_mark(spec)
        calls.append(mark)
        if len(calls) == 2:
            release.wait(30)  # the second probe hangs (a slow source)
        return {"name": spec.name, "status": "up to date", "batch": mark}

    probes = Probes(probe, mark=ledger_mark, workers=4, fresh_s=3600, wait_s=1)
    try:
        assert asyncio.run(probes.summaries([spec]))[0]["batch"] is None
        log.mkdir(parents=True)
        (log / "00000000000000000000.json").write_text("{}")
        assert asyncio.run(probes.summaries([spec]))[0]["batch"] is None, "the probe of the new mark hangs: the old value shows"
        (log / "00000000000000000001.json").write_text("{}")
        shown = asyncio.run(probes.summaries([spec]))[0]
        assert shown["batch"] == "00000000000000000001.json", "a probe beside the hung one answered for the newest commit"
        release.set()
        for _ in range(100):
            if len(calls) == 3 and not asyncio.run(probes.summaries([spec]))[0]["probing"]:
                break
            threading.Event().wait(0.05)
        assert asyncio.run(probes.summaries([spec]))[0]["batch"] == "00000000000000000001.json", "the hung probe's late answer is older: not kept"
        assert len(calls) == 3, "a value at the current mark is fresh: no more probes"
    finally:
        release.set()
        probes.close()


def test_a_source_not_there_yet_is_a_wait_before_the_first_batch_and_a_problem_after(tmp_path, compute):
    """Issue 65: on a fresh `make airflow` the example whose landing folder
    nothing had written showed red. Before its first batch a missing source
    is something it waits for; once it has committed, a problem."""
    import shutil

    from microbatch_airflow.console.app import _summary
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import write_wave
    from tests.conftest import oracle_spec_dict, write_spec

    spec = load_spec(write_spec(tmp_path, oracle_spec_dict()))
    shutil.rmtree(tmp_path / "landing")
    first = _summary(spec)
    assert first["status"] == "waiting" and first["batch_id"] == 0, first
    assert first["problems"] == [f"waiting for its source (no batch yet): source folder {spec.source_path} does not exist "
                                 "or is not a folder; create it or fix source.path in the spec"]
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=10)
    run_batch(spec, RunOptions(run_id="r1"), compute)
    assert _summary(spec)["status"] == "up to date"
    shutil.rmtree(tmp_path / "landing")
    gone = _summary(spec)
    assert gone["status"] == "problem" and "does not exist" in gone["problems"][0]


def test_a_windowed_pipeline_s_summary_says_what_its_final_rows_hold(tmp_path, compute):
    """The console's pipeline line names the table of final rows, its rows and
    the watermark it was brought to (console.js shows `final`)."""
    from microbatch_airflow.console.app import _summary
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from tests.spark_jobs.core.test_windows import WAVES, _land, _spec

    spec_path = _spec(tmp_path)
    spec = load_spec(spec_path)
    assert _summary(spec)["final"] == {"path": spec.final_path, "rows": 0, "through": None, "batch_id": None}
    _land(spec_path, "f0", WAVES[0])
    run_batch(spec, RunOptions(run_id="r1"), compute)
    assert _summary(spec)["final"] == {"path": spec.final_path, "rows": 2, "through": "2026-12-01T10:30:00Z", "batch_id": 1}


def test_a_state_merged_on_read_is_named_in_its_summary_and_status(tmp_path, compute, capsys):
    """Once the state's table declares deletion vectors (`true`; `auto` past
    its bound), readers older than Delta 2.3 cannot read it: the console's
    line and `microbatch status` say so. A small state with the default
    settings (`auto`) is copy-on-write: neither says it."""
    from microbatch_airflow.console.app import _summary
    from spark_jobs.cli import main
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import write_wave
    from tests.conftest import oracle_spec_dict, write_spec

    said = "state: merged on read (Delta deletion vectors): its readers need Delta 2.3 or later"
    for vectors in ("auto", True):
        folder = tmp_path / str(vectors)
        folder.mkdir()
        spec_dict = oracle_spec_dict()
        spec_dict["state"]["deletion_vectors"] = vectors
        spec_path = write_spec(folder, spec_dict)
        spec = load_spec(spec_path)
        assert _summary(spec)["merged_on_read"] is False
        write_wave(folder / "landing", 0, files=1, records_per_file=10)
        run_batch(spec, RunOptions(run_id="r1"), compute)
        assert _summary(spec)["merged_on_read"] is (vectors is True)
        capsys.readouterr()
        assert main(["status", str(spec_path)]) == 0
        assert (said in capsys.readouterr().out) is (vectors is True)
