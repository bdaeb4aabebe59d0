"""The appended state layout against real Delta tables (no Spark needed):
its query and its fold give what the MERGEs give, batch after batch."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.core.fencing import STATE_FENCE, Position, commit_properties, transaction_position
from spark_jobs.core.folding import FOLD_KEY, fold, fold_if_due, read_state, row_counts
from spark_jobs.core.spec import PipelineSpec, load_spec
from spark_jobs.core.state import StateTable
from spark_jobs.errors import MergeOverflowError
from tests.conftest import commit_updates, oracle_spec_dict, write_spec

RULES = {"s": "sum", "lo": "min", "hi": "max", "f": "first", "l": "last", "when": "max", "tag": "last"}


def _spec(folder: Path, layout: str, merge: dict[str, str] = RULES, keys: list[str] | None = None, **state) -> PipelineSpec:
    spec = oracle_spec_dict()
    spec["state"] = {"path": "lake/state", "keys": keys or ["k", "region"], "merge": merge, "layout": layout, **state}
    return load_spec(write_spec(folder, spec))


def _batches(count: int, seed: int) -> list[pa.Table]:
    """Batches of distinct keys (some coming back, some new), nulls in every value column."""
    rng = random.Random(seed)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    out = []
    for _ in range(count):
        keys = rng.sample([(f"u{i}", r) for i in range(40) for r in ("eu", "us")], 30)

        def maybe(value):
            return None if rng.random() < 0.2 else value

        out.append(
            pa.table(
                {
                    "k": [k for k, _ in keys],
                    "region": [r for _, r in keys],
                    "s": pa.array([maybe(rng.randint(-50, 50)) for _ in keys], pa.int32()),
                    "lo": pa.array([maybe(rng.uniform(-1, 1)) for _ in keys], pa.float64()),
                    "hi": pa.array([maybe(rng.randint(0, 10**6)) for _ in keys], pa.int64()),
                    "f": [maybe(rng.choice("abcdef")) for _ in keys],
                    "l": [maybe(rng.choice("abcdef")) for _ in keys],
                    "when": pa.array([maybe(start + timedelta(seconds=rng.randint(0, 10**6))) for _ in keys], pa.timestamp("us", tz="UTC")),
                    "tag": pa.array([maybe(rng.random() < 0.5) for _ in keys], pa.bool_()),
                }
            )
        )
    return out


def _commit_all(spec: PipelineSpec, batches: list[pa.Table], start: int = 1) -> StateTable:
    state = StateTable(spec)
    for i, batch in enumerate(batches, start=start):
        table = state.open() or state.create(batch)
        commit_updates(state, table, batch, Position(0, i))
    return state


def _by_key(rows: pa.Table | pa.RecordBatchReader) -> dict[tuple, dict]:
    table = rows.read_all() if isinstance(rows, pa.RecordBatchReader) else rows
    return {(r["k"], r["region"]): r for r in table.to_pylist()}


def test_the_query_and_the_fold_give_what_the_merges_give(tmp_path):
    """Every rule, nulls on either side, keys coming back: the merged state,
    the appended state read by its query, and the appended state folded hold
    the same values in the same types; the fold keeps the fence."""
    batches = _batches(12, seed=35)
    merged = _commit_all(_spec(tmp_path / "m", "merged"), batches)
    appended_spec = _spec(tmp_path / "a", "appended")
    appended = _commit_all(appended_spec, batches)
    expected = read_all(merged.open())
    table = appended.open()
    assert table.version() == len(batches)  # one commit a batch, after the create
    assert row_counts(table).rows == sum(b.num_rows for b in batches)
    read = read_state(appended_spec, table).read_all()
    assert read.schema == expected.schema
    assert _by_key(read) == _by_key(expected)

    folded = fold(appended_spec, table)
    assert folded is not None and folded.rows_after == expected.num_rows
    after = read_all(open_table(appended_spec.state_path))
    assert after.schema == expected.schema
    assert _by_key(after) == _by_key(expected)
    assert transaction_position(open_table(appended_spec.state_path), STATE_FENCE) == Position(0, len(batches))
    assert appended.outside_changes(open_table(appended_spec.state_path), len(batches)) == []
    info = open_table(appended_spec.state_path).history(1)[0]
    assert json.loads(info[FOLD_KEY])["position"] == Position(0, len(batches)).encode()

    # Batches after a fold land on the folded rows as on any others.
    more = _batches(4, seed=36)
    _commit_all(_spec(tmp_path / "m", "merged"), more, start=len(batches) + 1)
    _commit_all(appended_spec, more, start=len(batches) + 1)
    assert _by_key(read_state(appended_spec)) == _by_key(read_all(merged.open()))


def test_a_fold_from_a_stale_snapshot_loses_to_the_batch_and_nothing_is_lost(tmp_path):
    spec = _spec(tmp_path, "appended")
    batches = _batches(3, seed=1)
    state = _commit_all(spec, batches[:2])
    stale = state.open()
    commit_updates(state, state.open(), batches[2], Position(0, 3))
    assert fold(spec, stale) is None
    table = open_table(spec.state_path)
    assert table.version() == 3 and row_counts(table).rows == sum(b.num_rows for b in batches)
    merged = _commit_all(_spec(tmp_path / "m", "merged"), batches)
    assert _by_key(read_state(spec)) == _by_key(read_all(merged.open()))


def test_a_batch_racing_a_fold_fails_retryably_and_the_fold_keeps_every_value(tmp_path):
    """The fold carries the state fence: a batch committing from the snapshot
    before it conflicts (and is run again), it is not appended twice or lost."""
    from spark_jobs.core.delta_io import is_commit_conflict

    spec = _spec(tmp_path, "appended")
    batches = _batches(3, seed=2)
    state = _commit_all(spec, batches[:2])
    before_fold = state.open()
    assert fold(spec, state.open()) is not None
    with pytest.raises(Exception) as info:
        commit_updates(state, before_fold, batches[2], Position(0, 3))
    assert is_commit_conflict(info.value)
    assert transaction_position(open_table(spec.state_path), STATE_FENCE) == Position(0, 2)


def test_a_fold_is_due_once_the_appended_rows_pass_fold_at(tmp_path):
    spec = _spec(tmp_path, "appended", fold_at=0.0005)  # of the floor's 100,000 rows: 50
    batches = _batches(2, seed=3)  # 30 rows each
    state = _commit_all(spec, batches[:1])
    assert not row_counts(state.open()).fold_due(spec.state.fold_at)
    assert fold_if_due(spec, state.open()) is None
    commit_updates(state, state.open(), batches[1], Position(0, 2))
    counts = row_counts(state.open())
    assert counts.appended == 60 and counts.fold_due(spec.state.fold_at)
    folded = fold_if_due(spec, state.open())
    assert folded is not None
    after = row_counts(open_table(spec.state_path))
    assert after.folded == folded.rows_after == after.rows and after.appended == 0


def test_an_appended_sum_is_refused_when_its_rows_together_would_overflow(tmp_path):
    """No row is near the limit; their sum for one key is."""
    spec = _spec(tmp_path, "appended", merge={"n": "sum"}, keys=["k"])
    state = StateTable(spec)
    limit = 2**31 - 1
    first = pa.table({"k": ["a", "b"], "n": pa.array([limit // 2, 1], pa.int32())})
    commit_updates(state, state.create(first), first, Position(0, 1))
    commit_updates(state, state.open(), pa.table({"k": ["a"], "n": pa.array([limit // 2], pa.int32())}), Position(0, 2))
    with pytest.raises(MergeOverflowError, match=r"key \{'k': 'a'\}: the state holds 2147483646 and the batch adds 5"):
        commit_updates(state, state.open(), pa.table({"k": ["b", "a"], "n": pa.array([5, 5], pa.int32())}), Position(0, 3))
    # A batch that stays within the column commits.
    commit_updates(state, state.open(), pa.table({"k": ["a"], "n": pa.array([1], pa.int32())}), Position(0, 3))
    assert _by_key_k(read_state(spec)) == {"a": limit, "b": 1}


def test_after_a_fold_its_rows_count_once_so_the_bound_proves_a_big_state_safe(tmp_path, monkeypatch):
    """A key's value is at most one fold row plus its appended rows: a state
    whose folded totals are near the limit still commits small batches
    without folding the whole state to check them."""
    from spark_jobs.core import widen

    spec = _spec(tmp_path, "appended", merge={"n": "sum"}, keys=["k"])
    state = StateTable(spec)
    big = pa.table({"k": ["a", "b"], "n": pa.array([2_000_000_000, 5], pa.int32())})
    commit_updates(state, state.create(big), big, Position(0, 1))
    for i in range(2, 6):
        commit_updates(state, state.open(), pa.table({"k": ["b"], "n": pa.array([1], pa.int32())}), Position(0, i))
    assert fold(spec, state.open()) is not None

    def no_exact_check(*args, **kwargs):
        raise AssertionError("the statistics should have proved this batch safe")

    monkeypatch.setattr(widen, "exact_overflow", no_exact_check)
    for i in range(6, 9):
        commit_updates(state, state.open(), pa.table({"k": ["a", "b"], "n": pa.array([1, 1], pa.int32())}), Position(0, i))
    assert _by_key_k(read_state(spec)) == {"a": 2_000_000_003, "b": 12}
    # Near the limit, the exact check decides, and refuses.
    monkeypatch.undo()
    with pytest.raises(MergeOverflowError, match="for key {'k': 'a'}"):
        commit_updates(state, state.open(), pa.table({"k": ["a"], "n": pa.array([200_000_000], pa.int32())}), Position(0, 9))


def _by_key_k(rows: pa.RecordBatchReader) -> dict[str, int]:
    return {r["k"]: r["n"] for r in rows.read_all().to_pylist()}


def test_appended_with_a_change_feed_is_refused_naming_the_field(tmp_path):
    from spark_jobs.errors import SpecError

    spec = oracle_spec_dict()
    spec["state"] = {**spec["state"], "layout": "appended", "change_feed": True}
    with pytest.raises(SpecError, match="layout: appended cannot write a change data feed"):
        load_spec(write_spec(tmp_path, spec))


def test_fenced_empty_appended_batch_moves_the_fence(tmp_path):
    """A batch whose records were all quarantined appends no row, yet moves the fence."""
    spec = _spec(tmp_path, "appended", merge={"n": "sum"}, keys=["k"])
    state = StateTable(spec)
    first = pa.table({"k": ["a"], "n": [1]})
    commit_updates(state, state.create(first), first, Position(0, 1))
    version, keys = commit_updates(state, state.open(), first.slice(0, 0), Position(0, 2))
    assert keys == 0
    assert transaction_position(open_table(spec.state_path), STATE_FENCE) == Position(0, 2)
    write_deltalake(spec.state_path, pa.table({"k": ["x"], "n": [1], "_batch_id": [9]}), mode="append",
                    commit_properties=commit_properties("someone.else", Position(0, 1), {}))
    assert state.outside_changes(open_table(spec.state_path), version) == [(version + 1, "WRITE")]


# -- through the protocol, the CLI and the checks around it ----------------------------


def _appended_pipeline(folder: Path, **state) -> Path:
    spec = oracle_spec_dict(state={**oracle_spec_dict()["state"], "layout": "appended", **state}, batch={"max_files": 1})
    return write_spec(folder, spec)


def _run(spec: PipelineSpec, compute, run_id: str) -> str:
    from spark_jobs.core.protocol import RunOptions, run_batch

    return run_batch(spec, RunOptions(run_id=run_id), compute_factory=compute).status


def test_query_prints_the_folded_state_and_the_sql_for_each_engine(tmp_path, compute):
    from spark_jobs.demo.clickstream import write_wave
    from tests.conftest import assert_exact, run_cli

    spec_path = _appended_pipeline(tmp_path)
    spec = load_spec(spec_path)
    write_wave(tmp_path / "landing", 0, files=3, records_per_file=60, users=5)
    for i in range(3):
        assert _run(spec, compute, f"r{i}") == "committed"
    assert row_counts(open_table(spec.state_path)).rows > 5  # partial rows: users came back
    assert_exact(spec_path)
    shown = run_cli("query", str(spec_path), "--json", "--limit", "100")
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)
    assert sorted(r["user_id"] for r in rows) == sorted({r["user_id"] for r in read_state(spec).read_all().to_pylist()})
    assert len(rows) == 5
    spark_text = run_cli("query", str(spec_path), "--sql", "spark").stdout
    # A DOUBLE sum (`amount`) is merged in batch order: window functions per key.
    assert f"FROM delta.`{spec.state_path}`" in spark_text and "PARTITION BY `user_id` ORDER BY `_batch_id`" in spark_text
    assert 'PARTITION BY "user_id" ORDER BY "_batch_id"' in run_cli("query", str(spec_path), "--sql", "delta-rs").stdout
    assert json.loads(run_cli("query", str(spec_path), "--json", "--limit", "2").stdout).__len__() == 2


def test_maintain_folds_and_a_rewind_restores_through_the_fold(tmp_path, compute):
    """`maintain` folds; VACUUM then removes the partial rows' files, and a
    rewind to the batch before the fold restores the fold's version (same
    values), the state staying exact."""
    from spark_jobs.core.maintain import maintain
    from spark_jobs.core.rewind import rewind
    from spark_jobs.demo.clickstream import write_wave
    from tests.conftest import assert_exact

    spec_path = _appended_pipeline(tmp_path)
    spec = load_spec(spec_path)
    write_wave(tmp_path / "landing", 0, files=4, records_per_file=60, users=8)
    for i in range(3):
        assert _run(spec, compute, f"r{i}") == "committed"
    maintain(spec, keep_batches=1)
    table = open_table(spec.state_path)
    assert any(info.get(FOLD_KEY) for info in table.history(5))
    counts = row_counts(table)
    assert counts.appended == 0 and counts.rows == 8
    assert _run(spec, compute, "r3") == "committed"
    maintain(spec, keep_batches=1)
    # Batch 3's own files went with this VACUUM; the fold after it holds its values.
    assert rewind(spec, 3, "rw").status == "rewound"
    assert_exact(spec_path, drained=False)
    assert _run(spec, compute, "r4") == "committed"
    assert_exact(spec_path)


def test_a_state_may_become_appended_but_not_merged_again(tmp_path, compute):
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.demo.clickstream import write_wave
    from spark_jobs.errors import SpecChangedError
    from tests.conftest import assert_exact

    merged = oracle_spec_dict(batch={"max_files": 1})
    spec_path = write_spec(tmp_path, merged)
    write_wave(tmp_path / "landing", 0, files=3, records_per_file=50, users=6)
    assert _run(load_spec(spec_path), compute, "r1") == "committed"
    appended = _appended_pipeline(tmp_path)
    assert _run(load_spec(appended), compute, "r2") == "committed"
    assert_exact(appended, drained=False)
    write_spec(tmp_path, merged)
    with pytest.raises(SpecChangedError, match="state.layout changed from appended to merged"):
        run_batch(load_spec(spec_path), RunOptions(run_id="r3"), compute_factory=compute)
    assert _run(load_spec(_appended_pipeline(tmp_path)), compute, "r3") == "committed"
    assert_exact(spec_path)


def test_an_appended_state_is_refused_as_a_delta_source_naming_the_way_out(tmp_path, compute):
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.demo.clickstream import write_wave
    from spark_jobs.errors import SourceRefusedError

    upstream = load_spec(_appended_pipeline(tmp_path))
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=50, users=6)
    assert _run(upstream, compute, "r1") == "committed"
    downstream = {
        "name": "follow",
        "source": {"type": "delta", "path": "lake/state", "read": "appends"},
        "transform": "SELECT user_id, sum(events) AS events FROM batch GROUP BY user_id",
        "state": {"path": "lake/follow", "keys": ["user_id"], "merge": {"events": "sum"}},
        "checkpoint": "lake/_checkpoints/follow",
    }
    spec = load_spec(write_spec(tmp_path, downstream, "follow.yaml"))
    with pytest.raises(SourceRefusedError, match="state.layout: appended"):
        run_batch(spec, RunOptions(run_id="f1"), compute_factory=compute)
    assert open_table(spec.state_path) is None
    # Refused before it registered: the upstream's maintenance keeps no version for it.
    from spark_jobs.storage.consumers import consumers

    assert consumers(upstream.state_path) == []


def test_each_batch_carries_the_folded_rows_so_counting_reads_only_the_newest_commit(tmp_path):
    spec = _spec(tmp_path, "appended")
    batches = _batches(4, seed=4)
    state = _commit_all(spec, batches[:2])
    folded = fold(spec, state.open())
    commit_updates(state, state.open(), batches[2], Position(0, 3))
    commit_updates(state, state.open(), batches[3], Position(0, 4))
    table = open_table(spec.state_path)
    assert json.loads(table.history(1)[0]["microbatch.last_fold"]) == {"rows": folded.rows_after, "version": folded.version}
    assert row_counts(table).appended == batches[2].num_rows + batches[3].num_rows


def test_maintain_and_query_refuse_a_spec_whose_merge_rules_changed_and_fold_nothing(tmp_path, compute):
    """A fold under edited merge rules would bake them into every key's value."""
    from spark_jobs.core.maintain import maintain
    from spark_jobs.demo.clickstream import write_wave
    from spark_jobs.errors import SpecChangedError
    from tests.conftest import run_cli

    spec_path = _appended_pipeline(tmp_path)
    write_wave(tmp_path / "landing", 0, files=2, records_per_file=60, users=6)
    for i in range(2):
        assert _run(load_spec(spec_path), compute, f"r{i}") == "committed"
    before = open_table(load_spec(spec_path).state_path).version()
    edited = oracle_spec_dict(state={**oracle_spec_dict()["state"], "layout": "appended"}, batch={"max_files": 1})
    edited["state"]["merge"] = {**edited["state"]["merge"], "events": "max"}
    write_spec(tmp_path, edited)
    with pytest.raises(SpecChangedError, match="merge rule of 'events' changed from sum to max"):
        maintain(load_spec(spec_path))
    assert open_table(load_spec(spec_path).state_path).version() == before
    refused = run_cli("query", str(spec_path))
    assert refused.returncode == 2 and "merge rule of 'events' changed" in refused.stderr


# -- every type a transform can return (issue 46, items 4 and 6) ---------------------

#: Each type a Spark transform can return that a Delta table holds, as an
#: expression of `m` (a key's `max(n)` in the batch, NULL when every n is).
TYPED = {
    "bool": "m % 2 = 0",
    "tiny": "CAST(m AS TINYINT)",
    "small": "CAST(m AS SMALLINT)",
    "int": "CAST(m AS INT)",
    "big": "m",
    "flt": "CAST(m AS FLOAT) + 0.5",
    "dbl": "CAST(m AS DOUBLE) / 3",
    "dec": "CAST(m / 4 AS DECIMAL(10,2))",
    "str": "CAST(m AS STRING)",
    "bin": "CAST(CAST(m AS STRING) AS BINARY)",
    "date": "date_add(DATE'2026-01-01', CAST(m AS INT))",
    "ts": "timestamp_seconds(m)",
    "ntz": "CAST(timestamp_seconds(m) AS TIMESTAMP_NTZ)",
    "arr": "IF(m IS NULL, NULL, array(m, m + 1))",
    "map": "IF(m IS NULL, NULL, map(CAST(m AS STRING), m))",
    "struct": "IF(m IS NULL, NULL, named_struct('n', m, 's', CAST(m AS STRING)))",
    "nested": "IF(m IS NULL, NULL, array(named_struct('m', map('k', array(m)))))",
}
ORDERABLE = ("bool", "tiny", "small", "int", "big", "flt", "dbl", "dec", "str", "bin", "date", "ts", "ntz", "arr", "struct")
#: FLOAT sums are refused in an appended state (`check_result_types`): not compared here.
SUMMABLE = ("tiny", "small", "int", "big", "dbl", "dec")
#: Three batches, one file each: key a has a null in batch 2, b skips batch 3,
#: d's last value is null, c comes in batch 3 only.
TYPED_BATCHES = (
    [("a", 1), ("b", 5), ("d", 7)],
    [("a", None), ("b", 2), ("d", 8)],
    [("a", 3), ("c", 4), ("d", None)],
)


def _typed_spec(folder: Path, layout: str, **state) -> Path:
    columns = {}
    for name, expr in TYPED.items():
        columns[f"last_{name}"], columns[f"first_{name}"] = (expr, "last"), (expr, "first")
    for name in ORDERABLE:
        columns[f"min_{name}"], columns[f"max_{name}"] = (TYPED[name], "min"), (TYPED[name], "max")
    for name in SUMMABLE:
        columns[f"sum_{name}"] = (TYPED[name], "sum")
    select = ",\n  ".join(f"{expr} AS {column}" for column, (expr, _) in columns.items())
    return write_spec(folder, {
        "name": "typed",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, n BIGINT"},
        "transform": f"SELECT k,\n  {select}\nFROM (SELECT k, max(n) AS m FROM batch GROUP BY k)",
        "state": {"path": "lake/state", "keys": ["k"], "merge": {c: rule for c, (_, rule) in columns.items()}, "layout": layout, **state},
        "checkpoint": "lake/_checkpoints/typed",
        "batch": {"max_files": 1},
    })


def _land_typed(folder: Path) -> None:
    import os
    import time

    landing = folder / "landing"
    for i, rows in enumerate(TYPED_BATCHES):
        path = landing / f"batch{i}.json"
        path.write_text("".join(json.dumps({"k": k, "n": n}) + "\n" for k, n in rows))
        stamp = time.time() - 100 + i  # planned in this order
        os.utime(path, (stamp, stamp))


def test_an_appended_state_merges_every_type_a_transform_returns_as_the_merged_layout_does(tmp_path, compute, spark):
    """Issue 46, item 4: a MAP merged with `last` in an appended state
    committed, then every fold failed ("Min/Max accumulator not implemented
    for type Map") and `query` and `maintain` exited 1 for good. Now every
    type a transform can return and a Delta table holds is merged by every
    rule that applies to it, and an appended state (never folded, or folded
    after every batch) reads exactly as the merged layout, also through
    Spark's SQL; `query` and `maintain` exit 0."""
    from spark_jobs.core.folding import spark_sql
    from spark_jobs.core.protocol import RunOptions, run_batch
    from tests.conftest import run_cli

    results = {}
    for layout, state in (("merged", {}), ("appended", {"fold_at": 10.0}), ("appended_folded", {"fold_at": 0.000001})):
        folder = tmp_path / layout
        spec_path = _typed_spec(folder, layout.split("_")[0], **state)
        _land_typed(folder)
        spec = load_spec(spec_path)
        for _ in TYPED_BATCHES:
            assert run_batch(spec, RunOptions(run_id="test"), compute_factory=compute).status == "committed"
        results[layout] = {r["k"]: r for r in read_state(spec).read_all().to_pylist()}
        if layout == "appended":
            assert row_counts(open_table(spec.state_path)).appended > 4, "partial rows, never folded"
            table = open_table(spec.state_path)
            by_spark = {r["k"]: r for r in spark.sql(spark_sql(spec, pa.schema(table.schema().to_arrow()))).toArrow().to_pylist()}
            shown = run_cli("query", str(spec_path), "--json")
            assert shown.returncode == 0, shown.stderr[-2000:]
            assert run_cli("maintain", str(spec_path), "--master", "local[1]").returncode == 0  # as `run` takes it
            assert row_counts(open_table(spec.state_path)).appended == 0
            results["after maintain"] = {r["k"]: r for r in read_state(spec).read_all().to_pylist()}
    merged = results.pop("merged")
    assert merged["a"]["last_map"] == [("3", 3)] and merged["d"]["last_map"] is None and merged["a"]["first_arr"] == [1, 2]
    assert merged["b"]["sum_dbl"] == 5 / 3 + 2 / 3
    for name, got in [*results.items(), ("Spark's SQL", by_spark)]:
        assert got == merged, f"{name} differs from the merged layout: " + str(
            {k: {c: (v, merged[k][c]) for c, v in row.items() if v != merged[k][c]} for k, row in got.items()})


@pytest.mark.parametrize(
    ("column", "expr", "rule", "layout", "says"),
    [
        ("m", "map('k', max(n))", "max", "merged", "column 'm' is MAP<STRING, BIGINT>, which `max` cannot order"),
        ("a", "array(named_struct('m', map('k', max(n))))", "min", "appended", "which `min` cannot order"),
        ("t", "current_time()", "last", "merged", "column 't' is TIME, which a Delta table cannot hold: cast the time of day"),
        ("f", "CAST(sum(n) AS FLOAT)", "sum", "appended", "column 'f' is FLOAT summed in an appended state"),
        ("d", "make_dt_interval(0, 0, 0, sum(n))", "last", "merged", "column 'd' is INTERVAL DAY TO SECOND, which a Delta table cannot hold"),
        ("y", "make_ym_interval(1, 0)", "last", "appended", "column 'y' is INTERVAL YEAR TO MONTH, which a Delta table cannot hold"),
        ("v", "parse_json('{}')", "last", "merged", "column 'v' is VARIANT"),
        ("z", "NULL", "first", "appended", "column 'z' has no type"),
        ("s", "array(max(n))", "sum", "merged", "column 's' is ARRAY<BIGINT>, which `sum` cannot add"),
    ],
)
def test_a_type_no_rule_can_merge_is_refused_by_name_before_any_write(tmp_path, compute, column, expr, rule, layout, says):
    """Issue 46, items 4 and 6: each refused when the transform is analysed,
    before the plan is recorded (nothing written: no ledger, no state)."""
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.errors import TransformError

    spec_path = write_spec(tmp_path, {
        "name": "refused",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, n BIGINT"},
        "transform": f"SELECT k, {expr} AS {column} FROM batch GROUP BY k",
        "state": {"path": "lake/state", "keys": ["k"], "merge": {column: rule}, "layout": layout},
        "checkpoint": "lake/_checkpoints/refused",
    })
    (tmp_path / "landing" / "one.json").write_text('{"k": "a", "n": 1}\n')
    with pytest.raises(TransformError, match=re_escape(says)):
        run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute)
    assert not (tmp_path / "lake").exists(), "nothing was written"


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_float_sum_is_refused_when_a_merged_state_becomes_appended_and_a_double_sum_is_fold_independent(tmp_path, compute, on_connect):
    """Issue 46, item 6, through the CLI: FLOAT partials 16777216, 1 and 1
    summed to 16777218 in an appended state without a fold and to 16777216
    with a `maintain` after batch 2 (the merged layout: 16777216). A FLOAT
    sum is now refused in an appended state by name, also when a merged
    state is switched to appended (exit 2, nothing written); a DOUBLE sum is
    added in batch order, so 2**53, 1, 1 give 2**53 with or without folds,
    as the merged layout does. (The refusal runs through the CLI, the DOUBLE
    sums in this process, sharing the suite's Spark session.)"""
    from spark_jobs.core.maintain import maintain
    from tests.conftest import run_cli

    def pipeline(folder: Path, column_type: str, layout: str) -> Path:
        return write_spec(folder, {
            "name": "sums",
            "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, n DOUBLE"},
            "transform": f"SELECT k, CAST(sum(n) AS {column_type}) AS total FROM batch GROUP BY k",
            "state": {"path": "lake/state", "keys": ["k"], "merge": {"total": "sum"}, "layout": layout},
            "checkpoint": "lake/_checkpoints/sums",
        })

    def land(folder: Path, i: int, n: float) -> None:
        (folder / "landing" / f"b{i}.json").write_text(json.dumps({"k": "a", "n": n}) + "\n")

    def total(spec_path: Path) -> float:
        shown = run_cli("query", str(spec_path), "--json")
        assert shown.returncode == 0, shown.stderr[-2000:]
        return json.loads(shown.stdout)[0]["total"]

    floats = pipeline(tmp_path / "float", "FLOAT", "merged")
    land(tmp_path / "float", 0, 16777216.0)
    assert run_cli("run", str(floats)).returncode == 0
    floats = pipeline(tmp_path / "float", "FLOAT", "appended")
    land(tmp_path / "float", 1, 1.0)
    refused = run_cli("run", str(floats))
    assert refused.returncode == 2 and "column 'total' is FLOAT summed in an appended state" in refused.stderr, refused.stderr[-2000:]
    assert total(floats) == 16777216.0

    got = {}
    for case in ("merged", "appended", "appended, maintained after batch 2"):
        folder = tmp_path / case.replace(" ", "_").replace(",", "")
        spec_path = pipeline(folder, "DOUBLE", case.split(",")[0])
        spec = load_spec(spec_path)
        for i, n in enumerate((2.0**53, 1.0, 1.0)):
            land(folder, i, n)
            assert _run(spec, compute, f"r{i}") == "committed"
            if i == 1 and "maintained" in case:
                maintain(spec)
        (got[case],) = {row["total"] for batch in read_state(spec) for row in batch.to_pylist()}
    assert got == {case: 2.0**53 for case in got}
