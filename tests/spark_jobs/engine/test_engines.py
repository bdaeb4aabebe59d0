"""The job on a Spark standalone cluster (via spark-submit) and over Spark Connect.

Both servers are real JVMs started on loopback from pyspark's own jars
(`tests.spark_servers`). Totals are checked against the oracle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_jobs.demo.clickstream import write_wave
from tests.conftest import ROOT, assert_exact, oracle_spec_dict, run_cli, write_spec
from tests.spark_servers import SPARK_HOME, spark_env, start_cluster, start_connect


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    server, master = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield master
    server.stop()


@pytest.fixture(scope="module")
def connect_server(shared_connect_server):
    """The test process's shared server: what these tests check is a
    server's sessions and its clients, not its start (which is
    `test_a_connect_server_starts_from_a_process_that_was_a_connect_client`'s)."""
    return shared_connect_server


@pytest.fixture(scope="module")
def connect(connect_server):
    return connect_server[1]


def _spark_submit(master: str, *args: str, conf: dict[str, str], work: Path):
    command = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", master]
    for key, value in conf.items():
        command += ["--conf", f"{key}={value}"]
    command += [str(ROOT / "spark_jobs" / "__main__.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, env=spark_env(work), timeout=600, cwd=ROOT)


def _on(master: str) -> dict[str, str]:
    """A CLI run's environment with its engine `master`."""
    return {**os.environ, "MICROBATCH_SPARK_MASTER": master}


def _task_ends(app_log: Path) -> list[dict]:
    """SparkListenerTaskEnd events of one application's event log (a folder in v2)."""
    files = sorted(app_log.glob("events_*")) if app_log.is_dir() else [app_log]
    events = (json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip())
    return [e for e in events if e.get("Event") == "SparkListenerTaskEnd"]


# A second batch on the cluster (another application, about a minute) in
# `make soak`: `make test`'s batches after the first are the other engines'.
@pytest.mark.parametrize("waves", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_spark_submit_to_a_standalone_cluster_reads_on_executors_and_is_exact(cluster, connect, tmp_path, waves):
    spec_path = write_spec(tmp_path, oracle_spec_dict())
    landing = tmp_path / "landing"
    events = tmp_path / "events"
    events.mkdir()
    conf = {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": events.as_uri(),
        "spark.eventLog.compress": "false",  # Spark 4 compresses by default
        # Small splits so each file of the batch is its own read task.
        "spark.sql.files.maxPartitionBytes": "65536",
        "spark.sql.files.openCostInBytes": "65536",
        "spark.executor.memory": "1g",
    }
    for wave in range(waves):
        write_wave(landing, wave, files=4, records_per_file=1500, users=80, seed=11, bad_every=300)
        result = _spark_submit(cluster, "run", str(spec_path), "--json", conf=conf, work=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        # spark-submit merges the driver's stderr (our log lines) into stdout.
        outcome = json.loads(result.stdout[result.stdout.index("{\n") :])
        assert outcome["status"] == "committed" and outcome["records_in"] == 6000, outcome
    # (Asked of the shared Connect server: a local run would start a JVM to find nothing.)
    assert json.loads(run_cli("run", str(spec_path), "--json", env=_on(connect)).stdout)["status"] == "no_new_data"
    lineage = assert_exact(spec_path)
    assert len(lineage) == waves

    app_logs = sorted(events.iterdir())
    assert len(app_logs) == waves  # one application per run
    for app_log in app_logs:
        tasks = _task_ends(app_log)
        assert tasks, f"no tasks in {app_log}"
        # Every task ran on the cluster's executor, none in the driver...
        assert {t["Task Info"]["Executor ID"] for t in tasks} == {"0"}, {t["Task Info"]["Executor ID"] for t in tasks}
        # ...and the read was split: some stage ran one task per file.
        per_stage: dict[int, int] = {}
        for t in tasks:
            per_stage[t["Stage ID"]] = per_stage.get(t["Stage ID"], 0) + 1
        assert max(per_stage.values()) >= 4, per_stage


def test_spark_connect_runs_are_exact_and_cheaper_than_starting_spark(connect, tmp_path):
    spec_path = write_spec(tmp_path, oracle_spec_dict(engine={"master": connect}))
    landing = tmp_path / "landing"
    timings = []
    for wave in range(3):
        write_wave(landing, wave, files=2, records_per_file=2000, users=100, seed=5, bad_every=400)
        started = time.monotonic()
        result = run_cli("run", str(spec_path), "--json")
        timings.append(time.monotonic() - started)
        assert result.returncode == 0, result.stderr[-3000:]
        outcome = json.loads(result.stdout)
        assert outcome["status"] == "committed" and outcome["records_in"] == 4000, outcome
        assert "connecting to Spark Connect" in result.stderr
    lineage = assert_exact(spec_path)
    assert len(lineage) == 3
    # The figure (not asserted: speed belongs to bench/): a warm Connect run vs a local start.
    print(f"connect runs: {', '.join(f'{t:.1f}' for t in timings)} s", file=sys.stderr)


def test_connect_sessions_share_compiled_code(connect_server, tmp_path):
    """Every Airflow task is a new Connect session. Spark's own server class
    gives each session its own class loader, and so compiles each session's
    code anew. The project's server (`spark_jobs/engine/connect_server.py`)
    lets sessions share one: a second pipeline's first batch, in a process
    and a session of its own, compiles nothing that the first one compiled."""
    server, url = connect_server
    log = server.logs[0]
    specs = []
    for name in ("first", "second"):
        spec_path = write_spec(tmp_path / name, oracle_spec_dict(name=name, engine={"master": url}))
        write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=500, users=20, seed=3)
        specs.append(spec_path)

    def compiled() -> int:
        return log.read_text(errors="replace").count("CodeGenerator: Code generated in")

    first = run_cli("run", str(specs[0]), "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    before = compiled()
    assert before > 0, f"{log} shows no compiled code: the check below would prove nothing"
    second = run_cli("run", str(specs[1]), "--json")
    assert second.returncode == 0, second.stderr[-3000:]
    assert compiled() == before, f"the second session compiled {compiled() - before} classes again ({log})"
    for spec_path in specs:
        assert_exact(spec_path)


def test_a_connect_server_starts_from_a_process_that_was_a_connect_client(connect, tmp_path, monkeypatch):
    """PySpark marks a process that opened a Connect session in its
    environment (`SPARK_CONNECT_MODE_ENABLED`, set here as PySpark sets it:
    this process may hold a classic session, which refuses a remote one),
    and a server started from
    it inherits the marks: the project's server (a PySpark driver) drops
    them. Its sessions share code and keep a thousand compiled classes
    unless told otherwise (read by a client of its own, as a task is)."""
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    server, url = start_connect(tmp_path / "second")
    try:
        read = (
            "import sys\nfrom pyspark.sql import SparkSession\n"
            "s = SparkSession.builder.remote(sys.argv[1]).getOrCreate()\n"
            "print(s.conf.get('spark.sql.artifact.isolation.enabled'), s.conf.get('spark.sql.codegen.cache.maxEntries'))\n"
            "s.stop()"
        )
        out = subprocess.run([sys.executable, "-c", read, url], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == ["false", "1000"], out.stdout
    finally:
        server.stop()


def test_a_batch_of_bad_records_only_is_quarantined_over_connect_as_locally(connect, compute, tmp_path):
    """A CSV file whose every line has too few or too many columns: no valid
    record, so adaptive execution drops the transform's stage, and a Connect
    server reports the observed metrics with no values where a local session
    reports none (a break-it review found such a batch failing, every retry
    alike). The records are counted apart, and the batch ends as on a local
    session (the test process's, `local[2]` with adaptive execution on)."""
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec

    schema = "event_id STRING, user_id STRING NOT NULL, amount DOUBLE, n BIGINT"
    outcomes = {}
    for engine in ("local", "connect"):
        folder = tmp_path / engine
        spec_path = write_spec(folder, oracle_spec_dict(
            name="csv_bad", engine={"master": connect if engine == "connect" else "local[2]"},
            source={"type": "files", "path": "landing", "format": "csv", "schema": schema},
            transform="SELECT user_id, count(*) AS events, sum(amount) AS amount FROM batch GROUP BY user_id",
            state={"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum", "amount": "sum"}},
        ))
        (folder / "landing").mkdir(exist_ok=True)
        (folder / "landing" / "a.csv").write_text("event_id,user_id,amount,n\nb,u1\nc,u1,1,2,extra\nd\n")
        if engine == "local":
            done = run_batch(load_spec(spec_path), RunOptions(run_id="local"), compute_factory=compute)
            outcomes[engine] = {"status": str(done.status), "records_in": done.records_in, "records_quarantined": done.records_quarantined}
            continue
        result = run_cli("run", str(spec_path), "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        outcome = json.loads(result.stdout)
        outcomes[engine] = {k: outcome[k] for k in ("status", "records_in", "records_quarantined")}
    assert outcomes["connect"] == outcomes["local"], outcomes
    assert outcomes["connect"] == {"status": "committed", "records_in": 3, "records_quarantined": 3}, outcomes


def test_engine_master_on_the_command_line_wins_over_the_spec(connect, tmp_path):
    spec_path = write_spec(tmp_path, oracle_spec_dict(engine={"master": "spark://127.0.0.1:1"}))
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=300, users=20)
    result = run_cli("run", str(spec_path), "--master", connect, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["status"] == "committed"
    assert_exact(spec_path)


# Both in `make soak`: the cluster reads on executors in make test already
# (the standalone test above), and storage/test_s3.py's runs are the shared
# Connect server's clients, whose objects that server fetches.
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["cluster", "connect"])
def test_an_s3_pipeline_runs_exact_on_the_cluster_and_over_connect(request, engine, tmp_path, bucket):
    """Source and tables on S3 (moto); the objects are fetched by the executors (cluster) or the server (Connect)."""
    from tests.conftest import upload_folder
    from tests.spark_jobs.storage.test_s3 import _s3_spec

    master = request.getfixturevalue(engine)
    spec_path = _s3_spec(tmp_path, bucket)
    mirror = tmp_path / "mirror"
    for wave in range(2):
        write_wave(mirror, wave, files=2, records_per_file=500, users=50, seed=wave, bad_every=90)
        upload_folder(mirror, f"s3://{bucket}/landing/clicks")
        result = run_cli("run", str(spec_path), "--master", master, "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        outcome = json.loads(result.stdout)
        assert outcome["status"] == "committed" and outcome["records_in"] == 1000, outcome
    lineage = assert_exact(spec_path, mirror=mirror)
    assert len(lineage) == 2


@pytest.mark.parametrize(
    ("engine", "reader"),
    # The cluster's case (3 min) in `make soak`: delta-spark's JARs reaching a
    # cluster's executors are test_delta_spark_reads_the_state_on_the_cluster's,
    # Spark's reader is `auto`'s over Connect.
    [pytest.param("cluster", "spark", marks=pytest.mark.slow), ("connect", "auto"), ("connect", "driver")],
)
def test_a_chain_is_exact_on_the_cluster_and_over_connect(request, engine, reader, tmp_path):
    """`source.reader: spark` on each engine (over Connect as `auto`
    resolves it): delta-spark reads the upstream's change feed on the
    cluster's executors (its JARs shipped by `spark.jars`) or on the Connect
    server (started with them), and no row comes to the job's process. And
    the driver's reader over Connect, whose check of the transform over no
    rows once failed there (Connect cannot infer a schema from an empty table)."""
    from tests.conftest import assert_chain_exact, chain_specs

    master = request.getfixturevalue(engine)
    upstream, downstream = chain_specs(tmp_path, reader=reader)
    for wave in range(2):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=200, users=30, seed=wave)
        # The upstream's batches on the shared Connect server: what this checks is the downstream's read.
        upstream_run = run_cli("run", str(upstream), "--json", env=_on(request.getfixturevalue("connect")))
        assert upstream_run.returncode == 0, upstream_run.stderr[-3000:]
        assert json.loads(upstream_run.stdout)["status"] == "committed"
    for _ in range(5):  # the upstream's versions, at most two a batch (`max_versions`), then nothing new
        result = run_cli("run", str(downstream), "--master", master, "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        if json.loads(result.stdout)["status"] == "no_new_data":
            break
        assert ("read by delta-spark on the executors" in result.stderr) == (reader != "driver"), result.stderr[-3000:]
    assert_chain_exact(upstream, downstream)


_READ_DELTA = """
import json, sys
from spark_jobs.engine.session import default_session
master, path = sys.argv[1:]
spark = default_session(master, short_lived=False, delta=True)
rows = spark.read.format("delta").load(path).orderBy("user_id").collect()
print(json.dumps([[r.user_id, r.events] for r in rows]))
"""


def test_delta_spark_reads_the_state_on_the_cluster(cluster, connect, tmp_path):
    """A Delta-querying session's delta-spark JARs reach a cluster's executors
    (`spark.jars`). (A Connect server started with them serves Delta too:
    tests/test_topology.py reads every state through one, on a cluster.)"""
    spec_path = write_spec(tmp_path, oracle_spec_dict())
    write_wave(tmp_path / "landing", 0, files=2, records_per_file=300, users=25)
    # The state is committed on the shared Connect server; what this checks is the read.
    assert json.loads(run_cli("run", str(spec_path), "--json", env=_on(connect)).stdout)["status"] == "committed"
    state = tmp_path / "lake" / "state"
    assert_exact(spec_path)
    expected = sorted([r["user_id"], r["events"]] for r in _state_rows(state))
    script = tmp_path / "read_delta.py"
    script.write_text(_READ_DELTA)
    result = subprocess.run([sys.executable, str(script), cluster, str(state)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def _state_rows(path: Path) -> list[dict]:
    from deltalake import DeltaTable

    from spark_jobs.core.delta_io import read_all, rows_of

    return rows_of(read_all(DeltaTable(str(path))))


@pytest.mark.slow
def test_windows_and_dedup_on_the_cluster_are_the_oracle_s(cluster, tmp_path):
    """Event time on a standalone cluster (issue 66, item 7): the executors
    read, judge late records, drop duplicates and aggregate into windows;
    each batch a `microbatch run` of its own. Each file carries its newest
    click twice, and the file before's newest once more (a producer's
    retries, none of them late): the final rows and the state are the
    oracle's of the clicks sent once, and each batch counts its retries."""
    from tests.spark_jobs.core.test_windows import WAVES, Oracle, _check, _edit, _land, _spec

    spec_path = _spec(tmp_path)
    _edit(spec_path, lambda spec: spec.update(dedup={"key": ["event_id"]}))
    oracle, before, duplicates = Oracle(), [], []
    for n, minutes in enumerate(WAVES):
        records = _land(spec_path, f"f{n}", minutes)
        oracle.batch(records)
        with (spec_path.parent / "landing" / f"f{n}.json").open("a") as out:
            out.writelines(json.dumps(r) + "\n" for r in [records[-1], *before])
        before = [records[-1]]  # (each wave's last click is its newest)
        result = run_cli("run", str(spec_path), "--master", cluster, "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        outcome = json.loads(result.stdout)
        assert outcome["status"] == "committed"
        duplicates.append(outcome["records_duplicate"])
    assert duplicates == [1, 2, 2, 2, 2]
    _check(spec_path, oracle)
