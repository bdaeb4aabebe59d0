"""Windows over event time: final rows appended once, and expiry, against an oracle.

Real Spark (the process's shared session), real Delta tables in `tmp_path`.
Each batch is one hand-written JSON file of clicks; the oracle knows each
batch's watermark (the newest click taken so far less 10 minutes), which
clicks are late (before the watermark the batch before left: quarantined),
which windows are final after each batch (ended at or before its watermark),
and which state rows have expired (their window ended more than `after`
before it).
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.faults import POINTS, WINDOW_POINTS
from spark_jobs.core.inspect import LATE_REASON, quarantined, status
from spark_jobs.core.ledger import OffsetLedger
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.errors import SpecChangedError, SpecError, TransformError
from tests.conftest import crash_at, reach, run_cli, write_spec

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
DELAY = timedelta(minutes=10)
SIZE = timedelta(minutes=30)
AFTER = timedelta(minutes=60)


def _spec(tmp_path: Path, *, slide: str | None = None, layout: str = "merged", state_write: str = "auto", **event_time) -> Path:
    window = f"window(ts, '30 minutes'{f', {slide!r}' if slide else ''})"
    spec = {
        "name": "windowed",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "event_id STRING, user_id STRING, ts TIMESTAMP"},
        "transform": f"SELECT user_id, {window}.start AS win, count(*) AS clicks FROM batch GROUP BY user_id, {window}",
        "state": {"path": "lake/state", "keys": ["user_id", "win"], "merge": {"clicks": "sum"}, "layout": layout},
        "checkpoint": "lake/_checkpoints/windowed",
        "engine": {"state_write": state_write},
        "event_time": {
            "column": "ts",
            "delay": "10 minutes",
            "window": {"key": "win", "size": "30 minutes"},
            "final": {"path": "lake/final"},
            "expire": {"after": "60 minutes"},
            **event_time,
        },
    }
    return write_spec(tmp_path, spec)


def _edit(spec_path: Path, change) -> None:
    """The spec at `spec_path` changed by `change(spec)` (its YAML as a dict)."""
    spec = yaml.safe_load(spec_path.read_text())
    change(spec)
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))


def _land(spec_path: Path, name: str, minutes: list[int], users: int = 2) -> list[dict]:
    records = [
        {"event_id": f"{name}-{i}", "user_id": f"u{i % users}", "ts": (T0 + timedelta(minutes=m)).isoformat()} for i, m in enumerate(minutes)
    ]
    (spec_path.parent / "landing" / f"{name}.json").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


class Oracle:
    """Per (user, window start): the clicks taken; the watermark; the final
    windows (appended once each) and the windows expired from the state."""

    def __init__(self, slide: timedelta | None = None) -> None:
        self.slide = slide or SIZE
        self.watermark: datetime | None = None
        self.clicks: dict[tuple[str, datetime], int] = {}
        self.expired: set[tuple[str, datetime]] = set()

    def starts(self, moment: datetime) -> list[datetime]:
        """The windows a click falls in, aligned to the epoch as Spark's `window` is."""
        epoch = datetime(1970, 1, 1, tzinfo=UTC)
        last = epoch + ((moment - epoch) // self.slide) * self.slide
        return [s for k in range(int(SIZE / self.slide)) if (s := last - k * self.slide) + SIZE > moment]

    def batch(self, records: list[dict]) -> None:
        taken = [datetime.fromisoformat(r["ts"]) for r in records]
        taken_users = [r["user_id"] for r, m in zip(records, taken) if self.watermark is None or m >= self.watermark]
        taken = [m for m in taken if self.watermark is None or m >= self.watermark]
        for user, moment in zip(taken_users, taken):
            for start in self.starts(moment):
                self.clicks[(user, start)] = self.clicks.get((user, start), 0) + 1
        if taken:
            self.watermark = max(w for w in (self.watermark, max(taken) - DELAY) if w is not None)
        if self.watermark is not None:
            self.expired |= {k for k in self.clicks if k[1] + SIZE < self.watermark - AFTER}

    def final(self) -> dict[tuple[str, datetime], int]:
        return {k: v for k, v in self.clicks.items() if self.watermark is not None and k[1] + SIZE <= self.watermark}

    def state(self) -> dict[tuple[str, datetime], int]:
        return {k: v for k, v in self.clicks.items() if k not in self.expired}


def _run(spec_path: Path, compute, **options):
    return run_batch(load_spec(spec_path), RunOptions(run_id="test", **options), compute_factory=compute)


def _table(spec_path: Path, where: str) -> list[dict]:
    table = open_table(str(spec_path.parent / where))
    return [] if table is None else read_all(table).to_pylist()


def _rows(spec_path: Path) -> list:
    spec = load_spec(spec_path)
    return sorted(OffsetLedger(spec.ledger_path, spec.name).load().rows, key=lambda r: (r.epoch, r.batch_id))


def _final(spec_path: Path) -> dict[tuple[str, datetime], int]:
    rows = _table(spec_path, "lake/final")
    keyed = [(r["user_id"], r["win"]) for r in rows]
    assert len(keyed) == len(set(keyed)), f"a window appended twice: {sorted(keyed)}"
    return {(r["user_id"], r["win"]): r["clicks"] for r in rows}


def _state(spec_path: Path) -> dict[tuple[str, datetime], int]:
    spec = load_spec(spec_path)
    if spec.state.layout == "appended":
        from spark_jobs.core.folding import read_state

        rows = read_state(spec).read_all().to_pylist()
    else:
        rows = _table(spec_path, "lake/state")
    return {(r["user_id"], r["win"]): r["clicks"] for r in rows}


def _check(spec_path: Path, oracle: Oracle) -> None:
    assert _final(spec_path) == oracle.final()
    assert _state(spec_path) == oracle.state()


#: Batches of click minutes after T0: out of order, late clicks, windows closing and expiring.
WAVES = [
    [5, 20, 12, 40],  # watermark 30: window [0, 30) final
    [25, 33, 50, 61],  # 25 late (before 30); watermark 51: [30, 60) final... not yet (ends 60 > 51)
    [70, 55, 95],  # watermark 85: [30, 60) and [60, 90)? [60,90) ends 90 > 85: only [30, 60)
    [80, 150],  # 80 late; watermark 140: [60, 90), [90, 120) final; [0, 30) expired (30 < 140 - 60)
    [200],  # watermark 190: [120, 150) final; [30, 60), [60, 90) expired
]


def test_windows_close_once_and_expire_as_the_oracle_says(tmp_path, compute):
    spec_path = _spec(tmp_path)
    oracle = Oracle()
    for n, minutes in enumerate(WAVES):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        assert _run(spec_path, compute).status == "committed"
        _check(spec_path, oracle)
    # A run with nothing new changes nothing.
    assert _run(spec_path, compute).status == "no_new_data"
    _check(spec_path, oracle)
    late = [r["reason"] for r in _table(spec_path, "lake/_checkpoints/windowed/quarantine")]
    assert len(late) == 2 and all(r.startswith("late: ") for r in late) and len(set(late)) == 2
    # The console's reason buttons: the late records are one group, which filters them all.
    grouped = quarantined(load_spec(spec_path), reason=LATE_REASON)
    assert grouped.by_reason == {LATE_REASON: 2} and grouped.total == 2
    # Each final row names the batch that closed its window.
    assert sorted({r["_batch_id"] for r in _table(spec_path, "lake/final")}) == [1, 3, 4, 5]
    # `status` says what the table holds and how far it is.
    final = status(load_spec(spec_path)).final
    assert final is not None and (final.rows, final.through, final.batch_id) == (len(oracle.final()), oracle.watermark, 5)


def test_a_catch_up_settles_each_batch_once_and_tries_a_lost_expiry_again(tmp_path, compute, monkeypatch):
    """Back to back (`--catch-up`), step 1 does not settle again what step 5
    just settled; but an expiry that lost its race (a compaction landed
    between its snapshot and its delete, as `maintain`'s may) is tried again
    by the next settle in the same process, here the run's last step 1."""
    import deltalake

    from spark_jobs.core.catch_up import catch_up
    from spark_jobs.core.windows import EXPIRE_KEY

    spec_path = _spec(tmp_path)
    oracle = Oracle()
    for n, minutes in enumerate(WAVES):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        os.utime(spec_path.parent / "landing" / f"f{n}.json", (time.time() - 100 + n,) * 2)
    real, expiries = deltalake.DeltaTable.delete, []

    def delete(table, predicate=None, **options):
        marker = (getattr(options.get("commit_properties"), "custom_metadata", None) or {}).get(EXPIRE_KEY)
        if marker is not None:
            expiries.append(json.loads(marker)["batch_id"])
            if expiries.count(len(WAVES)) == 1 and expiries[-1] == len(WAVES):  # the last batch's first expiry
                deltalake.DeltaTable(table.table_uri).optimize.compact()
        return real(table, predicate, **options)

    monkeypatch.setattr(deltalake.DeltaTable, "delete", delete)
    outcomes = catch_up(load_spec(spec_path), RunOptions(run_id="catch-up", max_files=1), compute)
    assert [o.status for o in outcomes] == ["committed"] * len(WAVES) + ["no_new_data"]
    # Once a batch, the last twice.
    assert expiries == [1, 2, 3, 4, 5, 5]
    _check(spec_path, oracle)


def test_sliding_windows_close_each_window_once(tmp_path, compute):
    spec_path = _spec(tmp_path, slide="10 minutes")
    oracle = Oracle(slide=timedelta(minutes=10))
    for n, minutes in enumerate(WAVES[:4]):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        assert _run(spec_path, compute).status == "committed"
        _check(spec_path, oracle)
    assert len(oracle.final()) > 8  # (each click counts in three windows)


#: The kills `make test` runs (the final rows' own points); `make soak` runs every point.
FAST_POINTS = ("after_state_commit", "after_ledger_commit", *WINDOW_POINTS)


@pytest.mark.parametrize("point", [p if p in FAST_POINTS else pytest.param(p, marks=pytest.mark.slow) for p in (*POINTS, *WINDOW_POINTS)])
def test_a_kill_at_any_point_leaves_each_final_row_once(tmp_path, compute, point):
    """A batch that closes windows and expires rows, killed at `point`, then
    run again (or, after its commit, a run with nothing new): the final
    rows and the state are the oracle's."""
    spec_path = _spec(tmp_path)
    reach(point, spec_path)
    oracle = Oracle()
    for n, minutes in enumerate(WAVES[:3]):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        assert _run(spec_path, compute).status == "committed"
    oracle.batch(_land(spec_path, "f3", WAVES[3]))
    with crash_at(point):
        _run(spec_path, compute)
    assert _run(spec_path, compute).status in ("committed", "no_new_data")
    _check(spec_path, oracle)
    oracle.batch(_land(spec_path, "f4", WAVES[4]))
    assert _run(spec_path, compute).status == "committed"
    _check(spec_path, oracle)


def test_a_rewind_takes_back_final_rows_and_restores_expired_ones(tmp_path, compute):
    spec_path = _spec(tmp_path)
    oracle = Oracle()
    for n, minutes in enumerate(WAVES[:2]):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        assert _run(spec_path, compute).status == "committed"
    at_two = (oracle.final(), oracle.state())
    for n, minutes in enumerate(WAVES[2:], start=2):
        _land(spec_path, f"f{n}", minutes)
        assert _run(spec_path, compute).status == "committed"
    assert rewind(load_spec(spec_path), 2, "test").status == "rewound"
    assert (_final(spec_path), _state(spec_path)) == at_two
    # The batches after 2 run again (the same files, one batch now) and close their windows once more.
    oracle.batch(_land(spec_path, "f2", WAVES[2]) + _land(spec_path, "f3", WAVES[3]) + _land(spec_path, "f4", WAVES[4]))
    assert _run(spec_path, compute).status == "committed"
    _check(spec_path, oracle)


def test_an_appended_state_and_the_executors_close_windows_alike(tmp_path, compute):
    for layout, state_write in (("appended", "auto"), ("merged", "executors")):
        spec_path = _spec(tmp_path / layout, layout=layout, state_write=state_write)
        oracle = Oracle()
        for n, minutes in enumerate(WAVES[:4]):  # (the fourth expires a window)
            oracle.batch(_land(spec_path, f"f{n}", minutes))
            assert _run(spec_path, compute).status == "committed"
        _check(spec_path, oracle)


def test_expiry_by_a_column_without_windows(tmp_path, compute):
    """A key seen last more than `after` before the watermark leaves the state."""
    spec = {
        "name": "idle",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "event_id STRING, user_id STRING, ts TIMESTAMP"},
        "transform": "SELECT user_id, count(*) AS clicks, max(ts) AS last_seen FROM batch GROUP BY user_id",
        "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"clicks": "sum", "last_seen": "max"}},
        "checkpoint": "lake/_checkpoints/idle",
        "event_time": {"column": "ts", "delay": "10 minutes", "expire": {"column": "last_seen", "after": "60 minutes"}},
    }
    spec_path = write_spec(tmp_path, spec)
    _land(spec_path, "f0", [0, 5, 10], users=3)  # u0 at 0, u1 at 5, u2 at 10
    _land(spec_path, "f1", [50, 60], users=2)  # u0 at 50, u1 at 60
    assert _run(spec_path, compute, max_files=1).status == "committed"
    assert _run(spec_path, compute, max_files=1).status == "committed"
    _land(spec_path, "f2", [81])  # watermark 71: u2 (last seen at 10) is behind by more than 60
    assert _run(spec_path, compute).status == "committed"
    state = {r["user_id"]: r["clicks"] for r in _table(spec_path, "lake/state")}
    assert state == {"u0": 3, "u1": 2}


def test_a_transform_that_changes_a_closed_window_is_refused_before_any_write(tmp_path, compute):
    spec_path = _spec(tmp_path)
    _land(spec_path, "f0", [5, 45])
    assert _run(spec_path, compute).status == "committed"  # watermark 35: [0, 30) final
    # Windows shifted an hour back: a click at 50 lands in the closed window [-10, 20)... of another clock.
    _edit(spec_path, lambda spec: spec.update(transform=spec["transform"].replace("window(ts,", "window(ts - INTERVAL 1 HOUR,")))
    _land(spec_path, "f1", [50])
    with pytest.raises(TransformError, match="at or before the watermark"):
        _run(spec_path, compute)
    assert _table(spec_path, "lake/_checkpoints/windowed/quarantine") == []
    assert len(_final(spec_path)) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"window": None}, "field `event_time.final`: needs event_time.window"),
        ({"late": "accept"}, "field `event_time.late`: 'accept' would change a window whose final row was already appended"),
        ({"window": {"key": "user_id2", "size": "30 minutes"}}, "field `event_time.window.key`: 'user_id2' is not among state.keys"),
        ({"window": {"key": "win", "size": "0 minutes"}}, "field `event_time.window.size`: '0 minutes': a window lasts longer than 0 seconds"),
        ({"final": {"path": "lake/state/final"}}, "field `event_time.final.path`: 'lake/state/final' overlaps state.path"),
        ({"expire": {"column": "clicks", "after": "1 hour"}}, "field `event_time.expire.column`: 'clicks' with a window"),
        ({"final": {"path": "landing/final"}}, "field `event_time.final.path`: "),
        ({"final": {"path": "gs://bucket/final"}}, "field `event_time.final.path`: 'gs://bucket/final': gs:// locations are not supported"),
        ({"final": {"path": "../final"}}, "field `event_time.final.path`: '../final'"),
    ],
)
def test_a_bad_window_block_is_refused_naming_its_field(tmp_path, change, message):
    spec_path = _spec(tmp_path)
    spec = yaml.safe_load(spec_path.read_text())
    spec["event_time"].update(change)
    spec["event_time"] = {k: v for k, v in spec["event_time"].items() if v is not None}
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SpecError) as raised:
        load_spec(spec_path)
    assert message in str(raised.value)


def test_expiry_by_a_column_is_refused_where_it_would_remove_part_of_a_key(tmp_path):
    """Not with a window (a row would leave before its window is final), not by
    a merged column in an appended state (an old partial row of a key would leave)."""
    spec = yaml.safe_load(_spec(tmp_path).read_text())
    del spec["event_time"]["window"], spec["event_time"]["final"]
    spec["transform"] = "SELECT user_id, count(*) AS clicks, max(ts) AS last_seen FROM batch GROUP BY user_id"
    spec["state"] = {"path": "lake/state", "keys": ["user_id"], "merge": {"clicks": "sum", "last_seen": "max"}, "layout": "appended"}
    spec["event_time"]["expire"] = {"column": "last_seen", "after": "1 hour"}
    path = write_spec(tmp_path, spec)
    with pytest.raises(SpecError, match="field `event_time.expire.column`: 'last_seen' in an appended state"):
        load_spec(path)


def test_a_window_changed_on_a_running_pipeline_is_refused(tmp_path, compute):
    spec_path = _spec(tmp_path)
    _land(spec_path, "f0", WAVES[0])
    assert _run(spec_path, compute).status == "committed"
    spec = yaml.safe_load(spec_path.read_text())
    spec["event_time"]["window"]["size"] = "1 hour"
    spec["transform"] = spec["transform"].replace("30 minutes", "1 hour")
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    _land(spec_path, "f1", WAVES[1])
    with pytest.raises(SpecChangedError, match="event_time.window changed"):
        _run(spec_path, compute)


def test_an_event_time_in_year_9999_closes_nothing_and_stops_nothing(tmp_path, compute):
    """A "never" placeholder among the clicks: its window ends after any
    watermark a day can reach, the literals stay in range, and the next
    batches run (its clicks are late for them)."""
    spec_path = _spec(tmp_path)
    (spec_path.parent / "landing" / "f0.json").write_text(
        json.dumps({"event_id": "a", "user_id": "u0", "ts": "2026-12-01T10:05:00Z"}) + "\n"
        + json.dumps({"event_id": "b", "user_id": "u1", "ts": "9999-12-31T23:40:00Z"}) + "\n"
    )
    assert _run(spec_path, compute).status == "committed"
    assert set(_final(spec_path)) == {("u0", T0)}  # the watermark is in year 9999: every earlier window is final
    _land(spec_path, "f1", [50])
    assert _run(spec_path, compute).status == "committed"  # late, quarantined; the run does not fail
    assert _run(spec_path, compute).status == "no_new_data"


def test_a_final_table_of_another_pipeline_or_other_windows_is_refused(tmp_path, compute):
    """Two pipelines on one final.path, or a window changed in two steps (taken
    out for a batch, put back with another size): refused before a write."""
    first = _spec(tmp_path / "a")
    _land(first, "f0", WAVES[0])
    assert _run(first, compute).status == "committed"
    other = yaml.safe_load(_spec(tmp_path / "b").read_text())
    other["name"] = "other"
    other["event_time"]["final"]["path"] = str(tmp_path / "a" / "lake" / "final")
    second = write_spec(tmp_path / "b", other)
    _land(second, "f0", WAVES[0])
    with pytest.raises(SpecChangedError, match="holds the final rows of pipeline 'windowed'"):
        _run(second, compute)
    assert len(_final(first)) == 2

    spec = yaml.safe_load(first.read_text())
    window, final, expire = (spec["event_time"].pop(k) for k in ("window", "final", "expire"))
    first.write_text(yaml.safe_dump(spec, sort_keys=False))
    _land(first, "f1", WAVES[1])
    assert _run(first, compute).status == "committed"  # no window for a batch: recorded
    spec["event_time"].update(window={**window, "size": "1 hour"}, final=final, expire=expire)
    spec["transform"] = spec["transform"].replace("30 minutes", "1 hour")
    first.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SpecChangedError, match="holds windows"):
        _run(first, compute)


def test_an_event_time_before_year_1000_is_written_and_read_back(tmp_path, compute):
    """A typo's year 202: the literals and the final table's marker keep four digits."""
    spec_path = _spec(tmp_path)
    (spec_path.parent / "landing" / "f0.json").write_text(json.dumps({"event_id": "a", "user_id": "u0", "ts": "0202-12-01T10:25:00Z"}) + "\n")
    assert _run(spec_path, compute).status == "committed"
    _land(spec_path, "f1", [5, 45])
    assert _run(spec_path, compute).status == "committed"
    assert _run(spec_path, compute).status == "no_new_data"
    assert set(_final(spec_path)) == {("u0", datetime(202, 12, 1, 10, 0, tzinfo=UTC)), ("u0", T0)}
    assert status(load_spec(spec_path)).final.through == T0 + timedelta(minutes=35)


def test_a_window_key_that_is_no_time_is_refused_when_the_transform_is_analysed(tmp_path, compute):
    spec_path = _spec(tmp_path)
    _edit(spec_path, lambda spec: spec.update(transform=spec["transform"].replace(".start AS win", ".start::string AS win")))
    _land(spec_path, "f0", [5])
    with pytest.raises(TransformError, match="event_time.window.key names it"):
        _run(spec_path, compute)
    assert open_table(str(spec_path.parent / "lake/state")) is None


def test_a_quiet_schedule_closes_windows_on_time(tmp_path, compute):
    """With `advance_with_schedule`, a run that finds nothing new still
    commits a batch that reads nothing and moves the watermark to its data
    interval's end less the delay: the window closes on time, once."""
    spec_path = _spec(tmp_path, advance_with_schedule=True)

    def land(name: str, minutes: list[int], arrived: int) -> None:
        _land(spec_path, name, minutes)
        moment = (T0 + timedelta(minutes=arrived)).timestamp()
        os.utime(spec_path.parent / "landing" / f"{name}.json", (moment, moment))

    def run(minutes: int, **options):
        return _run(spec_path, compute, interval_end=T0 + timedelta(minutes=minutes), **options)

    land("f0", [5, 20], arrived=25)

    assert run(30).status == "committed"  # watermark 20: [0, 30) is open
    assert _final(spec_path) == {}
    with crash_at("after_plan"):
        run(60)  # a quiet batch, planned, then killed
    quiet = run(60)  # its replay: watermark 50, with no engine started
    assert quiet.status == "committed" and "engine_start" not in (quiet.steps_ms or {}), quiet.steps_ms
    assert _final(spec_path) == {("u0", T0): 1, ("u1", T0): 1}
    assert run(60).status == "no_new_data"  # nothing left to move
    rows = [r for r in _rows(spec_path) if r.status.value == "committed"]
    assert [(r.records_in, r.watermark) for r in rows] == [(2, T0 + timedelta(minutes=20)), (0, T0 + timedelta(minutes=50))]
    # A click that arrives after the quiet period is judged against the watermark it left.
    land("f1", [25, 70], arrived=80)
    assert run(100).status == "committed"  # watermark 90: [60, 90) is final
    assert _final(spec_path) == {("u0", T0): 1, ("u1", T0): 1, ("u1", T0 + 2 * SIZE): 1}
    assert [r["reason"][:5] for r in _table(spec_path, "lake/_checkpoints/windowed/quarantine")] == ["late:"]


def test_a_downstream_reads_the_final_rows_once_and_a_rewind_s_deletes(tmp_path, compute):
    """Chained: a downstream pipeline (`type: delta`, `read: changes`) over
    the final table sums each user's closed hours; an upstream rewind's
    deletes take them back, and the replay's appends count once."""
    spec_path = _spec(tmp_path)
    downstream = {
        "name": "closed_per_user",
        "source": {"type": "delta", "path": "lake/final", "read": "changes"},
        "transform": (
            "SELECT user_id, sum(CASE WHEN _change_type = 'delete' THEN -clicks ELSE clicks END) AS clicks "
            "FROM batch WHERE _change_type IN ('insert', 'delete') GROUP BY user_id"
        ),
        "state": {"path": "lake/closed", "keys": ["user_id"], "merge": {"clicks": "sum"}},
        "checkpoint": "lake/_checkpoints/closed",
    }
    (tmp_path / "lake").mkdir(parents=True, exist_ok=True)
    down_path = tmp_path / "closed.yaml"
    down_path.write_text(yaml.safe_dump(downstream, sort_keys=False))

    def closed() -> dict[str, int]:
        assert _run(down_path, compute).status in ("committed", "no_new_data")
        return {r["user_id"]: r["clicks"] for r in _table(down_path, "lake/closed") if r["clicks"]}

    def expected(oracle: Oracle) -> dict[str, int]:
        totals: dict[str, int] = {}
        for (user, _), clicks in oracle.final().items():
            totals[user] = totals.get(user, 0) + clicks
        return totals

    oracle = Oracle()
    for n, minutes in enumerate(WAVES[:3]):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        assert _run(spec_path, compute).status == "committed"
    at_two = Oracle()
    for n in range(2):
        at_two.batch([json.loads(line) for line in (tmp_path / "landing" / f"f{n}.json").read_text().splitlines()])
    assert closed() == expected(oracle)
    assert rewind(load_spec(spec_path), 2, "test").status == "rewound"
    assert closed() == expected(at_two)
    again = [json.loads(line) for line in (tmp_path / "landing" / "f2.json").read_text().splitlines()]
    at_two.batch(again + _land(spec_path, "f3", WAVES[3]))  # one batch now: files 2 and 3, again and new
    assert _run(spec_path, compute).status == "committed"
    assert closed() == expected(at_two)


def test_maintain_compacts_the_final_table_and_keeps_what_a_downstream_has_yet_to_read(tmp_path, compute):
    """`maintain` on a windowed upstream: its final table's small files are
    compacted; the change data of a rewind's delete the downstream has read
    is pruned, while the versions it has not read stay readable; and the
    batches after it still append each window once (the compaction carries
    the table's marker of how far it was brought)."""
    from deltalake import DeltaTable

    from spark_jobs.core.maintain import maintain

    spec_path = _spec(tmp_path)
    down_path = tmp_path / "closed.yaml"
    down_path.write_text(yaml.safe_dump({
        "name": "closed_per_user",
        "source": {"type": "delta", "path": "lake/final", "read": "changes"},
        "transform": "SELECT user_id, count(*) AS changes FROM batch GROUP BY user_id",
        "state": {"path": "lake/closed", "keys": ["user_id"], "merge": {"changes": "sum"}},
        "checkpoint": "lake/_checkpoints/closed",
    }, sort_keys=False))
    oracle, landed = Oracle(), []
    for n, minutes in enumerate(WAVES[:3]):
        landed.append(_land(spec_path, f"f{n}", minutes))
        oracle.batch(landed[-1])
        assert _run(spec_path, compute).status == "committed"
    assert rewind(load_spec(spec_path), 1, "test").status == "rewound"  # deletes final rows: change data
    assert _run(down_path, compute).status == "committed"  # the downstream reads everything so far
    oracle = Oracle()
    oracle.batch(landed[0])
    oracle.batch(landed[1] + landed[2] + _land(spec_path, "f3", WAVES[3]))
    assert _run(spec_path, compute).status == "committed"  # appends the downstream has not read
    final = DeltaTable(str(tmp_path / "lake" / "final"))
    files_before, rows_before = len(final.file_uris()), _final(spec_path)
    assert files_before > 1 and list((tmp_path / "lake" / "final" / "_change_data").iterdir())

    report = maintain(load_spec(spec_path))
    # A second maintain a while later: the files the versions kept for the
    # downstream name are not taken for untracked ones (a try-to-break found them deleted).
    _edit(spec_path, lambda spec: spec.update(maintenance={"untracked_files_hours": 0.0001}))
    time.sleep(1)
    maintain(load_spec(spec_path))
    final = DeltaTable(str(tmp_path / "lake" / "final"))
    assert len(final.file_uris()) == 1 and _final(spec_path) == rows_before == oracle.final()
    assert report.removed_files["final change data"] >= 1, report.removed_files
    assert list(report.final_readers) == ["closed_per_user"] and report.to_dict()["final_readers"] == report.final_readers
    assert not list((tmp_path / "lake" / "final" / "_change_data").iterdir())
    # The downstream reads the versions it had not read, and counts each change once.
    changes_before = {r["user_id"]: r["changes"] for r in _table(down_path, "lake/closed")}
    assert _run(down_path, compute).status == "committed"
    changes = {r["user_id"]: r["changes"] for r in _table(down_path, "lake/closed")}
    appended = oracle.final().keys() - _final_after(landed[0]).keys()
    assert appended and {u: changes[u] - changes_before.get(u, 0) for u in changes} == {u: sum(user == u for user, _ in appended) for u in changes}
    # The next batch closes windows once, after the compaction's commit.
    oracle.batch(_land(spec_path, "f4", WAVES[4]))
    assert _run(spec_path, compute).status == "committed"
    _check(spec_path, oracle)


def test_maintain_on_a_quiet_pipeline_and_a_batch_during_maintain_leave_each_final_row_once(tmp_path, compute, monkeypatch):
    """The marker of how far the final table was brought stays within
    `_marker`'s reach however often `maintain` runs between two batches that
    close windows (its search shortened here to 4 entries, from 100: a
    try-to-break pass duplicated every window after 52 maintains); and a
    batch committing while `maintain` works on the final table is not
    hidden behind an older marker (it was, by the compaction's commit)."""
    from spark_jobs.core import maintain as maintenance
    from spark_jobs.core import windows

    monkeypatch.setattr(windows, "FINAL_SEARCH", 4)
    spec_path = _spec(tmp_path)
    oracle = Oracle()
    for n, minutes in enumerate(WAVES[:3]):
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        assert _run(spec_path, compute).status == "committed"
    for _ in range(4):  # a quiet stretch
        maintenance.maintain(load_spec(spec_path))
    oracle.batch(_land(spec_path, "f3", WAVES[3]))
    assert _run(spec_path, compute).status == "committed"
    _check(spec_path, oracle)

    real, ran = maintenance.remove_untracked, []

    def a_batch_meanwhile(table, *args):
        if table.table_uri.rstrip("/").endswith("lake/final") and not ran:
            ran.append(True)
            oracle.batch(_land(spec_path, "f4", WAVES[4]))
            assert _run(spec_path, compute).status == "committed"
        return real(table, *args)

    monkeypatch.setattr(maintenance, "remove_untracked", a_batch_meanwhile)
    maintenance.maintain(load_spec(spec_path))
    assert ran
    oracle.batch(_land(spec_path, "f5", [260]))
    assert _run(spec_path, compute).status == "committed"
    _check(spec_path, oracle)


def _final_after(records: list[dict]) -> dict[tuple[str, datetime], int]:
    """The final windows after one batch of `records` alone."""
    oracle = Oracle()
    oracle.batch(records)
    return oracle.final()


def test_the_cli_on_spark_connect_closes_windows_as_the_oracle_says(tmp_path, on_connect):
    """Every engine: the batches run by `microbatch run` as thin clients of a
    Spark Connect server; final rows and expiry are the job process's own."""
    spec_path = _spec(tmp_path)
    oracle = Oracle()
    for n, minutes in enumerate(WAVES[:4]):  # (the fourth expires a window)
        oracle.batch(_land(spec_path, f"f{n}", minutes))
        done = run_cli("run", str(spec_path))
        assert done.returncode == 0, done.stderr[-2000:]
    _check(spec_path, oracle)
    shown = run_cli("status", str(spec_path))
    assert f"final rows: {len(oracle.final())} in " in shown.stdout, shown.stdout
