"""Reading, quarantine and transform on real Spark, through the protocol."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.errors import TransformError
from spark_jobs.core.inspect import history
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from tests.conftest import oracle_spec_dict, write_spec

SCHEMA = "event_id STRING, user_id STRING, amount DOUBLE, ts TIMESTAMP"
SIMPLE = {
    "transform": "SELECT user_id, count(*) AS events, sum(amount) AS amount FROM batch GROUP BY user_id",
    "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum", "amount": "sum"}},
}


def _quarantine(spec):
    table = open_table(spec.quarantine_path)
    return sorted(read_all(table).to_pylist(), key=lambda r: (r["file"], r["line"])) if table else []


def _state(spec):
    return {r["user_id"]: r for r in read_all(open_table(spec.state_path)).to_pylist()}


def test_json_bad_records_are_quarantined_with_reasons(tmp_path, compute):
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(**SIMPLE)))
    lines = [
        '{"event_id":"1","user_id":"u1","amount":1.5,"ts":"2026-01-01T00:00:00Z"}',
        "not json at all",
        '{"event_id":"2","user_id":null,"amount":2}',
        '{"event_id":"3","amount":2}',
        '{"event_id":"4","user_id":"u2","amount":"abc"}',
        '{"event_id":"5","user_id":"u2","amount":2,"ts":"yesterday"}',
        "",
        '{"event_id":"6","user_id":"u2","amount":2.5}',
        "[1,2]",
    ]
    (tmp_path / "landing" / "a.json").write_text("\n".join(lines) + "\n")
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert outcome.status == "committed"
    assert outcome.records_in == 8  # blank lines are not records
    assert outcome.records_quarantined == 6
    reasons = {r["line"]: r["reason"] for r in _quarantine(spec)}
    assert reasons == {
        2: "malformed JSON: not a JSON object on one line",
        3: "key user_id is missing or null",
        4: "key user_id is missing or null",
        5: "field amount: 'abc' is not a DOUBLE",
        6: "field ts: 'yesterday' is not a TIMESTAMP",
        9: "malformed JSON: not a JSON object on one line",
    }
    quarantined = _quarantine(spec)
    assert quarantined[0]["raw"] == "not json at all"
    assert all(r["file"].endswith("a.json") and r["batch_id"] == 1 for r in quarantined)
    state = _state(spec)
    assert state["u1"]["events"] == 1 and state["u2"]["events"] == 1 and state["u2"]["amount"] == 2.5
    # valid + quarantined = input, recorded in the ledger
    committed = [r for r in history(spec) if r.status == "committed"][0]
    assert committed.records_in == 8 and committed.records_quarantined == 6


def test_csv_with_header_and_wrong_column_count(tmp_path, compute):
    source = {"type": "files", "path": "landing", "format": "csv", "schema": SCHEMA}
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(source=source, **SIMPLE)))
    (tmp_path / "landing" / "a.csv").write_text(
        "event_id,user_id,amount,ts\n1,u1,2.0,2026-01-01 00:00:00\n2,u1\n3,u2,x,\n4,u2,1.0,\n"
    )
    (tmp_path / "landing" / "b.csv").write_text("id,who,amount,ts\n9,u9,1.0,\n")
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert outcome.records_in == 5 and outcome.records_quarantined == 3
    reasons = {(r["file"].rsplit("/", 1)[1], r["line"]): r["reason"] for r in _quarantine(spec)}
    assert reasons[("a.csv", 3)].startswith("malformed CSV")
    assert reasons[("a.csv", 4)] == "field amount: 'x' is not a DOUBLE"
    assert "does not match source.schema" in reasons[("b.csv", 2)]
    assert {k: v["events"] for k, v in _state(spec).items()} == {"u1": 1, "u2": 1}


def test_parquet_source(tmp_path, compute):
    source = {"type": "files", "path": "landing", "format": "parquet", "schema": SCHEMA}
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(source=source, **SIMPLE)))
    pq.write_table(
        pa.table({"event_id": ["1", "2", "3"], "user_id": ["u1", None, "u1"], "amount": [1.0, 2.0, 3.0]}),
        tmp_path / "landing" / "a.parquet",
    )
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert outcome.records_in == 3 and outcome.records_quarantined == 1
    assert _quarantine(spec)[0]["line"] == 2
    assert _state(spec)["u1"]["amount"] == 4.0


def test_parquet_files_whose_types_do_not_merge_are_each_converted(tmp_path, compute):
    """One file stores `amount` as BIGINT, another as STRING (Spark cannot
    merge their schemas, and its error names no file): each file is read on
    its own and converted to `source.schema`; the value that does not
    convert is quarantined by file and row, the others count (found by a
    review: the batch failed, retryably, for good)."""
    source = {"type": "files", "path": "landing", "format": "parquet", "schema": SCHEMA}
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(source=source, **SIMPLE)))
    pq.write_table(pa.table({"event_id": ["1", "2"], "user_id": ["u1", "u2"], "amount": pa.array([1, 2], pa.int64())}), tmp_path / "landing" / "a.parquet")
    pq.write_table(pa.table({"event_id": ["3", "4"], "user_id": ["u1", "u2"], "amount": ["2.5", "x"]}), tmp_path / "landing" / "b.parquet")
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert outcome.records_in == 4 and outcome.records_quarantined == 1
    bad = _quarantine(spec)
    assert [(Path(r["file"]).name, r["line"]) for r in bad] == [("b.parquet", 2)] and "amount" in bad[0]["reason"], bad
    state = _state(spec)
    assert state["u1"]["amount"] == 3.5 and state["u2"]["amount"] == 2.0


#: Names Hadoop's `Path` and Spark's globbing trip over: Hive-style folders,
#: spaces, non-ASCII, '%', '#', glob characters and ':' (timestamped names).
AWKWARD_NAMES = ["dt=2026-01-01/x y/é b%41[1]#2.json", "dt=2026-01-01/{a,b}*?.json", "dt=2026-01-01/10:00:00.json"]


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_files_with_awkward_names_are_read_and_quarantined_by_their_planned_uri(tmp_path, compute, fmt):
    source = {"type": "files", "path": "landing", "format": fmt, "schema": SCHEMA}
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(source=source, **SIMPLE)))
    for i, name in enumerate(AWKWARD_NAMES):
        path = tmp_path / "landing" / name.replace(".json", f".{fmt}")
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = {"event_id": [f"{i}a", f"{i}b"], "user_id": [f"u{i}", None], "amount": [1.0 + i, 5.0]}
        if fmt == "parquet":
            pq.write_table(pa.table(rows), path)
        else:
            path.write_text('{"event_id":"%sa","user_id":"u%s","amount":%s}\n{"event_id":"%sb","amount":5}\n' % (i, i, 1.0 + i, i))
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert outcome.status == "committed" and outcome.records_in == 6 and outcome.records_quarantined == 3
    assert {u: r["amount"] for u, r in _state(spec).items()} == {"u0": 1.0, "u1": 2.0, "u2": 3.0}
    planned = {f["uri"] for f in history(spec)[0].manifest["files"]}
    assert {r["file"] for r in _quarantine(spec)} == planned


def _spec_with_transform(tmp_path, sql: str, *lines: str):
    """The simple pipeline with another transform, and one input file."""
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(**{**SIMPLE, "transform": sql})))
    (tmp_path / "landing" / "a.json").write_text("".join(f"{line}\n" for line in lines))
    return spec


def test_transform_returning_duplicate_keys_is_refused(tmp_path, compute):
    spec = _spec_with_transform(
        tmp_path, "SELECT user_id, 1L AS events, amount FROM batch", '{"user_id":"u","amount":1}', '{"user_id":"u","amount":2}'
    )
    with pytest.raises(TransformError, match="one row per key"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert open_table(spec.state_path) is None


def test_transform_sql_error_names_the_problem(tmp_path, compute):
    sql = "SELECT user_id, count(*) AS events, sum(amount) AS amount FROM batch GROUP BY nope"
    spec = _spec_with_transform(tmp_path, sql, '{"user_id":"u","amount":1}')
    with pytest.raises(TransformError, match="transform SQL failed"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert not (tmp_path / "lake").exists()


def _scala_list(seq):
    """A Scala collection's items, through py4j."""
    items, it = [], seq.iterator()
    while it.hasNext():
        items.append(it.next())
    return items


def test_a_batch_names_its_spark_jobs_and_gives_the_thread_its_properties_back(tmp_path, spark, compute):
    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(**SIMPLE)))
    (tmp_path / "landing" / "a.json").write_text('{"event_id":"1","user_id":"u1","amount":1.5}\n')
    context = spark.sparkContext
    store = context._jsc.sc().statusStore()
    jobs_before = {job.jobId() for job in _scala_list(store.jobsList(None))}
    context.setJobDescription("the embedding application's")
    try:
        assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).status == "committed"
        assert context.getLocalProperty("spark.job.description") == "the embedding application's"
        assert context.getLocalProperty("callSite.long") is None
    finally:
        context.setJobDescription(None)
    jobs = [job for job in _scala_list(store.jobsList(None)) if job.jobId() not in jobs_before]
    assert jobs and {job.description().get() for job in jobs} == {"microbatch clicks: 1 file(s)"}
    stages = {stage for job in jobs for stage in _scala_list(job.stageIds())}
    details = {store.lastStageAttempt(stage).details() for stage in stages}
    assert details and all(d.startswith("microbatch clicks: 1 file(s), offsets after {") for d in details), details


def test_two_reads_at_once_on_one_engine_each_transform_its_own_records(tmp_path, compute):
    """`catch_up` reads two batches at once (`reads_at_once`); each read's
    transform must run over its own records, though both name them `batch`
    in the one session. Two pipelines with different keys, read at once on
    two threads, over and over: a read that saw the other's view would
    return the other's keys."""
    from concurrent.futures import ThreadPoolExecutor

    from spark_jobs.sources import make_source
    from spark_jobs.sources.base import Caps
    from tests.conftest import BatchesLineage

    engine = compute()
    assert engine.reads_at_once == 2
    reads = []
    for name in ("a", "b"):
        spec = load_spec(write_spec(tmp_path / name, oracle_spec_dict(**SIMPLE)))
        lines = [f'{{"event_id":"{i}","user_id":"{name}{i % 7}","amount":{i}}}' for i in range(50)]
        (tmp_path / name / "landing" / "f.json").write_text("\n".join(lines) + "\n")
        reads.append((name, spec, make_source(spec).plan(BatchesLineage(), until=None, caps=Caps())))
    with ThreadPoolExecutor(2) as pool:
        for _ in range(8):
            results = list(pool.map(lambda read: (read[0], engine.process(read[1], read[2])), reads))
            for name, result in results:
                assert {key[0] for key in result.updates.column("user_id").to_pylist()} == {name}
                assert result.updates.num_rows == 7 and result.records_in == 50


def test_a_small_read_alongside_others_is_one_task_and_reads_the_same(tmp_path, compute):
    """A catch-up's reads run at once (`alongside`): a batch no bigger than
    Spark's split size is read in one partition, so the transform's
    aggregation needs no shuffle; a bigger one is split as Spark splits it.
    Either way the batch's result is the same as read alone."""
    from spark_jobs.sources import make_source
    from spark_jobs.sources.base import Caps
    from tests.conftest import BatchesLineage

    spec = load_spec(write_spec(tmp_path, oracle_spec_dict(**SIMPLE)))
    for f in range(2):
        lines = [f'{{"event_id":"{f}-{i}","user_id":"u{i % 13}","amount":{i}.25}}' for i in range(200)]
        (tmp_path / "landing" / f"f{f}.json").write_text("\n".join(lines) + "\n")
    batch = make_source(spec).plan(BatchesLineage(), until=None, caps=Caps())
    engine = compute()

    def plan_of(alongside: bool) -> str:
        query = engine._first_read(spec, batch, alongside=alongside).query
        return query.result._jdf.queryExecution().executedPlan().toString()

    def rows(result) -> list[dict]:
        return sorted(result.updates.to_pylist(), key=lambda r: r["user_id"])

    alone = engine.process(spec, batch)
    ahead = engine.process(spec, batch, alongside=True)
    assert rows(ahead) == rows(alone) and len(rows(alone)) == 13
    assert ahead.records_in == alone.records_in == 400
    assert "Exchange" in plan_of(False)
    assert "Exchange" not in plan_of(True) and "Coalesce 1" in plan_of(True)
    conf = engine.spark.conf
    split = conf.get("spark.sql.files.maxPartitionBytes")
    try:
        conf.set("spark.sql.files.maxPartitionBytes", "4k")  # the batch is some 20 kB
        assert "Exchange" in plan_of(True)
        assert rows(engine.process(spec, batch, alongside=True)) == rows(alone)
    finally:
        conf.set("spark.sql.files.maxPartitionBytes", split)
    # Where the reads at once leave cores free (here: Spark has 2, the
    # engine reads one at a time), a read is spread over them as alone.
    from spark_jobs.engine.spark_compute import SparkCompute

    class OneReadAtATime(SparkCompute):
        reads_at_once = 1

    engine = OneReadAtATime(session=engine.spark)
    assert engine.spark.sparkContext.defaultParallelism == 2
    assert "Exchange" in plan_of(True)
