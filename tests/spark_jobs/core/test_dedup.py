"""Duplicates dropped exactly once (`dedup:`), against an oracle.

Real Spark (the process's shared session), real Delta tables in `tmp_path`.
Each batch is one hand-written JSON file of clicks, some of them a
producer's retries (the same `event_id` again, in the same file or a later
one). The oracle takes a click unless its id was taken before and is still
remembered (with `within`: its event time no more than `within` behind the
watermark the batch judges by), and counts the rest as duplicates; the
state is clicks per user.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.faults import POINTS
from spark_jobs.core.ledger import OffsetLedger
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.errors import SpecError
from tests.conftest import crash_at, reach, run_cli, write_spec

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
DELAY = timedelta(minutes=10)


def _spec(
    tmp_path: Path, *, within: str | None = None, event_time: bool = True, layout: str = "merged", state_write: str = "auto",
    transform: str = "SELECT user_id, count(*) AS clicks FROM batch GROUP BY user_id",
) -> Path:
    spec = {
        "name": "deduped",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "event_id STRING, user_id STRING, ts TIMESTAMP"},
        "transform": transform,
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"clicks": "sum"}, "layout": layout},
        "checkpoint": "lake/_checkpoints/deduped",
        "engine": {"state_write": state_write},
        "dedup": {"key": ["event_id"], **({"within": within} if within else {})},
    }
    if event_time:
        spec["event_time"] = {"column": "ts", "delay": "10 minutes"}
    return write_spec(tmp_path, spec)


def _land(spec_path: Path, name: str, clicks: list[tuple[str, str, int]]) -> None:
    """A file of clicks: (event id, user, minutes after T0)."""
    lines = [json.dumps({"event_id": e, "user_id": u, "ts": (T0 + timedelta(minutes=m)).isoformat()}) for e, u, m in clicks]
    (spec_path.parent / "landing" / f"{name}.json").write_text("".join(line + "\n" for line in lines))


class Oracle:
    """Clicks per user once each id is taken; which ids are remembered; the watermark."""

    def __init__(self, within: timedelta | None = None, timed: bool = True) -> None:
        self.within, self.timed = within, timed
        self.watermark: datetime | None = None
        self.taken: dict[str, datetime] = {}  # id -> event time it was taken at
        self.clicks: dict[str, int] = {}
        self.duplicates: list[int] = []

    def batch(self, clicks: list[tuple[str, str, int]]) -> None:
        judged_by = self.watermark
        remembered = {
            e for e, at in self.taken.items() if self.within is None or judged_by is None or at >= judged_by - self.within
        }
        dropped, newest = 0, None
        # The earliest event time of an id in the batch is the one kept.
        for e, u, m in sorted(clicks, key=lambda c: (c[2], c[0], c[1])):
            at = T0 + timedelta(minutes=m)
            if self.timed and judged_by is not None and at < judged_by:
                continue  # late: quarantined before dedup sees it
            if e in remembered:
                dropped += 1
                continue
            remembered.add(e)
            self.taken[e] = at
            self.clicks[u] = self.clicks.get(u, 0) + 1
            newest = at if newest is None or at > newest else newest
        self.duplicates.append(dropped)
        if self.timed and newest is not None:
            candidate = newest - DELAY
            self.watermark = candidate if self.watermark is None or candidate > self.watermark else self.watermark


def _run(spec_path: Path, compute, **options):
    return run_batch(load_spec(spec_path), RunOptions(run_id="test", **options), compute_factory=compute)


def _state(spec_path: Path) -> dict[str, int]:
    table = open_table(str(spec_path.parent / "lake" / "state"))
    return {} if table is None else {r["user_id"]: r["clicks"] for r in read_all(table).to_pylist()}


def _committed(spec_path: Path):
    spec = load_spec(spec_path)
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    return sorted((r for r in rows if r.status == "committed"), key=lambda r: (r.epoch, r.batch_id))


BATCHES = [
    # a retry in the same file (e1 twice), and u2's two clicks
    [("e1", "u1", 0), ("e1", "u1", 0), ("e2", "u2", 5), ("e3", "u2", 6)],
    # a retry of e2 from the batch before, a new e4, and e4 again a minute later (kept: the earliest)
    [("e2", "u2", 5), ("e4", "u1", 20), ("e4", "u1", 21)],
    # e1 again, much later: still remembered (no within)
    [("e1", "u1", 0 + 30), ("e5", "u3", 40)],
]


@pytest.mark.parametrize("state_write", ["auto", "executors"])
def test_retries_across_batches_and_within_one_are_counted_once(tmp_path, compute, state_write):
    spec_path = _spec(tmp_path, state_write=state_write)
    oracle = Oracle()
    for i, clicks in enumerate(BATCHES):
        _land(spec_path, f"b{i}", clicks)
        outcome = _run(spec_path, compute)
        oracle.batch(clicks)
        assert outcome.records_duplicate == oracle.duplicates[-1], (i, outcome)
        assert _state(spec_path) == oracle.clicks, i
    assert [r.records_duplicate for r in _committed(spec_path)] == oracle.duplicates == [1, 2, 1]


#: Batches for `within: 30 minutes`: e1 is taken at 0; the watermark reaches
#: 25 after the second batch, so e1 (0 >= 25 - 30) is still remembered in the
#: third; the third moves it to 50, and e1 (0 < 50 - 30) is forgotten by the fourth.
WITHIN_BATCHES = [
    [("e1", "u1", 0), ("e2", "u2", 1)],
    [("e3", "u1", 35), ("e1", "u1", 30)],  # e1 again at 30: remembered, dropped
    [("e1", "u1", 26), ("e4", "u2", 60)],  # e1 at 26: not late (watermark 25), still remembered
    [("e1", "u1", 55), ("e5", "u3", 58)],  # e1 at 55: not late (watermark 50), forgotten: taken again
]


def test_ids_are_forgotten_once_the_watermark_passes_them_by_within(tmp_path, compute):
    spec_path = _spec(tmp_path, within="30 minutes")
    oracle = Oracle(within=timedelta(minutes=30))
    for i, clicks in enumerate(WITHIN_BATCHES):
        _land(spec_path, f"b{i}", clicks)
        assert _run(spec_path, compute).status == "committed"
        oracle.batch(clicks)
        assert _state(spec_path) == oracle.clicks, i
    assert [r.records_duplicate for r in _committed(spec_path)] == oracle.duplicates == [0, 1, 1, 0]
    assert oracle.clicks["u1"] == 3  # e1 counted twice: once, and again after it was forgotten
    # The next batch reads no file of ids all older than `within` allows (batch 1's, by its statistics).
    import pyarrow.parquet as pq

    from spark_jobs.core.dedup import remembered_at

    spec = load_spec(spec_path)
    remembered = remembered_at(spec, OffsetLedger(spec.ledger_path, spec.name).load())
    assert remembered is not None and remembered.since is not None
    every = open_table(spec.dedup_path).get_add_actions(flatten=True).column("path").to_pylist()
    skipped = set(every) - set(remembered.files())
    assert len(skipped) == 1 and len(every) == 4
    (ids,) = [pq.read_table(f"{spec.dedup_path}/{name}").to_pylist() for name in skipped]
    assert sorted(r["id"] for r in ids) == ['{"event_id":"e1"}', '{"event_id":"e2"}']
    assert all(r["event_time"] < remembered.since for r in ids)


def test_without_event_time_ids_are_remembered_for_ever(tmp_path, compute):
    spec_path = _spec(tmp_path, event_time=False)
    oracle = Oracle(timed=False)
    for i, clicks in enumerate([*BATCHES, [("e2", "u2", 900), ("e6", "u2", 0)]]):
        _land(spec_path, f"b{i}", clicks)
        assert _run(spec_path, compute).status == "committed"
        oracle.batch(clicks)
    assert _state(spec_path) == oracle.clicks
    assert [r.records_duplicate for r in _committed(spec_path)] == oracle.duplicates == [1, 2, 1, 1]


#: The kill `make test` runs (the ids written, the state not committed); `make soak` runs every point.
FAST_POINTS = ("after_quarantine",)


@pytest.mark.parametrize("point", [p if p in FAST_POINTS else pytest.param(p, marks=pytest.mark.slow) for p in POINTS])
def test_a_kill_at_any_point_counts_each_record_once(tmp_path, compute, point):
    """A batch with duplicates killed at `point`, then run again: its ids
    written by the dead attempt are not its own replay's duplicates."""
    spec_path = _spec(tmp_path)
    reach(point, spec_path)
    oracle = Oracle()
    _land(spec_path, "b0", BATCHES[0])
    assert _run(spec_path, compute).status == "committed"
    oracle.batch(BATCHES[0])
    _land(spec_path, "b1", BATCHES[1])
    with (spec_path.parent / "landing" / "b1.json").open("a") as landed:
        landed.write("{not json\n")  # a bad record, so that the quarantine's write point is reached too
    oracle.batch(BATCHES[1])
    with crash_at(point):
        _run(spec_path, compute)
    assert _run(spec_path, compute).status in ("committed", "no_new_data")
    assert _state(spec_path) == oracle.clicks
    assert [r.records_duplicate for r in _committed(spec_path)] == oracle.duplicates
    _land(spec_path, "b2", BATCHES[2])
    oracle.batch(BATCHES[2])
    assert _run(spec_path, compute).status == "committed"
    assert _state(spec_path) == oracle.clicks


def test_a_rewind_forgets_the_ids_of_the_batches_it_takes_back_and_maintain_deletes_them(tmp_path, compute):
    spec_path = _spec(tmp_path, within="30 minutes")
    for i, clicks in enumerate(WITHIN_BATCHES[:3]):
        _land(spec_path, f"b{i}", clicks)
        assert _run(spec_path, compute).status == "committed"
    assert rewind(load_spec(spec_path), 1, "test").status == "rewound"
    # The replay reads b1 and b2 again, in one batch now, judged by batch 1's
    # watermark (5): e1 is remembered from batch 1, and e3 and e4 are new again.
    oracle = Oracle(within=timedelta(minutes=30))
    oracle.batch(WITHIN_BATCHES[0])
    oracle.batch(WITHIN_BATCHES[1] + WITHIN_BATCHES[2])
    assert _run(spec_path, compute).status == "committed"
    assert _state(spec_path) == oracle.clicks
    assert _committed(spec_path)[-1].records_duplicate == oracle.duplicates[-1] == 2
    ids = str(spec_path.parent / "lake" / "_checkpoints" / "deduped" / "dedup")
    before = read_all(open_table(ids)).num_rows
    assert before == 2 + 1 + 1 + 2  # batch 1's, the abandoned 2 and 3's (e3, e4), the replay's (e3, e4 again)
    from spark_jobs.core.maintain import maintain

    report = maintain(load_spec(spec_path), keep_batches=1)
    rows = read_all(open_table(ids)).to_pylist()
    # The abandoned batches' ids went; with the oldest rewindable batch (2,
    # watermark 50 in the new epoch), so did the ids older than 50 - 30.
    assert report.forgotten_ids == before - len(rows)
    assert sorted(r["id"] for r in rows) == ['{"event_id":"e3"}', '{"event_id":"e4"}']
    # What is left still drops what it should: e4 again is a duplicate.
    _land(spec_path, "b9", [("e4", "u2", 60), ("e7", "u1", 61)])
    assert _run(spec_path, compute).records_duplicate == 1


def test_bad_dedup_blocks_are_refused_naming_the_field(tmp_path):
    spec_path = _spec(tmp_path, within="1 hour", event_time=False)
    with pytest.raises(SpecError, match=r"dedup\.within counts from each record's event time"):
        load_spec(spec_path)
    spec = yaml.safe_load(spec_path.read_text())
    spec["dedup"] = {"key": ["click_id"]}
    spec_path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"dedup\.key names 'click_id', not a column of the source's records"):
        load_spec(spec_path)
    spec["dedup"] = {"key": ["event_id", "event_id"]}
    spec_path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"dedup.*event_id twice"):
        load_spec(spec_path)


def test_the_cli_on_spark_connect_drops_duplicates_as_the_oracle_says(tmp_path, on_connect):
    spec_path = _spec(tmp_path)
    oracle = Oracle()
    for i, clicks in enumerate(BATCHES):
        _land(spec_path, f"b{i}", clicks)
        done = run_cli("run", str(spec_path))
        assert done.returncode == 0, done.stderr[-2000:]
        oracle.batch(clicks)
        assert f"dedup: {oracle.duplicates[-1]} duplicate record(s) dropped" in done.stdout, done.stdout
    assert _state(spec_path) == oracle.clicks
    shown = run_cli("history", str(spec_path), "--json")
    assert [r["records_duplicate"] for r in json.loads(shown.stdout) if r["status"] == "committed"] == oracle.duplicates
    assert "duplicates" in run_cli("history", str(spec_path)).stdout


@pytest.mark.parametrize("reader", ["driver", pytest.param("spark", marks=pytest.mark.slow)])
def test_a_delta_source_s_rows_are_deduplicated_by_either_reader(tmp_path, compute, reader):
    """An upstream Delta table's appends (the driver's reader, or delta-spark's
    on the executors), a retry of a row in a later version, beside a column
    no row can be ordered by (a MAP in a STRUCT); and a key the table does
    not have is refused naming `dedup.key`."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    tags = pa.struct([("m", pa.map_(pa.string(), pa.string()))])
    schema = pa.schema([("event_id", pa.string()), ("user_id", pa.string()), ("tags", tags)])

    def rows(events: list[str], users: list[str]) -> pa.Table:
        return pa.table({"event_id": events, "user_id": users, "tags": [{"m": [("k", "v")]}] * len(events)}, schema=schema)

    upstream = str(tmp_path / "upstream")
    DeltaTable.create(upstream, schema)
    spec = {
        "name": "deduped_delta",
        "source": {"type": "delta", "path": upstream, "read": "appends", "reader": reader},
        "transform": "SELECT user_id, count(*) AS clicks FROM batch GROUP BY user_id",
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"clicks": "sum"}},
        "checkpoint": "lake/_checkpoints/deduped",
        "dedup": {"key": ["event_id"]},
    }
    (tmp_path / "spec").mkdir()
    spec_path = tmp_path / "spec" / "pipeline.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    write_deltalake(upstream, rows(["e1", "e2", "e2"], ["u1", "u2", "u2"]), mode="append")
    assert _run(spec_path, compute).records_duplicate == 1
    write_deltalake(upstream, rows(["e1", "e3"], ["u1", "u1"]), mode="append")
    assert _run(spec_path, compute).records_duplicate == 1
    assert _state(spec_path) == {"u1": 2, "u2": 1}
    spec["dedup"] = {"key": ["click_id"]}
    spec_path.write_text(yaml.safe_dump(spec))
    write_deltalake(upstream, rows(["e4"], ["u1"]), mode="append")
    with pytest.raises(SpecError, match=r"dedup\.key names 'click_id', not a column of the source's records \(event_id, user_id, tags"):
        _run(spec_path, compute)
    assert len(_committed(spec_path)) == 2


def test_a_delta_source_column_named_like_dedup_s_own_is_refused_before_any_commit(tmp_path, compute):
    """A Delta table's columns may have any name (a files source's schema
    may not start one with two underscores): one the job gives its own
    column while it drops duplicates would have been overwritten silently.
    Known when the batch is planned, as a missing `dedup.key` is: the
    ledger's planned row is written, nothing is committed."""
    import pyarrow as pa
    from deltalake import write_deltalake

    upstream = str(tmp_path / "upstream")
    write_deltalake(upstream, pa.table({"event_id": ["e1", "e1"], "user_id": ["u1", "u1"], "__dedup_id": ["mine", "mine"]}))
    spec_path = write_spec(tmp_path / "spec", {
        "name": "deduped_delta",
        "source": {"type": "delta", "path": upstream, "read": "appends", "reader": "driver"},
        "transform": "SELECT user_id, max(__dedup_id) AS tag FROM batch GROUP BY user_id",
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"tag": "max"}},
        "checkpoint": "lake/_checkpoints/deduped",
        "dedup": {"key": ["event_id"]},
    })
    with pytest.raises(SpecError, match=r"the source's column '__dedup_id' has a name the job gives its own column"):
        _run(spec_path, compute)
    assert _committed(spec_path) == [] and _state(spec_path) == {}


def test_a_batch_of_duplicates_only_counts_them_and_a_transform_that_keeps_nothing_still_records_its_ids(tmp_path, compute):
    """Stages that come out empty (adaptive execution drops their observed
    metrics): every record a duplicate; then every kept record filtered out
    by the transform, whose ids a later retry must still find."""
    spec_path = _spec(tmp_path, transform="SELECT user_id, count(*) AS clicks FROM batch WHERE user_id <> 'u9' GROUP BY user_id")
    _land(spec_path, "b0", [("e1", "u1", 0), ("e2", "u2", 1)])
    assert _run(spec_path, compute).records_duplicate == 0
    _land(spec_path, "b1", [("e1", "u1", 0), ("e2", "u2", 1), ("e2", "u2", 1)])
    assert _run(spec_path, compute).records_duplicate == 3
    _land(spec_path, "b2", [("e9", "u9", 5)])  # taken, then filtered out by the transform
    assert _run(spec_path, compute).records_duplicate == 0
    _land(spec_path, "b3", [("e9", "u9", 5), ("e3", "u3", 6)])
    assert _run(spec_path, compute).records_duplicate == 1
    assert _state(spec_path) == {"u1": 1, "u2": 1, "u3": 1}


def test_a_file_read_again_by_line_takes_its_ids_once_and_leaves_no_ids_file_behind(tmp_path, compute):
    """The executors write the ids in the job that writes the result
    (`dedup_rows.together`). A bad line makes the native read's files
    void and the file is read again by line: the ids the first job wrote
    must go with its result, or a retry would find ids no batch committed,
    or the dedup folder would hold files no table lists."""
    spec_path = _spec(tmp_path, state_write="executors")
    _land(spec_path, "b0", [("e1", "u1", 0), ("e1", "u1", 0), ("e2", "u2", 1)])
    with (spec_path.parent / "landing" / "b0.json").open("a") as f:
        f.write('{"event_id": "e3", "user_id": "u3", "ts": "not a time"}\n')
    outcome = _run(spec_path, compute)
    assert (outcome.records_duplicate, outcome.records_quarantined) == (1, 1)
    _land(spec_path, "b1", [("e2", "u2", 1), ("e4", "u4", 2)])
    assert _run(spec_path, compute).records_duplicate == 1
    assert _state(spec_path) == {"u1": 1, "u2": 1, "u4": 1}
    dedup_path = load_spec(spec_path).dedup_path
    listed = {Path(uri).name for uri in open_table(dedup_path).file_uris()}
    assert {p.name for p in Path(dedup_path).glob("*.parquet")} == listed
    assert len(listed) == 2


def test_a_key_of_a_timestamp_and_a_double_is_exact_to_the_microsecond_and_takes_minus_zero_as_zero(tmp_path, compute):
    spec = yaml.safe_load(_spec(tmp_path).read_text())
    spec["source"]["schema"] = "event_id STRING, user_id STRING, ts TIMESTAMP, score DOUBLE"
    spec["dedup"] = {"key": ["ts", "score"]}
    spec_path = write_spec(tmp_path, spec)
    at = "2026-12-01T10:00:00.00000{}Z"
    lines = [{"event_id": "a", "user_id": "u1", "ts": at.format(1), "score": 0.0}, {"event_id": "b", "user_id": "u1", "ts": at.format(2), "score": 0.0},
             {"event_id": "c", "user_id": "u1", "ts": at.format(1), "score": -0.0}]
    (spec_path.parent / "landing" / "b0.json").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert _run(spec_path, compute).records_duplicate == 1
    assert _state(spec_path) == {"u1": 2}


def test_within_added_to_a_running_dedup_still_knows_the_ids_taken_before(tmp_path, compute):
    spec_path = _spec(tmp_path)
    _land(spec_path, "b0", [("e1", "u1", 0)])
    assert _run(spec_path, compute).records_duplicate == 0
    spec = yaml.safe_load(spec_path.read_text())
    spec["dedup"]["within"] = "1 day"
    spec_path.write_text(yaml.safe_dump(spec))
    _land(spec_path, "b1", [("e1", "u1", 0)])
    assert _run(spec_path, compute).records_duplicate == 1


def test_maintain_keeps_the_ids_of_every_batch_a_rewind_still_accepts(tmp_path, compute):
    """`keep_batches: 1` keeps one batch's state version, but a rewind accepts
    any batch whose state it can still restore: the ids that batch's replay
    reads stay."""
    from spark_jobs.core.maintain import maintain

    spec_path = _spec(tmp_path, within="30 minutes")
    for i, clicks in enumerate([[("e1", "u1", 0)], [("e2", "u2", 50)], [("e3", "u3", 55), ("e1", "u1", 0)]]):
        _land(spec_path, f"b{i}", clicks)
        assert _run(spec_path, compute).status == "committed"
    maintain(load_spec(spec_path), keep_batches=1)
    assert rewind(load_spec(spec_path), 1, "test").status == "rewound"
    # The replay reads b1 and b2 by batch 1's watermark: e1 (late before) is a duplicate now.
    assert _run(spec_path, compute).records_duplicate == 1
    assert _state(spec_path) == {"u1": 1, "u2": 1, "u3": 1}


def test_a_bound_in_year_one_reads_every_file_and_an_old_bound_is_exact_in_spark(tmp_path, spark):
    """`within` behind a watermark in the first second of year 1: no file
    is skipped (the bound less its margin is before year 1) rather than a
    failure every run (found by a try-to-break pass); and the bound Spark
    filters by is the same instant before 1582 too (`F.lit` of a datetime
    moves it by days there, through Spark's change of calendar)."""
    import pyarrow as pa
    from deltalake import write_deltalake
    from pyspark.sql import functions as F

    from spark_jobs.core.dedup import SCHEMA, Remembered
    from spark_jobs.engine.event_marks import instant

    table = str(tmp_path / "dedup")
    ids = pa.table({"pipeline": ["p"], "epoch": [0], "batch_id": [1], "id": ['{"k":"a"}'],
                    "event_time": pa.array([datetime(1, 1, 1, tzinfo=UTC)], pa.timestamp("us", tz="UTC"))}, schema=SCHEMA)
    write_deltalake(table, ids)
    since = datetime(1, 1, 1, 0, 0, 0, 500000, tzinfo=UTC)
    assert len(Remembered(table, "p", "true", since).files()) == 1
    for moment in (since, datetime(1000, 1, 1, tzinfo=UTC), datetime(1582, 10, 10, 12, tzinfo=UTC)):
        micros = (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
        assert spark.range(1).select(F.unix_micros(instant(moment)).alias("m")).first()["m"] == micros, moment
