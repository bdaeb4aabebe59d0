"""Shared fixtures: a real Spark session, real Delta tables in tmp_path.

Nothing here is mocked. In-process tests share one local Spark session (the
JVM start is the slow part); crash and race tests run the real `microbatch`
CLI in subprocesses, one JVM each, exactly as an Airflow task would.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from spark_jobs.demo.clickstream import ORACLE_MERGE, ORACLE_TRANSFORM

ROOT = Path(__file__).resolve().parents[1]
TEST_AWS_KEY_ID = "microbatch-test-key"
TEST_AWS_SECRET = "microbatch-test-secret-9f3c1e"  # noqa: S105 - fake, for moto only


def pytest_configure(config):
    """A private Airflow home (SQLite) for the session, set before Airflow is imported."""
    import tempfile

    home = tempfile.mkdtemp(prefix="microbatch-airflow-home-")
    os.environ["AIRFLOW_HOME"] = home
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
    os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
    os.environ["AIRFLOW__LOGGING__LOGGING_LEVEL"] = "WARNING"
    # The states' key directories (`core.key_directory`) in the session's own folder, not the user's cache.
    config.microbatch_keys = os.environ["MICROBATCH_KEY_DIRECTORY"] = tempfile.mkdtemp(prefix="microbatch-keys-")
    # S3 tests talk to moto's server on loopback. Credentials are set before
    # any JVM starts so Spark's Python workers inherit them (they fetch S3
    # objects with boto3's chain); they are fake, and distinctive so tests can
    # prove they never reach logs or tables. A developer's real AWS profile
    # and endpoint are kept out of the suite.
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)
    os.environ["AWS_ACCESS_KEY_ID"] = TEST_AWS_KEY_ID
    os.environ["AWS_SECRET_ACCESS_KEY"] = TEST_AWS_SECRET
    os.environ["AWS_REGION"] = "us-east-1"
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull


def pytest_unconfigure(config):
    """The session's key directories removed (each xdist worker made its own)."""
    import shutil

    folder = getattr(config, "microbatch_keys", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


#: The test files that take minutes in `make test` (their tests' wall time
#: summed, 2026-12-03, `make test-costs`, less what moved to `make soak` that
#: day), longest first. pytest-xdist hands whole files to its processes in
#: collection order (`make test`: `--dist loadfile`), so these start first
#: and the short files fill in at the end, instead of one process running a
#: long file alone at the end while the other idles.
LONG_FILES = (
    "tests/spark_jobs/engine/test_engines.py",
    "tests/spark_jobs/engine/test_merge_over_vectors.py",
    "tests/plugins/test_airflow_live.py",
    "tests/spark_jobs/test_chaos.py",
    "tests/spark_jobs/test_crash_and_race.py",
    "tests/spark_jobs/engine/test_delta_spark.py",
    "tests/spark_jobs/engine/test_spark_state.py",
    "tests/plugins/test_airflow_celery.py",
    "tests/spark_jobs/sources/test_kafka.py",
    "tests/spark_jobs/sources/test_kafka_broker.py",
    "tests/spark_jobs/engine/test_native_read.py",
    "tests/spark_jobs/storage/test_s3.py",
    "tests/spark_jobs/core/test_folding.py",
    "tests/spark_jobs/test_bad_input.py",
    "tests/spark_jobs/engine/test_idle_hint.py",
    "tests/spark_jobs/engine/test_state_write_types.py",
    "tests/spark_jobs/core/test_protocol.py",
    "tests/spark_jobs/core/test_catch_up.py",
    "tests/spark_jobs/engine/test_delta_read.py",
    "tests/spark_jobs/core/test_state_commit_guards.py",
    "tests/plugins/microbatch_airflow/test_hooks.py",
    "tests/test_make_airflow.py",
    "tests/spark_jobs/core/test_storage_faults.py",
    "tests/spark_jobs/core/test_dedup.py",
)


def pytest_collection_modifyitems(config, items):
    """The long files first (`LONG_FILES`); the rest keep their order, as do the tests within a file."""
    missing = [name for name in LONG_FILES if not (ROOT / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONG_FILES names files that do not exist: {missing}")
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback (a real HTTP S3 API), for the whole session."""
    from spark_jobs.storage import s3 as storage

    server = subprocess.Popen(
        [sys.executable, "-m", "tests.moto_server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    line = server.stdout.readline()
    assert line.startswith("PORT "), f"moto server did not start: {line!r}"
    endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # inherited by CLI subprocesses
    storage.reset()
    yield endpoint
    os.environ.pop("AWS_ENDPOINT_URL", None)
    storage.reset()
    server.stdin.close()
    server.wait(30)


@pytest.fixture
def bucket(s3_endpoint, request) -> str:
    """A fresh bucket for one test."""
    import hashlib
    import re

    from spark_jobs.storage.s3 import s3_client

    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]  # parametrized names differ only at the end
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + f"-{digest}-{os.getpid()}"
    s3_client().create_bucket(Bucket=name)
    return name


def upload_folder(folder: Path, uri: str) -> None:
    """Copy the ready files under `folder` to the S3 prefix `uri`, oldest first."""
    from spark_jobs.storage.s3 import S3Location, s3_client

    target = S3Location.parse(uri)
    files = sorted((p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
    client = s3_client()
    for path in files:
        key = f"{target.key.rstrip('/')}/{path.relative_to(folder).as_posix()}"
        client.put_object(Bucket=target.bucket, Key=key, Body=path.read_bytes())


@pytest.fixture(scope="session")
def spark():
    from spark_jobs.engine import jvm_cache
    from spark_jobs.engine.session import default_session

    # A long-lived session (adaptive execution on, as a shared engine runs),
    # in a JVM that compiles with C1 alone and collects serially, as a
    # one-batch run's JVM does: the suite's JVM runs some two thousand small
    # jobs on two cores, where C2's and the parallel collector's threads cost
    # more than they return (13% less CPU for the in-process tests, 2026-12-02,
    # docs/testing.md). Set only while the JVM starts: the CLI runs a test
    # makes take the product's own options.
    options = f"{jvm_cache.SHORT_JOB_JVM_OPTIONS} {jvm_cache.driver_java_options(short_lived=False)}".strip()
    environment = dict(os.environ)
    os.environ[jvm_cache.OPTIONS_ENV] = options
    try:
        session = default_session("local[2]", app_name="microbatch-tests", short_lived=False, delta=True)
    finally:
        # And what starting the session set for itself (the Python workers'
        # interpreter, the driver's address) is not the CLI runs' either.
        os.environ.clear()
        os.environ.update(environment)
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def _shared_session_as_it_was(request):
    """A test that used the process's shared session (`spark`, `compute`)
    leaves it as it found it: the settings it (or the code it ran) set are
    put back and its temporary views dropped, so a later test cannot pass
    on a setting it did not make (delta_read sets one for the session, as
    a one-batch run may)."""
    if "spark" not in request.fixturenames:
        yield
        return
    spark = request.getfixturevalue("spark")
    settings = spark.conf.getAll
    views = _temporary_views(spark)
    yield
    now = spark.conf.getAll
    for key in now.keys() - settings.keys():
        spark.conf.unset(key)
    for key, value in settings.items():
        if now.get(key) != value:
            spark.conf.set(key, value)
    for view in _temporary_views(spark) - views:
        spark.catalog.dropTempView(view)


def _temporary_views(spark) -> set[str]:
    # SHOW VIEWS, not `spark.catalog.listTables()`: the catalog's listing
    # builds a table object for each name, some 0.3 s a call here, twice for
    # each of the suite's hundreds of tests on this session; SHOW VIEWS, 0.03.
    return {row.viewName for row in spark.sql("SHOW VIEWS").collect() if row.isTemporary}


@pytest.fixture(scope="session")
def shared_connect_server(tmp_path_factory):
    """One Spark Connect server for the test process (the project's server,
    `tests.spark_servers.start_connect`), started when a test first needs it.

    A `microbatch run` in a process of its own pays for a JVM's start and its
    JIT each time (about 10 CPU-s here); as a thin client of a running
    server, under 2. Tests that kill the job's Python process at a fault
    point, race runs or drive the CLI through chaos (what they check is the
    protocol, not a process's start-up) run their CLIs against this server,
    as a fleet on a shared engine runs in production (`on_connect`). Each
    run is a session of its own on the server, and each test has its own
    folders: nothing of one test is visible to the next."""
    from tests.spark_servers import start_connect

    server, url = start_connect(tmp_path_factory.mktemp("shared-connect"))
    yield server, url
    server.stop()


@pytest.fixture(scope="session")
def shared_connect(shared_connect_server) -> str:
    """The URL of the process's shared Connect server (`shared_connect_server`)."""
    return shared_connect_server[1]


@pytest.fixture
def on_connect(shared_connect, monkeypatch) -> str:
    """This test's CLI runs (`run_cli`, `start_cli`) are thin clients of the
    process's shared Connect server (`shared_connect`); returns its URL."""
    monkeypatch.setenv("MICROBATCH_SPARK_MASTER", shared_connect)
    return shared_connect


@pytest.fixture
def compute(spark):
    """A compute factory sharing the session (the protocol closes computes; this one keeps it)."""
    from spark_jobs.engine.spark_compute import SparkCompute

    return lambda: SparkCompute(session=spark)


def oracle_spec_dict(**overrides) -> dict:
    """A pipeline spec whose state carries the oracle's columns."""
    spec = {
        "name": "clicks",
        "description": "test pipeline",
        "source": {
            "type": "files",
            "path": "landing",
            "format": "json",
            "schema": "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP",
        },
        "transform": ORACLE_TRANSFORM,
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": dict(ORACLE_MERGE)},
        "checkpoint": "lake/_checkpoints/clicks",
        "batch": {"max_files": 100},
    }
    for key, value in overrides.items():
        spec[key] = value
    return spec


def land_at_once(folder: Path, wave: int, **wave_args) -> list[Path]:
    """`write_wave` into `folder`, which must be empty or absent, all files
    at one instant: written beside it, then the folder renamed over it (a
    watcher polling between two files' renames would see half a wave)."""
    from spark_jobs.demo.clickstream import write_wave

    staging = folder.with_name(f".{folder.name}.staging")
    written = write_wave(staging, wave, **wave_args)
    os.rename(staging, folder)  # replaces an empty folder in one step
    return [folder / path.name for path in written]


def write_spec(folder: Path, spec: dict, name: str = "pipeline.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / spec["source"]["path"]).mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def spec_path(tmp_path) -> Path:
    return write_spec(tmp_path, oracle_spec_dict())


#: `microbatch` whose batches all count as big (more than `IN_PROCESS_ROWS`
#: rows): a test's batch of hundreds of rows takes the path of one of millions.
BIG_BATCHES = (
    "-c", "import sys; import spark_jobs.core.state as s; s.IN_PROCESS_ROWS = 0; from spark_jobs.cli import main; sys.exit(main(sys.argv[1:]))",
)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300, big: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `microbatch` as a user would (a new process, the installed entry
    point); `big`: its batches all count as big (`BIG_BATCHES`)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, *(BIG_BATCHES if big else ("-m", "spark_jobs")), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )


def feed_by_type(table, version: int) -> dict[str, dict]:
    """One version of a state's change feed (`table`: a delta-rs handle):
    each change type's rows by user, without the feed's own columns."""
    from spark_jobs.core.delta_io import arrow

    by_type: dict[str, dict] = {}
    for row in arrow(table.load_cdf(starting_version=version, ending_version=version).read_all()).to_pylist():
        by_type.setdefault(row["_change_type"], {})[row["user_id"]] = {k: v for k, v in row.items() if not k.startswith("_c")}
    return by_type


def assert_feed_is_the_change(table, before: dict, after: dict) -> dict[str, dict]:
    """The change feed of `table`'s latest version is what it changed, the
    state by user `before` and `after` it: each returning user's old and new
    row, each new user's row, and nothing else. Returns the feed by type."""
    feed = feed_by_type(table, table.version())
    changed = {k for k in after if after[k] != before.get(k)}
    assert set(feed.get("update_preimage", {})) == set(feed.get("update_postimage", {})) == changed & set(before)
    assert set(feed.get("insert", {})) == changed - set(before)
    assert all(feed["update_preimage"][k] == before[k] and feed["update_postimage"][k] == after[k] for k in changed & set(before))
    return feed


def winner_first(monkeypatch, owner: object, name: str, winner: Callable[[], str], seen: Callable[..., None] | None = None) -> list[str]:
    """A race lost at a step: the first call of `owner`'s `name` (a
    function a batch calls on its way to its commit) first runs `winner`
    (another run of the same batch, in full) and hands its arguments to
    `seen`, then goes on. Returns the winner's statuses, filled when it ran."""
    real = getattr(owner, name)
    statuses: list[str] = []

    def first(*args, **kwargs):
        monkeypatch.setattr(owner, name, real)
        if seen is not None:
            seen(*args, **kwargs)
        statuses.append(winner())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, first)
    return statuses


def lose_the_race_to_the_join(monkeypatch, spec_path: Path, run: Callable[[], str]) -> list[str]:
    """`run` (a batch merged by the executors' join) loses the race for its
    entry: another run of the same batch commits between the join's files
    and this one's commit (`winner_first` on `commit_rewrite`). Asserts the
    loser ends as a lost race does (`already_committed`), the winner
    committed and the state is exact, and that the loser's files are
    deleted; returns their paths (relative to the state's folder)."""
    import spark_jobs.core.state as state_module
    from spark_jobs.core.spec import load_spec

    joined: list[str] = []

    def seen(table, data, rewritten, changes, *_):
        joined.extend(f.path for f in (*data, *changes))

    winner = winner_first(monkeypatch, state_module, "commit_rewrite", run, seen)
    assert run() == "already_committed"
    assert winner == ["committed"]
    assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)
    state = Path(load_spec(spec_path).state_path)
    assert joined and not [p for p in joined if (state / p).exists()], "the loser's merged rows and change data were deleted"
    return joined


def marked_processes_left(mark: str, within: float = 60) -> list[int]:
    """Pids of processes (other than this one) whose environment holds
    ``MICROBATCH_TEST_MARK=<mark>`` (a CLI run given that mark, and the JVMs
    it started) still running after waiting up to `within` seconds for them to end."""
    deadline = time.monotonic() + within
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and f"MICROBATCH_TEST_MARK={mark}".encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
        left = [pid for pid in found if pid != os.getpid()]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def start_cli(*args: str, env: dict[str, str] | None = None, big: bool = False) -> subprocess.Popen[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        [sys.executable, *(BIG_BATCHES if big else ("-m", "spark_jobs")), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=ROOT,
    )


def kill_some(
    procs: list[subprocess.Popen[str]], rng: random.Random, counts: dict[str, int], *, within: float, chance: float, timeout: float
) -> list[tuple[int, str]]:
    """After a random wait of up to `within` seconds, SIGKILL each of `procs`
    still running with probability `chance`; wait for all of them. Counts
    the runs and kills in `counts`; returns each one's (return code, stderr)."""
    counts["runs"] += len(procs)
    time.sleep(rng.uniform(0.5, within))
    for proc in procs:
        if proc.poll() is None and rng.random() < chance:
            proc.send_signal(signal.SIGKILL)
            counts["killed"] += 1
    ended = []
    for proc in procs:
        _, err = proc.communicate(timeout=timeout)
        ended.append((proc.returncode, err))
    return ended


#: A downstream of `oracle_spec_dict`'s state: events and amount per last
#: character of the user id, from the state's change data feed.
DOWNSTREAM_TRANSFORM = """
SELECT substr(user_id, -1, 1) AS bucket,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN events
                WHEN _change_type IN ('delete', 'update_preimage') THEN -events ELSE 0 END) AS events,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN amount
                WHEN _change_type IN ('delete', 'update_preimage') THEN -amount ELSE 0 END) AS amount
FROM batch GROUP BY substr(user_id, -1, 1)
"""


def chain_specs(folder: Path, reader: str = "driver") -> tuple[Path, Path]:
    """Two chained pipelines in `folder`: the oracle pipeline with its change
    feed on (`upstream.yaml`), and `buckets` reading its changes
    (`downstream.yaml`), by the driver or by Spark (`source.reader`)."""
    base = oracle_spec_dict()
    upstream = write_spec(folder, oracle_spec_dict(state={**base["state"], "change_feed": True}), "upstream.yaml")
    downstream = write_spec(
        folder,
        {
            "name": "buckets",
            "source": {"type": "delta", "path": "lake/state", "read": "changes", "reader": reader},
            "transform": DOWNSTREAM_TRANSFORM,
            "state": {"path": "lake/buckets", "keys": ["bucket"], "merge": {"events": "sum", "amount": "sum"}},
            "checkpoint": "lake/_checkpoints/buckets",
            "batch": {"max_versions": 2},
        },
        "downstream.yaml",
    )
    return upstream, downstream


def assert_chain_exact(upstream: Path, downstream: Path) -> None:
    """The upstream is exact (`assert_exact`), and the downstream's buckets
    equal the upstream state's current rows summed by bucket."""
    from deltalake import DeltaTable

    from spark_jobs.core.delta_io import read_all
    from spark_jobs.core.spec import load_spec

    assert_exact(upstream)
    users = read_all(DeltaTable(load_spec(upstream).state_path)).to_pylist()
    expected: dict[str, tuple[int, float]] = {}
    for row in users:
        events, amount = expected.get(row["user_id"][-1], (0, 0.0))
        expected[row["user_id"][-1]] = (events + row["events"], amount + row["amount"])
    got = {r["bucket"]: (r["events"], r["amount"]) for r in read_all(DeltaTable(load_spec(downstream).state_path)).to_pylist()}
    # A bucket whose users a rewind took back holds zeros: as good as absent.
    got = {bucket: (events, amount) for bucket, (events, amount) in got.items() if bucket in expected or events or abs(amount) > 1e-6}
    assert set(got) == set(expected), f"buckets {sorted(got)} != {sorted(expected)}"
    for bucket, (events, amount) in expected.items():
        assert got[bucket][0] == events, f"bucket {bucket}: {got[bucket]} != {expected[bucket]}"
        assert got[bucket][1] == pytest.approx(amount), f"bucket {bucket}"


def assert_exact(spec_file: Path, *, drained: bool = True, mirror: Path | None = None) -> list:
    """The exactly-once invariant, checked against the oracle.

    * the ledger's lineage has contiguous batch ids 1..N whose offsets join
      end to end, and no file appears in two batches;
    * the state equals the fold of exactly the files the lineage consumed
      (count, amount, id hash-sum, max ts per key);
    * when `drained`, those files are all the ready files in the source.

    For an S3 source, `mirror` is a local folder holding the same files under
    the same relative names (the oracle reads them from there).
    """
    from spark_jobs.demo.clickstream import differences, fold, state_totals
    from spark_jobs.core.ledger import OffsetLedger
    from spark_jobs.core.spec import load_spec

    spec = load_spec(spec_file)
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    lineage = view.lineage()
    assert [r.batch_id for r in lineage] == list(range(1, len(lineage) + 1)), "batch ids not contiguous"
    for previous, row in zip(lineage, lineage[1:]):
        assert row.start_offsets == previous.end_offsets, f"gap or overlap before batch {row.batch_id}"
    if lineage:
        assert lineage[0].start_offsets == {"files": 0}
    files = [f["name"] for r in lineage for f in r.manifest["files"]]
    assert len(files) == len(set(files)), "a file was consumed twice"
    source = mirror if mirror is not None else Path(spec.source_path)
    if drained:
        ready = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file() and not p.name.startswith("."))
        assert sorted(files) == ready, "not every file was consumed"
    problems = differences(fold(source / f for f in files), state_totals(spec))
    assert not problems, "state differs from the oracle:\n" + "\n".join(problems[:20])
    return lineage


def batch_metadata(pipeline: str, position):
    """The commit metadata of a batch at `position`, for tests that commit the state directly."""
    from spark_jobs.core.commits import CommitKind, CommitMetadata

    return CommitMetadata(
        kind=CommitKind.BATCH, pipeline=pipeline, position=position, start_offsets={}, end_offsets={}, run_id="test"
    )


def commit_updates(state, table, updates, position):
    """Commit one batch's updates to a `StateTable` as step 4 does: fitted to the table, then merged."""
    return state.commit_batch(table, state.align(table, updates), batch_metadata(state.spec.name, position))


def reach(point: str, spec_path: Path) -> None:
    """Make fault point `point` reachable by the pipeline at `spec_path`:
    ``mid_executor_write`` fires only while Spark's executors write a batch's
    rows, and ``engine.state_write: auto`` keeps a test's small batches in the
    job's process, so that point's runs set ``state_write: executors``."""
    if point != "mid_executor_write":
        return
    spec = yaml.safe_load(spec_path.read_text())
    spec.setdefault("engine", {})["state_write"] = "executors"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))


class SimulatedCrash(Exception):
    """Stands for a kill at a fault point, for in-process runs."""


@contextlib.contextmanager
def crash_at(point: str):
    """The run inside dies at fault point `point` (raises `SimulatedCrash` there); the test expects it."""
    from spark_jobs.core import faults

    def crash(reached: str) -> None:
        if reached == point:
            raise SimulatedCrash(point)

    faults.set_hook(crash)
    try:
        with pytest.raises(SimulatedCrash):
            yield
    finally:
        faults.set_hook(None)


class BatchesLineage:
    """An in-memory lineage of planned batches, for testing a source alone
    (the protocol gives sources a `spark_jobs.core.lineage.LedgerLineage`)."""

    def __init__(self, *batches) -> None:
        self.batches = [b for b in batches if b is not None]

    @property
    def end(self) -> dict:
        return self.batches[-1].end.to_dict() if self.batches else {}

    def consumed(self, keys) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for batch in self.batches:
            for key, version in batch.manifest.units():
                if key in keys:
                    found.setdefault(key, set()).add(version)
        return found


def assert_versions_carry_batches(spec_file: Path) -> list:
    """Every committed row of the ledger (every epoch) names as its
    `state_version` the state commit that carries that batch: the log entry
    of that number holds the batch's position on the state fence. Returns the
    lineage."""
    from spark_jobs.core.commits import METADATA_KEY
    from spark_jobs.core.delta_io import commit_info
    from spark_jobs.core.ledger import OffsetLedger, RowStatus
    from spark_jobs.core.spec import load_spec

    spec = load_spec(spec_file)
    view = OffsetLedger(spec.ledger_path, spec.name).load()
    for row in view.rows:
        if row.status is not RowStatus.COMMITTED:
            continue
        info = commit_info(spec.state_path, row.state_version)
        assert info is not None, f"{row.position}: state version {row.state_version} has no log entry"
        carried = json.loads(info.get(METADATA_KEY) or "{}")
        assert carried.get("txn") == row.position.encode(), (
            f"{row.position} is recorded as state version {row.state_version}, which carries "
            f"{info.get('operation')} {carried.get('txn')}"
        )
    return view.lineage()
