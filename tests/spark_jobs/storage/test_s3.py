"""The whole protocol on S3: source, ledger, state and quarantine in a bucket.

The S3 API is moto's server on loopback (real HTTP, real conditional puts);
only AWS itself is replaced. Source files are generated locally (the oracle
reads them there) and uploaded under the same names. The CLI's runs are thin
clients of the test process's shared Spark Connect server (`on_connect`),
whose executors fetch the objects with the settings each run hands them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import urllib.request
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
import yaml

from spark_jobs.demo.clickstream import write_wave
from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.faults import MARKER
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.sources.base import Caps
from spark_jobs.sources.files import FilesSource
from spark_jobs.sources.s3 import S3Lister
from spark_jobs.core.spec import load_spec
from spark_jobs.storage.s3 import S3Location, delta_storage_options, s3_client
from tests.conftest import (
    ROOT,
    BatchesLineage,
    TEST_AWS_SECRET,
    assert_exact,
    assert_feed_is_the_change,
    oracle_spec_dict,
    run_cli,
    start_cli,
    upload_folder,
)


def _s3_spec(tmp_path, bucket: str, **overrides):
    base = oracle_spec_dict()
    spec = oracle_spec_dict(
        **{
            "source": {**base["source"], "path": f"s3://{bucket}/landing/clicks"},
            "state": {**base["state"], "path": f"s3://{bucket}/lake/state"},
            "checkpoint": f"s3://{bucket}/lake/_checkpoints/clicks",
            **overrides,
        }
    )
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _land(mirror, bucket: str, wave: int, **kwargs) -> None:
    write_wave(mirror, wave, **kwargs)
    upload_folder(mirror, f"s3://{bucket}/landing/clicks")


def test_listing_pages_skips_unfinished_names_and_bounds_by_last_modified(bucket):
    client = s3_client()
    for key in ["landing/a.json", "landing/sub/b.json", "landing/_tmp/c.json", "landing/.d.json", "landing/e.json.tmp", "landing/dir/"]:
        client.put_object(Bucket=bucket, Key=key, Body=b"{}\n")
    lister = S3Lister(f"s3://{bucket}/landing")
    lister.page_size = 2  # force several pages
    source = FilesSource(lister, "json")
    names = [f.name for f in source.list_files()]
    assert sorted(names) == ["a.json", "sub/b.json"]
    assert all(f.uri.startswith(f"s3://{bucket}/landing/") for f in source.list_files())

    past = datetime.now(timezone.utc) - timedelta(hours=1)
    assert source.list_files(until=past) == []
    batch = source.plan(BatchesLineage(), caps=Caps(max_files=1))
    assert batch is not None and batch.end.to_dict() == {"files": 1}
    assert source.plan(BatchesLineage(source.plan(BatchesLineage()))) is None


def test_storage_options_come_from_the_boto3_chain_with_conditional_put(s3_endpoint):
    options = delta_storage_options("s3://any/table")
    assert options["AWS_ENDPOINT_URL"] == s3_endpoint
    assert options["conditional_put"] == "etag"
    assert options["AWS_S3_ALLOW_UNSAFE_RENAME"] == "false"  # whatever the environment says
    assert delta_storage_options("/local/table") is None


def test_batches_on_s3_are_exact_and_bad_records_are_quarantined(tmp_path, bucket, compute):
    mirror = tmp_path / "mirror"
    spec_file = _s3_spec(tmp_path, bucket)
    _land(mirror, bucket, 0, files=3, records_per_file=300, users=50, bad_every=40)
    first = run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute_factory=compute)
    assert first.status == "committed" and first.records_quarantined == 21
    _land(mirror, bucket, 1, files=2, records_per_file=300, users=50)
    assert run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute_factory=compute).status == "committed"
    assert run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute_factory=compute).status == "no_new_data"
    assert_exact(spec_file, mirror=mirror)

    spec = load_spec(spec_file)
    quarantined = read_all(open_table(spec.quarantine_path))
    assert quarantined.num_rows == 21
    assert all(uri.startswith(f"s3://{bucket}/landing/clicks/") for uri in quarantined.column("file").to_pylist())
    keys = [o["Key"] for o in s3_client().list_objects_v2(Bucket=bucket, Prefix="lake/")["Contents"]]
    assert any(k.startswith("lake/state/_delta_log/") for k in keys)
    assert any(k.startswith("lake/_checkpoints/clicks/offsets/_delta_log/") for k in keys)


def test_parquet_objects_are_read_on_executors(tmp_path, bucket, compute):
    import pyarrow.parquet as pq

    spec_file = _s3_spec(
        tmp_path,
        bucket,
        source={"type": "files", "path": f"s3://{bucket}/landing/clicks", "format": "parquet",
                "schema": "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"},
    )
    rows = pa.table({
        "event_id": ["e1", "e2", "e3"],
        "user_id": ["u1", "u1", None],
        "amount": [1.5, 2.5, 3.0],
        "ts": pa.array([datetime(2026, 1, 1, tzinfo=timezone.utc)] * 3, pa.timestamp("us", tz="UTC")),
    })
    local = tmp_path / "p.parquet"
    pq.write_table(rows, local)
    s3_client().put_object(Bucket=bucket, Key="landing/clicks/p.parquet", Body=local.read_bytes())
    outcome = run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute_factory=compute)
    assert (outcome.status, outcome.records_in, outcome.records_quarantined) == ("committed", 3, 1)
    state = {r["user_id"]: r for r in read_all(open_table(load_spec(spec_file).state_path)).to_pylist()}
    assert state["u1"]["events"] == 2 and state["u1"]["amount"] == 4.0
    assert state["u1"]["last_seen"] == datetime(2026, 1, 1, tzinfo=timezone.utc)
    reasons = read_all(open_table(load_spec(spec_file).quarantine_path)).column("reason").to_pylist()
    assert reasons == ["key user_id is missing or null"]


def test_concurrent_cli_runs_and_a_kill_before_the_ledger_row_end_exact_on_s3(tmp_path, bucket, on_connect):
    mirror = tmp_path / "mirror"
    spec_file = _s3_spec(tmp_path, bucket)
    _land(mirror, bucket, 0, files=4, records_per_file=200, users=40, bad_every=60)

    # Three runs at once over a backlog of two batches.
    procs = [start_cli("run", str(spec_file), "--max-files", "2", "--json") for _ in range(3)]
    outputs, statuses = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(out + err)
        statuses.append(json.loads(out)["status"])
    assert "committed" in statuses and set(statuses) <= {"committed", "already_committed", "no_new_data"}, statuses

    # A kill between the state commit and its ledger row, then recovery.
    _land(mirror, bucket, 1, files=2, records_per_file=200, users=40)
    crashed = run_cli("run", str(spec_file), env={"MICROBATCH_FAULT_POINT": "after_state_commit"})
    assert f"{MARKER} after_state_commit" in crashed.stderr and crashed.returncode == -9
    for _ in range(4):
        result = run_cli("run", str(spec_file), "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        outputs.append(result.stdout + result.stderr)
        if json.loads(result.stdout)["status"] == "no_new_data":
            break
    lineage = assert_exact(spec_file, mirror=mirror)
    assert len(lineage) >= 2

    # The credentials never reach output, the ledger or commit metadata.
    history = run_cli("history", str(spec_file), "--json")
    spec = load_spec(spec_file)
    metadata = json.dumps(open_table(spec.state_path).history(), default=str)
    for text in [*outputs, crashed.stdout, crashed.stderr, history.stdout, metadata]:
        assert TEST_AWS_SECRET not in text


def _append_fenced(uri: str, barrier, results) -> None:
    from deltalake import CommitProperties, Transaction, write_deltalake

    from spark_jobs.core.delta_io import is_commit_conflict

    table = open_table(uri)
    barrier.wait()
    try:
        write_deltalake(
            table,
            pa.table({"n": [1]}),
            mode="append",
            commit_properties=CommitProperties(app_transactions=[Transaction("race", 1)]),
        )
        results.put("committed")
    except Exception as exc:
        results.put("conflict" if is_commit_conflict(exc) else repr(exc))


def test_six_writers_racing_for_one_version_on_s3_exactly_one_wins(bucket):
    """Conditional put on the log entry is what makes this safe on S3."""
    from deltalake import DeltaTable

    uri = f"s3://{bucket}/race"
    DeltaTable.create(uri, pa.schema([("n", pa.int64())]), storage_options=delta_storage_options(uri))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_append_fenced, args=(uri, barrier, results)) for _ in range(6)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    outcomes = sorted(results.get(timeout=5) for _ in procs)
    assert outcomes == ["committed"] + ["conflict"] * 5, outcomes
    table = open_table(uri)
    assert table.version() == 1 and read_all(table).num_rows == 1
    log = s3_client().list_objects_v2(Bucket=bucket, Prefix="race/_delta_log/")["Contents"]
    assert sorted(S3Location(bucket, o["Key"]).key.rsplit("/", 1)[1] for o in log if o["Key"].endswith(".json")) == [
        "00000000000000000000.json",
        "00000000000000000001.json",
    ]


def test_racing_creators_on_s3_make_one_create_commit(bucket):
    """Three runs at once on an empty bucket all create the ledger: a CREATE
    that lost the race must fail, not land as version 1 (it did, and a run
    then failed to plan in CI)."""
    from tests.spark_jobs.core.test_fencing import racing_creators_make_one_create_commit

    racing_creators_make_one_create_commit(f"s3://{bucket}/created")


@pytest.fixture
def faulty_s3(s3_endpoint):
    """`tests.s3_fault_proxy` in front of moto: 5% of requests throttled (503),
    30% of Delta log PUTs, and every one of the state table's, applied and then
    answered 500 (the ambiguous failure: the commit landed, the writer is told
    it did not)."""
    proxy = subprocess.Popen(
        [
            sys.executable, "-m", "tests.s3_fault_proxy", s3_endpoint,
            "--seed", "5", "--unavailable", "0.05", "--ambiguous", "0.3",
            "--ambiguous-always", "/lake/state/_delta_log/",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )  # fmt: skip
    line = proxy.stdout.readline()
    assert line.startswith("PORT "), f"fault proxy did not start: {line!r}"
    yield f"http://127.0.0.1:{int(line.split()[1])}"
    proxy.stdin.close()
    proxy.wait(30)


def test_throttling_and_ambiguous_commits_on_s3_end_exact(tmp_path, bucket, faulty_s3, on_connect):
    mirror = tmp_path / "mirror"
    spec_file = _s3_spec(tmp_path, bucket)
    through_proxy = {"AWS_ENDPOINT_URL": faulty_s3}  # driver, delta-rs and executors alike

    # Two runs at once, then lone runs: every run ends 0, and a lone run must
    # report its batch as committed even when every state commit it makes is
    # answered with an error (its commit token identifies the landed commit).
    _land(mirror, bucket, 0, files=2, records_per_file=150, users=30, bad_every=50)
    procs = [start_cli("run", str(spec_file), "--max-files", "1", "--json", env=through_proxy) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    for wave in (1, 2):
        _land(mirror, bucket, wave, files=2, records_per_file=150, users=30, bad_every=50)
        result = run_cli("run", str(spec_file), "--json", env=through_proxy)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout)["status"] == "committed", result.stdout
    drain = run_cli("run", str(spec_file), "--json", env=through_proxy)
    assert drain.returncode == 0, drain.stderr[-2000:]
    assert json.loads(drain.stdout)["status"] in {"committed", "no_new_data"}

    assert_exact(spec_file, mirror=mirror)  # read straight from moto, not through the proxy
    faults = json.loads(urllib.request.urlopen(f"{faulty_s3}/__faults__", timeout=30).read())
    state_faults = [p for p in faults["ambiguous_paths"] if "/lake/state/_delta_log/" in p]
    print(
        f"S3 faults: {faults['requests']} requests, {faults['unavailable']} throttled, {faults['ambiguous']} of "
        f"{faults['log_puts']} log-entry PUTs ambiguous ({len(state_faults)} on the state table)"
    )
    assert len(state_faults) >= 3 and faults["unavailable"] >= 1, faults


@pytest.mark.parametrize("versioned", [False, True], ids=["unversioned", "versioned"])
@pytest.mark.parametrize("release", ["delete", "archive"])
def test_releasing_an_object_spares_an_upload_under_its_key(bucket, release, versioned):
    """S3's release takes only the version that was consumed: an upload under
    the key after the listing (seen by size and LastModified) or between the
    check and the delete (S3's If-Match on the ETag fails with 412) is never
    deleted or archived in its place."""
    client = s3_client()
    if versioned:
        client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    lister = S3Lister(f"s3://{bucket}/landing")
    archive = f"s3://{bucket}/archive"
    client.put_object(Bucket=bucket, Key="landing/a.json", Body=b'{"n": 1}\n')
    client.put_object(Bucket=bucket, Key="landing/b.json", Body=b'{"n": 2}\n')
    listed = {f.name: f for f in lister.list(None)}

    def release(f):
        return lister.remove(f) if release == "delete" else lister.move(f, archive)

    # After the listing: a new a.json (another size) replaced the consumed one.
    client.put_object(Bucket=bucket, Key="landing/a.json", Body=b'{"n": 100}\n')
    assert release(listed["a.json"]) is False
    # Between the check and the delete: the HEAD sees the consumed b.json, then an upload lands.
    head = lister.client.head_object

    def head_then_upload(**kwargs):
        answer = head(**kwargs)
        client.put_object(Bucket=bucket, Key="landing/b.json", Body=b'{"n": 3}\n')
        return answer

    lister.client.head_object = head_then_upload
    try:
        assert release(listed["b.json"]) is False
    finally:
        lister.client.head_object = head
    body = {k: client.get_object(Bucket=bucket, Key=f"landing/{k}")["Body"].read() for k in ("a.json", "b.json")}
    assert body == {"a.json": b'{"n": 100}\n', "b.json": b'{"n": 3}\n'}, "both uploads are still there"
    if release == "archive" and versioned:
        # The copy took the checked version by its id. (Without versions S3
        # refuses the copy on CopySourceIfMatch; moto's server does not check
        # that condition, so here only the delete's is asserted.)
        assert client.get_object(Bucket=bucket, Key="archive/b.json")["Body"].read() == b'{"n": 2}\n'
    # The consumed version itself is released, and nothing older comes back.
    now = {f.name: f for f in lister.list(None)}
    assert release(now["a.json"]) is True
    assert [f.name for f in lister.list(None)] == ["b.json"]
    if release == "archive":
        assert client.get_object(Bucket=bucket, Key="archive/a.json")["Body"].read() == b'{"n": 100}\n'


def test_maintain_on_s3_removes_objects_no_commit_references_and_keeps_the_rest(tmp_path, bucket, compute):
    """Issue 46, item 5, on S3: objects a write left without its commit (in
    the state's prefix and the quarantine's) go once older than the window;
    the log, the job's own files and every committed file stay."""
    import time

    from spark_jobs.core.maintain import maintain

    mirror = tmp_path / "mirror"
    spec_file = _s3_spec(tmp_path, bucket, maintenance={"untracked_files_hours": 0.0003})  # about a second
    _land(mirror, bucket, 0, files=2, records_per_file=100, users=20, bad_every=30)
    assert run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute_factory=compute).status == "committed"
    client = s3_client()
    orphans = ["lake/state/part-00000-lost-fold.snappy.parquet", "lake/_checkpoints/clicks/quarantine/part-00000-killed.parquet"]
    for key in orphans:
        client.put_object(Bucket=bucket, Key=key, Body=b"PAR1")
    time.sleep(1.5)
    report = maintain(load_spec(spec_file))
    assert report.removed_files["state untracked"] == 1 and report.removed_files["quarantine untracked"] == 1
    keys = {o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="lake/") for o in page.get("Contents", [])}
    assert not keys & set(orphans)
    assert_exact(spec_file, mirror=mirror)
    assert read_all(open_table(load_spec(spec_file).quarantine_path)).num_rows == 6


def test_a_state_merged_on_read_on_s3_holds_what_copy_on_write_holds_through_a_race_a_rewind_and_maintain(tmp_path, bucket):
    """`state.deletion_vectors` on S3 (issue 64): the job's own commits of
    vectors, data and change files go to the bucket, the log entry put
    with ``If-None-Match``. Against a copy-on-write twin on the same
    batches: the same rows and change feed after each; a run on a stale
    snapshot loses as delta-rs's conflicts lose; a rewind (the job's own
    RESTORE) and `maintain`'s purge keep every row; and the removal of
    untracked objects takes the dead vector files and an orphan one, and
    leaves the kept versions readable."""
    import time

    from spark_jobs.core.deletion_vectors import has_deletion_vectors
    from spark_jobs.core.delta_io import arrow, is_commit_conflict
    from spark_jobs.core.fencing import STATE_FENCE, Position
    from spark_jobs.core.maintain import restorable
    from spark_jobs.core.merge_on_read import purge
    from spark_jobs.core.state import StateTable
    from spark_jobs.core.untracked import remove_untracked
    from spark_jobs.storage.s3 import read_bytes
    from tests.conftest import batch_metadata, commit_updates, write_spec
    from tests.spark_jobs.core.test_merge_on_read import MERGE, _batches

    def state(name: str, vectors: bool) -> StateTable:
        spec = oracle_spec_dict(name=name)
        spec["state"] = {"path": f"s3://{bucket}/{name}", "keys": ["k"], "merge": MERGE, "deletion_vectors": vectors, "change_feed": True}
        (tmp_path / name).mkdir()
        return StateTable(load_spec(write_spec(tmp_path / name, spec)))

    def rows(s: StateTable, version: int | None = None) -> list[dict]:
        table = open_table(s.path) if version is None else DeltaTable(s.path, version=version, storage_options=delta_storage_options(s.path))
        return sorted(read_all(table).to_pylist(), key=lambda r: r["k"])

    def changes(s: StateTable) -> list[str]:
        table = open_table(s.path)
        feed = arrow(table.load_cdf(starting_version=table.version(), ending_version=table.version()).read_all())
        return sorted(repr(sorted((k, v) for k, v in r.items() if not k.startswith("_commit"))) for r in feed.to_pylist())

    def latest_entry(s: StateTable) -> str:
        return read_bytes(f"{s.path}/_delta_log/{open_table(s.path).version():020d}.json").decode()

    from deltalake import DeltaTable

    cow, mor = state("cow", False), state("mor", True)
    batches, versions = _batches(7, seed=12), {cow.path: [], mor.path: []}
    for n, batch in enumerate(batches[:5], start=1):
        for s in (cow, mor):
            versions[s.path].append(commit_updates(s, s.open() or s.create(batch), batch, Position(0, n))[0])
        assert rows(mor) == rows(cow) and changes(mor) == changes(cow), f"batch {n}"
    assert '"merge-on-read"' in latest_entry(mor) and has_deletion_vectors(open_table(mor.path))
    client = s3_client()
    vector_keys = lambda: {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="mor/deletion_vector_").get("Contents", [])}  # noqa: E731
    assert len(vector_keys()) >= 3

    stale = mor.open()
    commit_updates(mor, mor.open(), batches[5], Position(0, 6))
    commit_updates(cow, cow.open(), batches[5], Position(0, 6))
    winner = rows(mor)
    with pytest.raises(Exception) as lost:
        mor.commit_batch(stale, mor.align(stale, batches[6]), batch_metadata("mor", Position(0, 6)))
    assert is_commit_conflict(lost.value) and rows(mor) == winner == rows(cow)
    assert Position.decode(open_table(mor.path).transaction_version(STATE_FENCE)) == Position(0, 6)

    for s in (cow, mor):
        s.restore(s.open(), versions[s.path][3], batch_metadata(s.spec.name, Position(1, 4)))
    assert rows(mor) == rows(cow) and '"RESTORE"' in latest_entry(mor)
    kept_from = open_table(mor.path).version()
    purged, _ = purge(open_table(mor.path))
    assert rows(mor) == rows(cow) and '"REORG"' in latest_entry(mor) and purged == kept_from + 1

    client.put_object(Bucket=bucket, Key="mor/deletion_vector_orphan.bin", Body=b"\x01")
    before = vector_keys()
    time.sleep(1.5)
    removed = remove_untracked(open_table(mor.path), kept_from, 0.0003, [STATE_FENCE])  # about a second
    after = vector_keys()
    assert "mor/deletion_vector_orphan.bin" not in after and removed >= len(before - after) >= 2
    assert restorable(mor.path, kept_from) and rows(mor, kept_from) == rows(cow)
    assert not restorable(mor.path, versions[mor.path][2]), "a version not kept lost its vector files: no rewind to it"


def test_a_batch_merged_on_read_whose_commit_s3_applied_but_failed_is_found_as_its_own(tmp_path, bucket, s3_endpoint, faulty_s3, monkeypatch):
    """The ambiguous failure for the job's own log entry: S3 applies the
    put of a batch merged on read and answers 500 (the fault proxy); boto3
    puts again and gets 412. The batch fails as a lost race would, and the
    commit there carries its commit token: what step 4 looks for
    (`protocol._after_conflict`) to carry on as committed."""
    import dataclasses
    import uuid

    from spark_jobs.core.delta_io import is_commit_conflict
    from spark_jobs.core.fencing import Position
    from spark_jobs.core.state import StateTable
    from spark_jobs.storage import s3 as storage
    from tests.conftest import batch_metadata, commit_updates, write_spec
    from tests.spark_jobs.core.test_merge_on_read import MERGE, _batches

    spec = oracle_spec_dict()
    spec["state"] = {"path": f"s3://{bucket}/lake/state", "keys": ["k"], "merge": MERGE, "deletion_vectors": True, "change_feed": True}
    state = StateTable(load_spec(write_spec(tmp_path, spec)))
    first, second, third = _batches(3, seed=13)
    commit_updates(state, state.create(first), first, Position(0, 1))
    commit_updates(state, state.open(), second, Position(0, 2))  # turns the feature on: the next batch merges on read
    table = state.open()
    metadata = dataclasses.replace(batch_metadata(state.spec.name, Position(0, 3)), commit_token=uuid.uuid4().hex)

    monkeypatch.setenv("AWS_ENDPOINT_URL", faulty_s3)
    storage.reset()
    try:
        with pytest.raises(Exception) as failed:
            state.commit_batch(table, state.align(table, third), metadata)
    finally:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
        storage.reset()
    assert is_commit_conflict(failed.value)
    faults = json.loads(urllib.request.urlopen(f"{faulty_s3}/__faults__").read())
    assert any("/lake/state/_delta_log/" in path for path in faults["ambiguous_paths"]), faults
    landed = state.find_commit(state.open(), Position(0, 3))
    assert landed is not None and landed.metadata.commit_token == metadata.commit_token
    assert '"merge-on-read"' in s3_client().get_object(Bucket=bucket, Key=f"lake/state/_delta_log/{landed.version:020d}.json")["Body"].read().decode()


def test_one_s3_client_is_reused_until_the_credentials_it_was_made_from_change(tmp_path, monkeypatch):
    """`s3_client` keeps one client per session and environment (a new one
    loads botocore's model again: 0.1-0.25 s), and makes a new one when
    what boto3's chain reads changes: keys rotated in the credentials file,
    another profile, other keys in the environment, a forked child."""
    import os

    from spark_jobs.storage import s3 as storage

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    config.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    storage.reset()
    key = lambda client: client._request_signer._credentials.get_frozen_credentials().access_key  # noqa: E731
    try:
        credentials.write_text("[default]\naws_access_key_id = OLD\naws_secret_access_key = x\n[p2]\naws_access_key_id = P2\naws_secret_access_key = y\n")
        first = storage.s3_client()
        assert storage.s3_client() is first and key(first) == "OLD"
        credentials.write_text("[default]\naws_access_key_id = NEW\naws_secret_access_key = x\n[p2]\naws_access_key_id = P2\naws_secret_access_key = y\n")
        os.utime(credentials, (os.stat(credentials).st_atime, os.stat(credentials).st_mtime + 1))
        assert key(storage.s3_client()) == "NEW"
        monkeypatch.setenv("AWS_DEFAULT_PROFILE", "p2")
        assert key(storage.s3_client()) == "P2"
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENV")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "z")
        assert key(storage.s3_client()) == "ENV"
        parent = storage.s3_client()
        child = os.fork()
        if child == 0:
            os._exit(0 if storage.s3_client() is not parent else 1)
        assert os.waitpid(child, 0)[1] == 0, "a forked child reused its parent's client"
    finally:
        storage.reset()


def test_a_change_feed_state_on_s3_is_merged_by_the_executors_with_its_changes_through_a_race(tmp_path, bucket, compute):
    """A merged state with `change_feed` on S3, merged by the executors'
    join (`state_write: executors`; delta-spark cannot fence two drivers on
    S3, and before, every such batch was merged in the job's process): the
    tasks write the change data with the merged rows, and the job commits
    the entry with ``If-None-Match``. The state is exact; the change feed
    of each batch is the old and new row of each returning key and the row
    of each new one; a commit landing between the join and the job's commit
    loses it that attempt, whose files are deleted, and the batch merges
    again from the new snapshot."""
    from deltalake import DeltaTable

    from spark_jobs.core import faults
    from spark_jobs.core.delta_io import commit_info
    from spark_jobs.storage.s3 import read_bytes

    mirror = tmp_path / "mirror"
    base = oracle_spec_dict()
    spec_file = _s3_spec(tmp_path, bucket, state={**base["state"], "path": f"s3://{bucket}/lake/state", "change_feed": True},
                         engine={"state_write": "executors"})
    spec = load_spec(spec_file)
    client = s3_client()

    def run() -> None:
        assert run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute_factory=compute).status == "committed"

    def keys(prefix: str) -> set[str]:
        return {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}

    _land(mirror, bucket, 0, files=2, records_per_file=200, users=40)
    run()
    raced, written_before = [], set()

    def race(point: str) -> None:
        # Once the join has written its change data (the commit not made):
        # a tool's property change, a commit of no fence, takes the version the batch wanted.
        if point == "mid_state_merge" and not raced and keys("lake/state/_change_data/") - written_before:
            raced.append(point)
            DeltaTable(spec.state_path, storage_options=delta_storage_options(spec.state_path)).alter.set_table_properties({"delta.logRetentionDuration": "interval 31 days"})

    for wave in (1, 2):
        _land(mirror, bucket, wave, files=2, records_per_file=200, users=60)
        before = {r["user_id"]: r for r in read_all(open_table(spec.state_path)).to_pylist()}
        written_before = keys("lake/state/_change_data/")
        faults.set_hook(race if wave == 2 else None)
        try:
            run()
        finally:
            faults.set_hook(None)
        table = open_table(spec.state_path)
        entry = read_bytes(f"{spec.state_path}/_delta_log/{table.version():020d}.json").decode()
        assert "executors' join" in entry and '"cdc"' in entry
        assert_feed_is_the_change(table, before, {r["user_id"]: r for r in read_all(table).to_pylist()})
    assert raced, "the race ran"
    history = [commit_info(spec.state_path, v)["operation"] for v in range(open_table(spec.state_path).version() + 1)]
    assert history[-2:] == ["SET TBLPROPERTIES", "MERGE"], history
    assert_exact(spec_file, mirror=mirror)
    named = set()
    table = open_table(spec.state_path)
    for version in range(table.version() + 1):
        for line in read_bytes(f"{spec.state_path}/_delta_log/{version:020d}.json").decode().splitlines():
            action = json.loads(line)
            if "cdc" in action:
                named.add(f"lake/state/{action['cdc']['path']}")
    assert keys("lake/state/_change_data/") == named, "the lost attempt's change data was deleted"


def test_a_big_batch_into_a_state_merged_on_read_on_s3_is_joined_without_the_deleted_rows(tmp_path, bucket, compute, monkeypatch):
    """A state merged on read on S3 whose files carry vectors (a few users
    merged on read in the job's process), then a batch too big for it (the
    bound lowered to none): the executors' join reads each file from the
    bucket without the rows its vector deletes (the vector's bytes fetched
    by range), and the job puts the entry removing the files with their
    vectors. No user is in two rows; the state is exact; the feed is the change."""
    import spark_jobs.core.state as state_module
    from spark_jobs.core.deletion_vectors import carries_vectors
    from spark_jobs.storage.s3 import read_bytes

    mirror = tmp_path / "mirror"
    base = oracle_spec_dict()
    state = {**base["state"], "path": f"s3://{bucket}/lake/state", "change_feed": True, "deletion_vectors": True}
    spec_file = _s3_spec(tmp_path, bucket, state=state, batch={"max_files": 2})
    spec = load_spec(spec_file)

    def run() -> None:
        assert run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute_factory=compute).status == "committed"

    _land(mirror, bucket, 0, files=2, records_per_file=300, users=200)
    run()
    _land(mirror, bucket, 1, files=1, records_per_file=8, users=200)
    run()
    assert carries_vectors(open_table(spec.state_path)), "batch 2 was merged on read"
    spec_file = _s3_spec(tmp_path, bucket, state=state, batch={"max_files": 2}, engine={"state_write": "executors"})
    monkeypatch.setattr(state_module, "IN_PROCESS_ROWS", 0)
    _land(mirror, bucket, 2, files=2, records_per_file=300, users=200)
    before = {r["user_id"]: r for r in read_all(open_table(spec.state_path)).to_pylist()}
    run()
    table = open_table(spec.state_path)
    actions = [json.loads(line) for line in read_bytes(f"{spec.state_path}/_delta_log/{table.version():020d}.json").decode().splitlines()]
    assert any(a.get("commitInfo", {}).get("operationParameters", {}).get("mode") == "executors' join" for a in actions)
    assert any(a.get("remove", {}).get("deletionVector") for a in actions), "a file with a vector was rewritten"
    rows = read_all(table).to_pylist()
    after = {r["user_id"]: r for r in rows}
    assert len(after) == len(rows), "a deleted row was read again"
    assert_feed_is_the_change(table, before, after)
    assert_exact(spec_file, mirror=mirror)
