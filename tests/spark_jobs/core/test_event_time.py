"""Event time: the watermark each batch leaves, and late records, against an oracle.

Real Spark (the process's shared session), real Delta tables in `tmp_path`.
Each batch is one hand-written JSON file whose records' event times are
chosen so that the oracle below knows which are late: a record is late when
its event time is before the watermark the batch before it left (the newest
event time taken so far, minus the delay).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.event_time import iso
from spark_jobs.core.faults import POINTS
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.errors import SpecChangedError, SpecError
from tests.conftest import crash_at, reach, run_cli, write_spec

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
DELAY = timedelta(minutes=10)


def _spec(tmp_path: Path, late: str = "quarantine", **event_time) -> Path:
    spec = {
        "name": "timed",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "event_id STRING, user_id STRING, ts TIMESTAMP"},
        "transform": "SELECT user_id, count(*) AS events, max(ts) AS last_ts FROM batch GROUP BY user_id",
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum", "last_ts": "max"}},
        "checkpoint": "lake/_checkpoints/timed",
        "event_time": {"column": "ts", "delay": "10 minutes", "late": late, **event_time},
    }
    return write_spec(tmp_path, spec)


def _land(spec_path: Path, name: str, minutes: list[int | None], user: str = "u") -> list[dict]:
    """One file of records at T0 + each minute (None: no event time), one user per record."""
    records = [
        {"event_id": f"{name}-{i}", "user_id": f"{user}{i % 3}", "ts": None if m is None else (T0 + timedelta(minutes=m)).isoformat()}
        for i, m in enumerate(minutes)
    ]
    (spec_path.parent / "landing" / f"{name}.json").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


class Oracle:
    """What the pipeline should hold: the taken records' counts per user, the
    watermark after each batch, and the late records of each."""

    def __init__(self, late: str) -> None:
        self.policy = late
        self.watermark: datetime | None = None
        self.events: dict[str, int] = {}

    def batch(self, records: list[dict]) -> tuple[int, list[dict]]:
        late, taken = [], []
        for r in records:
            if r["ts"] is None:
                continue  # quarantined: no event time
            moment = datetime.fromisoformat(r["ts"])
            if self.watermark is not None and moment < self.watermark:
                late.append(r)
                if self.policy != "accept":
                    continue
            taken.append(r)
        for r in taken:
            self.events[r["user_id"]] = self.events.get(r["user_id"], 0) + 1
        newest = max((datetime.fromisoformat(r["ts"]) for r in taken), default=None)
        if newest is not None:
            self.watermark = max(w for w in (self.watermark, newest - DELAY) if w is not None)
        return len(late), late


def _run(spec_path: Path, compute, **options):
    return run_batch(load_spec(spec_path), RunOptions(run_id="test", **options), compute_factory=compute)


def _state(spec_path: Path, total: str = "events") -> dict[str, int]:
    rows = read_all(open_table(str(spec_path.parent / "lake/state"))).to_pylist()
    return {r["user_id"]: r[total] for r in rows}


def _rows(spec_path: Path) -> list:
    spec = load_spec(spec_path)
    ledger = OffsetLedger(spec.ledger_path, spec.name)
    return sorted((r for r in ledger.load().rows if r.status is not RowStatus.PLANNED), key=lambda r: (r.epoch, r.batch_id))


def _quarantined(spec_path: Path) -> list[dict]:
    table = open_table(str(spec_path.parent / "lake/_checkpoints/timed/quarantine"))
    return [] if table is None else read_all(table).to_pylist()


@pytest.mark.parametrize("late", ["quarantine", "drop", "accept"])
def test_out_of_order_records_and_a_late_file_are_judged_by_the_watermark_before_them(tmp_path, compute, late):
    spec_path = _spec(tmp_path, late)
    oracle = Oracle(late)
    waves = [
        [30, 5, 20, 0, 25],  # out of order within the file; the first batch: nothing is late
        [14, 21, 40, 19, 35],  # 14 and 19 are before 20 (30 - 10): late
        [29, 31, 45, None],  # 29 is late against 30; a record with no event time
        [],  # (no file: a run with nothing new leaves the watermark as it is)
        [34, 36, 120],  # 34 late against 35
    ]
    for n, minutes in enumerate(waves):
        if not minutes:
            assert _run(spec_path, compute).status == "no_new_data"
            continue
        records = _land(spec_path, f"f{n}", minutes)
        expected_late, _ = oracle.batch(records)
        outcome = _run(spec_path, compute)
        assert outcome.status == "committed", outcome.message
        head = _rows(spec_path)[-1]
        assert head.records_late == expected_late, (n, head.records_late, expected_late)
        assert head.watermark == oracle.watermark, (n, head.watermark, oracle.watermark)
    assert _state(spec_path) == oracle.events

    reasons = sorted(r["reason"] for r in _quarantined(spec_path))
    no_time = ["no event time: ts is null (event_time.column)"]
    if late == "quarantine":
        assert reasons == sorted([
            "late: event time 2026-12-01T10:14:00Z is before the watermark 2026-12-01T10:20:00Z",
            "late: event time 2026-12-01T10:19:00Z is before the watermark 2026-12-01T10:20:00Z",
            "late: event time 2026-12-01T10:29:00Z is before the watermark 2026-12-01T10:30:00Z",
            "late: event time 2026-12-01T10:34:00Z is before the watermark 2026-12-01T10:35:00Z",
            *no_time,
        ])
        assert {r["line"] for r in _quarantined(spec_path) if r["reason"].startswith("late")} == {1, 4}
    else:
        assert reasons == no_time  # dropped or accepted: counted, not quarantined


def test_a_replay_judges_against_the_same_watermark_and_leaves_the_same_one(tmp_path, compute):
    """A run killed after its read (its late records counted) and the retry
    that replays the planned range: one commit, the watermark the oracle says."""
    spec_path = _spec(tmp_path)
    oracle = Oracle("quarantine")
    oracle.batch(_land(spec_path, "f0", [30, 0]))
    assert _run(spec_path, compute).status == "committed"
    expected_late, _ = oracle.batch(_land(spec_path, "f1", [5, 50]))
    with crash_at("after_quarantine"):
        _run(spec_path, compute)
    # Newer records landing meanwhile must not move the watermark the replay judges against.
    _land(spec_path, "f2", [90])
    assert _run(spec_path, compute).status == "committed"
    rows = _rows(spec_path)
    assert [r.batch_id for r in rows] == [1, 2]
    assert rows[-1].records_late == expected_late == 1 and rows[-1].watermark == oracle.watermark
    assert len([r for r in _quarantined(spec_path) if r["reason"].startswith("late")]) == 1


def test_a_rewind_carries_on_from_the_watermark_of_the_batch_it_returns_to(tmp_path, compute):
    spec_path = _spec(tmp_path)
    _land(spec_path, "f0", [30])  # watermark 10:20
    assert _run(spec_path, compute).status == "committed"
    _land(spec_path, "f1", [90])  # watermark 11:20
    assert _run(spec_path, compute).status == "committed"
    assert _rows(spec_path)[-1].watermark == T0 + timedelta(minutes=80)
    rewind(load_spec(spec_path), 1, run_id="test")
    head = _rows(spec_path)[-1]
    assert head.status is RowStatus.REWOUND and head.watermark == T0 + timedelta(minutes=20)
    # The replay of f1 after the rewind is judged against 10:20 again: 90 is not late.
    _land(spec_path, "f2", [25, 15])  # 15 is late against 10:20, 25 is not
    assert _run(spec_path, compute).status == "committed"
    head = _rows(spec_path)[-1]
    assert head.records_late == 1 and head.watermark == T0 + timedelta(minutes=80)


def test_the_watermark_keeps_time_with_the_schedule_when_asked(tmp_path, compute):
    """`advance_with_schedule`: the data interval's end minus the delay, once
    later than the records'; never back."""
    spec_path = _spec(tmp_path, advance_with_schedule=True)
    end = T0 + timedelta(hours=2)

    def land(name: str, minutes: list[int]) -> None:
        _land(spec_path, name, minutes)  # arriving within the interval it is run for
        os.utime(spec_path.parent / "landing" / f"{name}.json", (end.timestamp() - 60, end.timestamp() - 60))

    land("f0", [0])
    assert _run(spec_path, compute, interval_end=end).status == "committed"
    assert _rows(spec_path)[-1].watermark == end - DELAY
    land("f1", [60, 200])  # 60 is late against 11:50; 200 moves it to 13:10
    assert _run(spec_path, compute, interval_end=end).status == "committed"
    head = _rows(spec_path)[-1]
    assert head.records_late == 1 and head.watermark == T0 + timedelta(minutes=190)


def test_the_executors_judge_late_records_the_same(tmp_path, compute):
    """`state_write: executors`: the rows and the quarantine written as files by Spark's tasks."""
    spec_path = _spec(tmp_path)
    spec = yaml.safe_load(spec_path.read_text())
    spec["engine"] = {"state_write": "executors"}
    spec_path.write_text(yaml.safe_dump(spec))
    oracle = Oracle("quarantine")
    for n, minutes in enumerate([[30, 0], [5, 50, 19, None]]):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        assert _run(spec_path, compute).status == "committed"
    head = _rows(spec_path)[-1]
    assert (head.records_late, head.watermark, head.records_quarantined) == (2, oracle.watermark, 3)
    assert _state(spec_path) == oracle.events


@pytest.mark.parametrize(
    ("event_time", "problem"),
    [
        ({"column": "when", "delay": "1 hour"}, "line 18, field `event_time.column`: 'when' is not a column of the source's records"),
        ({"column": "user_id", "delay": "1 hour"}, "field `event_time.column`: 'user_id' is STRING: an event time is a TIMESTAMP or DATE column"),
        ({"column": "ts", "delay": "an hour"}, "field `event_time.delay`: 'an hour' is not a duration"),
        ({"column": "ts", "delay": "1000000 days"}, "'1000000 days' is longer than 36,500 days"),
        ({"column": "ts", "delay": "1 hour", "late": "ignore"}, "event_time.late"),
    ],
)
def test_a_bad_event_time_block_fails_before_any_write_naming_its_field(tmp_path, event_time, problem):
    spec_path = _spec(tmp_path)
    spec = yaml.safe_load(spec_path.read_text())
    spec["event_time"] = event_time
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SpecError) as caught:
        load_spec(spec_path)
    assert problem in str(caught.value)
    assert not (tmp_path / "lake").exists()


def test_the_cli_shows_the_watermark_and_the_late_records(tmp_path, on_connect):
    """What a user sees: each run's late count and watermark, `status`'s
    watermark, `history`'s columns (a new process each, as a user runs them)."""
    spec_path = _spec(tmp_path, late="drop")
    _land(spec_path, "f0", [30, 0])
    first = run_cli("run", str(spec_path))
    assert first.returncode == 0, first.stderr
    assert "event time: 0 late record(s); watermark 2026-12-01T10:20:00Z" in first.stdout
    _land(spec_path, "f1", [5, 50, 19])
    second = run_cli("run", str(spec_path), "--json")
    assert second.returncode == 0, second.stderr
    outcome = json.loads(second.stdout)
    assert (outcome["records_late"], outcome["watermark"], outcome["records_quarantined"]) == (2, "2026-12-01T10:40:00+00:00", 0)
    status = run_cli("status", str(spec_path))
    assert "watermark: 2026-12-01T10:40:00Z (records before it are late: event_time.late drop)" in status.stdout, status.stdout
    history = json.loads(run_cli("history", str(spec_path), "--json").stdout)
    committed = [r for r in history if r["status"] == "committed"]
    assert [(r["records_late"], r["watermark"]) for r in committed] == [
        (0, "2026-12-01T10:20:00+00:00"),
        (2, "2026-12-01T10:40:00+00:00"),
    ]


@pytest.mark.parametrize(("reader", "read"), [("driver", "appends"), ("spark", "changes")])
def test_a_delta_source_quarantines_its_late_rows_at_their_version(tmp_path, compute, reader, read):
    """A Delta table's rows judged by event time, read by the driver or by
    delta-spark: a late row goes to the quarantine as JSON, placed at its
    upstream version (the batch's versions when the rows do not say theirs)."""
    import pyarrow as pa
    from deltalake import write_deltalake

    upstream = tmp_path / "upstream"

    def append(minutes: list[int]) -> None:
        moments = [T0 + timedelta(minutes=m) for m in minutes]
        rows = pa.table({"user_id": [f"u{m % 2}" for m in minutes], "at": pa.array(moments, pa.timestamp("us", tz="UTC"))})
        write_deltalake(str(upstream), rows, mode="append", configuration={"delta.enableChangeDataFeed": "true"})

    append([30, 0])  # version 0
    spec = _delta_spec({"read": read, "reader": reader}, "SELECT user_id, count(*) AS events FROM batch GROUP BY user_id", "events", "at")
    spec_path = tmp_path / "pipeline.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert _run(spec_path, compute).status == "committed"  # watermark 10:20
    append([5, 50])  # version 1: 5 is late
    assert _run(spec_path, compute).status == "committed"
    head = _rows(spec_path)[-1]
    assert (head.records_late, head.watermark, head.records_quarantined) == (1, T0 + timedelta(minutes=40), 1)
    (late,) = _quarantined(spec_path)
    assert late["file"] == f"{upstream.resolve()}@v1" if read == "changes" else late["file"].endswith("@v1..1")
    assert late["reason"] == "late: event time 2026-12-01T10:05:00Z is before the watermark 2026-12-01T10:20:00Z"
    assert json.loads(late["raw"])["user_id"] == "u1"
    assert _state(spec_path) == {"u0": 3}  # 30, 0 and 50; 5 (u1) is late
    spec["event_time"]["column"] = "user_id"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    append([60])
    with pytest.raises(SpecError, match="event_time.column 'user_id' is string in the source table"):
        _run(spec_path, compute)
    assert _rows(spec_path)[-1].batch_id == 2  # nothing planned


def test_the_schedule_moves_the_watermark_only_past_a_batch_that_took_everything_waiting(tmp_path, compute):
    """Files that arrived within the delay, taken one a batch (`max_files`):
    none is late, and the interval's end counts once nothing waits."""
    spec_path = _spec(tmp_path, advance_with_schedule=True)
    end = T0 + timedelta(hours=2, minutes=30)
    for n, minutes in enumerate([0, 60, 120]):
        _land(spec_path, f"f{n}", [minutes])
        arrived = (T0 + timedelta(minutes=minutes + 5)).timestamp()
        os.utime(spec_path.parent / "landing" / f"f{n}.json", (arrived, arrived))
    for _ in range(3):
        assert _run(spec_path, compute, interval_end=end, max_files=1).status == "committed"
    rows = _rows(spec_path)
    assert [r.records_late for r in rows] == [0, 0, 0]
    assert [r.watermark for r in rows] == [T0 - DELAY, T0 + timedelta(minutes=50), end - DELAY]


def test_a_batch_without_event_time_carries_the_watermark_on(tmp_path, compute):
    """The block taken out for a batch and put back: the watermark never moves back."""
    spec_path = _spec(tmp_path)
    timed = spec_path.read_text()
    _land(spec_path, "f0", [60])  # 10:50
    assert _run(spec_path, compute).status == "committed"
    plain = yaml.safe_load(timed)
    del plain["event_time"]
    spec_path.write_text(yaml.safe_dump(plain))
    _land(spec_path, "f1", [0])
    assert _run(spec_path, compute).status == "committed"
    assert (_rows(spec_path)[-1].watermark, _rows(spec_path)[-1].records_late) == (T0 + timedelta(minutes=50), None)
    spec_path.write_text(timed)
    _land(spec_path, "f2", [45, 55])  # 45 is late against 10:50
    assert _run(spec_path, compute).status == "committed"
    head = _rows(spec_path)[-1]
    assert (head.records_late, head.watermark) == (1, T0 + timedelta(minutes=50))


def test_a_replay_under_another_event_time_block_is_refused_until_it_is_put_back(tmp_path, compute):
    """Its first attempt quarantined a late record: a replay accepting it would
    count it in the state as well."""
    spec_path = _spec(tmp_path)
    timed = spec_path.read_text()
    _land(spec_path, "f0", [30])
    assert _run(spec_path, compute).status == "committed"
    _land(spec_path, "f1", [5, 40])
    with crash_at("after_quarantine"):
        _run(spec_path, compute)
    spec_path.write_text(timed.replace("late: quarantine", "late: accept"))
    with pytest.raises(SpecChangedError, match="was planned with event_time"):
        _run(spec_path, compute)
    spec_path.write_text(timed)
    assert _run(spec_path, compute).status == "committed"
    assert len(_quarantined(spec_path)) == 1 and _state(spec_path) == {"u0": 1, "u1": 1}  # 30 and 40; 5 late


def test_event_times_at_the_ends_of_the_calendar(tmp_path, compute):
    """Year 1 (a placeholder some producers write) less the delay is no
    watermark at all, and so is year 0, which Spark holds and Python does
    not; a later batch moves it as usual, and then year 0 is late."""
    spec_path = _spec(tmp_path)
    for n, ts in enumerate(["0001-01-01T00:00:00Z", "0000-06-01T00:00:00Z"]):
        (spec_path.parent / "landing" / f"a{n}.json").write_text(json.dumps({"event_id": f"a{n}", "user_id": "u0", "ts": ts}) + "\n")
        assert _run(spec_path, compute).status == "committed"
        assert _rows(spec_path)[-1].watermark is None
    _land(spec_path, "f1", [30])
    assert _run(spec_path, compute).status == "committed"
    assert _rows(spec_path)[-1].watermark == T0 + timedelta(minutes=20)
    (spec_path.parent / "landing" / "f2.json").write_text('{"event_id": "e2", "user_id": "u0", "ts": "0000-06-01T00:00:00Z"}\n')
    assert _run(spec_path, compute).status == "committed"
    assert _rows(spec_path)[-1].records_late == 1


def test_a_catch_up_judges_an_event_time_before_year_1_as_one_batch_at_a_time_does(tmp_path, compute):
    """Batch 3 is read ahead while batch 1 (no event time: no watermark)
    commits, against no watermark; its year-0 record is on time there and
    late against batch 2's watermark, so that read is made again."""
    from spark_jobs.core.catch_up import catch_up

    spec_path = _spec(tmp_path)
    _land(spec_path, "f0", [None])
    _land(spec_path, "f1", [10])
    (spec_path.parent / "landing" / "f2.json").write_text(
        '{"event_id": "e0", "user_id": "u0", "ts": "0000-06-01T00:00:00Z"}\n' + json.dumps({"event_id": "e1", "user_id": "u0", "ts": (T0 + timedelta(minutes=20)).isoformat()}) + "\n"
    )
    outcomes = catch_up(load_spec(spec_path), RunOptions(run_id="catch-up", max_files=1), compute)
    assert [o.status for o in outcomes] == ["committed"] * 3 + ["no_new_data"]
    assert "read_ahead" not in outcomes[2].steps_ms
    assert [(r.records_late, r.watermark) for r in _rows(spec_path)] == [(0, None), (0, T0), (1, T0 + timedelta(minutes=10))]
    assert sorted(r["reason"] for r in _quarantined(spec_path)) == [
        f"late: event time 0000-06-01T00:00:00Z is before the watermark {iso(T0)}",
        "no event time: ts is null (event_time.column)",
    ]
    assert _state(spec_path) == {"u0": 2}


@pytest.mark.slow
def test_a_kill_at_every_point_leaves_the_watermark_and_the_late_records_the_oracle_says(tmp_path, compute):
    """Soak: a batch with late records and one without an event time, killed
    at each point of the protocol in turn, then run again: every batch's
    watermark and late count, the quarantine and the state are the oracle's."""
    spec_path = _spec(tmp_path)
    oracle = Oracle("quarantine")
    oracle.batch(_land(spec_path, "f0", [30, 0]))
    assert _run(spec_path, compute).status == "committed"
    expected = []
    for n, point in enumerate(POINTS, start=1):
        base = 30 + 10 * n
        late, _ = oracle.batch(_land(spec_path, f"f{n}", [base, base - 25, None, base - 5]))  # base - 25 is late
        expected.append((late, oracle.watermark))
        reach(point, spec_path)
        with crash_at(point):
            _run(spec_path, compute)
        # The next run redoes the batch, or (a kill after the state commit) completes it.
        assert _run(spec_path, compute).status in ("committed", "no_new_data")
    rows = [r for r in _rows(spec_path) if r.batch_id > 1]
    assert [(r.records_late, r.watermark) for r in rows] == expected
    quarantined = _quarantined(spec_path)
    assert sorted(r["reason"][:4] for r in quarantined) == sorted(["late", "no e"] * len(POINTS))
    assert _state(spec_path) == oracle.events


def test_a_catch_up_judges_each_batch_by_the_watermark_the_one_before_left(tmp_path, compute):
    """Batches back to back in one process (`--catch-up`), one file each: no
    read made ahead judges a batch against a watermark not yet left."""
    from spark_jobs.core.catch_up import catch_up

    spec_path = _spec(tmp_path)
    oracle = Oracle("quarantine")
    expected = []
    for n, minutes in enumerate([[30], [15, 45], [30, 70], [55, 90]]):  # 15, 30 and 55 are late in turn
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        expected.append(oracle.watermark)
    outcomes = catch_up(load_spec(spec_path), RunOptions(run_id="catch-up", max_files=1), compute)
    assert [o.status for o in outcomes][:4] == ["committed"] * 4
    rows = _rows(spec_path)
    assert [(r.records_late, r.watermark) for r in rows] == list(zip([0, 1, 1, 1], expected))
    assert _state(spec_path) == oracle.events


@pytest.mark.parametrize("late", ["drop", "quarantine"])
def test_a_catch_up_takes_a_read_made_ahead_against_a_guessed_watermark_only_where_it_judged_alike(tmp_path, compute, late):
    """Reads ahead are judged against guesses: batch 2's exactly (batch 1's
    read is done), batch 3's and later by the last step. Batch 5's guess (80)
    is short of the watermark batch 4 leaves (110) and its record at 100
    lies between: judged on time, it is late, so the read is made again.
    Batch 6's guess (160) is past its watermark (120), but none of its
    records lies between: the read stands, unless a late record's reason
    (naming the guess) would go to the quarantine."""
    from spark_jobs.core.catch_up import catch_up

    spec_path = _spec(tmp_path, late=late)
    oracle = Oracle(late)
    expected = []
    for n, minutes in enumerate([[30], [40, 50], [60, 70], [65, 120], [100, 130], [105, 170]]):
        records_late, _ = oracle.batch(_land(spec_path, f"f{n}", minutes))
        expected.append((records_late, oracle.watermark))
    outcomes = catch_up(load_spec(spec_path), RunOptions(run_id="catch-up", max_files=1), compute)
    assert [o.status for o in outcomes] == ["committed"] * 6 + ["no_new_data"]
    assert ["read_ahead" in o.steps_ms for o in outcomes[:6]] == [False, True, True, True, False, late != "quarantine"]
    assert [(r.records_late, r.watermark) for r in _rows(spec_path)] == expected
    assert [n for n, _ in expected] == [0, 0, 0, 0, 1, 1]
    assert _state(spec_path) == oracle.events
    if late == "quarantine":
        assert sorted(r["reason"] for r in _quarantined(spec_path)) == [
            f"late: event time {iso(T0 + timedelta(minutes=m))} is before the watermark {iso(T0 + timedelta(minutes=w))}" for m, w in [(100, 110), (105, 120)]
        ]


def test_a_delta_change_feed_judges_its_inserts_only(tmp_path, compute):
    """An upstream update's pre-image carries the row's old event time: judged
    apart it would be late and quarantined while its post-image is taken, and
    a downstream netting the two would count the row twice (found by a review)."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    upstream = str(tmp_path / "upstream")
    moments = [T0, T0 + timedelta(minutes=30), T0 + timedelta(minutes=5)]
    rows = pa.table({"user_id": ["a", "b", "c"], "ts": pa.array(moments, pa.timestamp("us", tz="UTC")), "amount": [1, 1, 1]})
    write_deltalake(upstream, rows, configuration={"delta.enableChangeDataFeed": "true"})
    netted = "SELECT user_id, sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN amount ELSE -amount END) AS amount FROM batch GROUP BY user_id"
    spec = _delta_spec({"read": "changes", "reader": "driver"}, netted, "amount", "ts")
    spec_path = tmp_path / "pipeline.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert _run(spec_path, compute).status == "committed"  # watermark 10:20
    DeltaTable(upstream).update(predicate="user_id = 'a'", updates={"ts": "'2026-12-01T10:50:00Z'::timestamp", "amount": "5"})
    DeltaTable(upstream).delete("user_id = 'c'")  # its old event time, 10:05, is before 10:20 too
    assert _run(spec_path, compute).status == "committed"
    head = _rows(spec_path)[-1]
    assert (head.records_late, head.records_quarantined, head.watermark) == (0, 0, T0 + timedelta(minutes=40))
    assert _state(spec_path, "amount") == {"a": 5, "b": 1, "c": 0}


def _delta_spec(source: dict, transform: str, total: str, column: str) -> dict:
    """A pipeline over the Delta table `upstream`, summing `total` per user, with event time on `column`."""
    return {
        "name": "timed",
        "source": {"type": "delta", "path": "upstream", **source},
        "transform": transform,
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {total: "sum"}},
        "checkpoint": "lake/_checkpoints/timed",
        "event_time": {"column": column, "delay": "10 minutes"},
    }
