"""A Delta table as a source (issue 12): versions as offsets, the change feed
or appends, data intervals, data loss, and a chained pair of pipelines.

The planning tests are JVM-free (real Delta tables written by delta-rs in
`tmp_path`); the chain runs the real protocol with Spark."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from spark_jobs.core.delta_io import read_all
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import DataLossError, SourceChangedError, SourceRefusedError, exit_code
from spark_jobs.sources.base import Caps
from spark_jobs.sources.delta import DeltaSource
from tests.conftest import BatchesLineage, assert_chain_exact, chain_specs, crash_at

SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64())])


def _table(path: Path, *, change_feed: bool = True) -> str:
    DeltaTable.create(str(path), SCHEMA, configuration={"delta.enableChangeDataFeed": "true"} if change_feed else None)
    return str(path)


def _append(uri: str, rows: dict[str, int]) -> None:
    write_deltalake(uri, pa.table({"k": list(rows), "v": list(rows.values())}, schema=SCHEMA), mode="append")


def _source(uri: str, read: str = "changes", on_data_loss: str = "fail", max_versions: int | None = None) -> DeltaSource:
    return DeltaSource(uri, read=read, on_data_loss=on_data_loss, max_versions=max_versions)


def _span(batch) -> tuple[int, int]:
    return batch.manifest.first, batch.manifest.last


def test_versions_are_offsets_capped_and_planned_once(tmp_path):
    uri = _table(tmp_path / "up")
    for i in range(4):
        _append(uri, {f"k{i}": i})
    source = _source(uri, max_versions=3)
    first = source.plan(BatchesLineage())
    table_id = DeltaTable(uri).metadata().id
    assert _span(first) == (0, 2) and first.start.to_dict() == {"version": -1}
    assert first.end.to_dict() == {"version": 2, "table": table_id}, "the offset names the table it counts in"
    second = source.plan(BatchesLineage(first))
    assert _span(second) == (3, 4)
    assert source.plan(BatchesLineage(first, second)) is None
    assert source.lag(BatchesLineage(first)).count == 2 and source.lag(BatchesLineage(first)).unit == "versions"


def test_a_data_interval_bounds_the_batch_by_commit_time(tmp_path):
    uri = _table(tmp_path / "up")
    _append(uri, {"a": 1})
    time.sleep(0.05)
    cut = datetime.now(timezone.utc)
    time.sleep(0.05)
    _append(uri, {"b": 2})
    source = _source(uri)
    bounded = source.plan(BatchesLineage(), until=cut)
    assert _span(bounded) == (0, 1), "versions committed before the interval's end only"
    assert source.plan(BatchesLineage(bounded), until=cut) is None
    assert _span(source.plan(BatchesLineage(bounded))) == (2, 2)


def test_a_table_without_its_change_feed_is_refused_with_the_property_to_set(tmp_path):
    uri = _table(tmp_path / "up", change_feed=False)
    _append(uri, {"a": 1})
    with pytest.raises(SourceRefusedError, match="delta.enableChangeDataFeed") as caught:
        _source(uri).plan(BatchesLineage())
    assert exit_code(caught.value) == 2
    assert _span(_source(uri, read="appends").plan(BatchesLineage())) == (0, 1), "appends need no feed"


def test_appends_refuse_a_version_that_is_not_an_append_naming_it(tmp_path):
    uri = _table(tmp_path / "up", change_feed=False)
    _append(uri, {"a": 1})
    DeltaTable(uri).delete("k = 'a'")
    with pytest.raises(SourceRefusedError, match=r"version 2 \(DELETE\) removed or rewrote rows"):
        _source(uri, read="appends").plan(BatchesLineage(), caps=Caps())


def test_a_recreated_table_is_refused(tmp_path):
    uri = _table(tmp_path / "up")
    for i in range(3):
        _append(uri, {f"k{i}": i})
    consumed = _source(uri).plan(BatchesLineage())
    for f in Path(uri, "_delta_log").iterdir():
        f.unlink()
    _table(Path(uri))
    with pytest.raises(SourceChangedError, match="recreated"):
        _source(uri).plan(BatchesLineage(consumed))


def test_vacuumed_versions_fail_by_default_and_are_recorded_when_skipped(tmp_path):
    uri = _table(tmp_path / "up")
    _append(uri, {"a": 1})
    DeltaTable(uri).delete("k = 'a'")  # version 2 removes the file version 1 added
    _append(uri, {"b": 2})
    DeltaTable(uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    # Version 0 (the create) reads; version 1's file is gone: the first batch ends before it.
    batch = _source(uri).plan(BatchesLineage())
    assert _span(batch) == (0, 0)
    with pytest.raises(DataLossError, match=r"versions 1\.\.1,") as caught:
        _source(uri).plan(BatchesLineage(batch))
    assert exit_code(caught.value) == 2
    after = _source(uri, on_data_loss="skip").plan(BatchesLineage(batch))
    # Version 2's deletion is still in its change files; version 3 appended
    # (then the VACUUM's own two commits, which change no rows).
    latest = DeltaTable(uri).version()
    assert _span(after) == (2, latest) and after.manifest.skipped == ((1, 1),)
    assert after.start.version == 0 and after.end.version == latest
    assert after.manifest.to_dict()["skipped"] == [[1, 1]], "the ledger records what was skipped"


def test_a_planned_range_vacuumed_before_its_replay_is_refused(tmp_path):
    uri = _table(tmp_path / "up")
    _append(uri, {"a": 1})
    planned = _source(uri).plan(BatchesLineage())
    DeltaTable(uri).delete("k = 'a'")
    DeltaTable(uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with pytest.raises(SourceChangedError, match="rewind"):
        _source(uri).verify(planned)


# -- chained pipelines, with Spark ---------------------------------------------------

def test_a_chained_pipeline_follows_its_upstream_state_exactly_through_crashes(tmp_path, compute):
    upstream, downstream = chain_specs(tmp_path)

    def run(spec_path: Path) -> str:
        return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status

    landing = tmp_path / "landing"
    write_wave(landing, 0, files=2, records_per_file=50, users=30)
    assert run(upstream) == "committed"
    assert run(downstream) == "committed"
    # Updates of existing users arrive as pre/post images downstream.
    write_wave(landing, 1, files=2, records_per_file=50, users=30)
    assert run(upstream) == "committed"
    with crash_at("after_state_commit"):
        run(downstream)
    write_wave(landing, 2, files=1, records_per_file=50, users=30)
    with crash_at("after_plan"):
        run(upstream)
    assert run(upstream) == "committed"
    while run(downstream) == "committed":
        pass
    assert_chain_exact(upstream, downstream)
    spec = load_spec(downstream)
    from spark_jobs.core.ledger import OffsetLedger

    lineage = OffsetLedger(spec.ledger_path, spec.name).load().lineage()
    assert [r.batch_id for r in lineage] == list(range(1, len(lineage) + 1))
    for previous, row in zip(lineage, lineage[1:]):
        assert row.start_offsets == previous.end_offsets
    assert lineage[-1].end_offsets["version"] == DeltaTable(load_spec(upstream).state_path).version()


def test_appends_read_exactly_the_rows_each_range_added(tmp_path):
    from spark_jobs.engine.delta_read import read_versions

    uri = str(tmp_path / "up")
    write_deltalake(uri, pa.table({"k": ["a"], "v": [1]}, schema=SCHEMA))  # created by a plain write
    _append(uri, {"b": 2})
    DeltaTable(uri).optimize.compact()  # rewrites files, changes no data: passed over
    _append(uri, {"c": 3})
    source = _source(uri, read="appends", max_versions=2)
    first = source.plan(BatchesLineage())
    second = source.plan(BatchesLineage(first))
    assert _span(first) == (0, 1) and _span(second) == (2, 3)
    assert sorted(read_versions(first.manifest).column("k").to_pylist()) == ["a", "b"]
    assert read_versions(second.manifest).column("k").to_pylist() == ["c"]
    write_deltalake(uri, pa.table({"k": ["z"], "v": [9]}, schema=SCHEMA), mode="overwrite")
    with pytest.raises(SourceRefusedError, match=r"version 4 \(WRITE\) removed or rewrote rows"):
        source.plan(BatchesLineage(first, second))


def test_versions_written_before_the_change_feed_was_on_are_refused(tmp_path):
    uri = _table(tmp_path / "up", change_feed=False)
    _append(uri, {"a": 1})
    DeltaTable(uri).alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
    _append(uri, {"b": 2})
    with pytest.raises(SourceRefusedError, match="version 0 was written without a change data feed"):
        _source(uri).plan(BatchesLineage())


def test_a_table_recreated_past_the_consumed_version_is_refused(tmp_path):
    uri = _table(tmp_path / "up")
    _append(uri, {"a": 1})
    consumed = _source(uri).plan(BatchesLineage())
    for f in Path(uri, "_delta_log").iterdir():
        f.unlink()
    _table(Path(uri))
    for i in range(4):
        _append(uri, {f"n{i}": i})
    with pytest.raises(SourceChangedError, match="recreated"):
        _source(uri).plan(BatchesLineage(consumed))


# -- chains under upstream rewinds and maintenance (issue 31, section 2) -------------------


def test_an_upstream_rewind_and_maintain_reach_the_downstream_as_their_exact_reversal(tmp_path, compute):
    """Reproduced: `down` consumed batch 2 of `up`; `up` was rewound to batch 1
    and maintained. `maintain up` vacuumed the files that the RESTORE's
    changes are read from, and `down` stopped ("can no longer give
    versions"); with `skip` it never subtracted batch 2 and counted it twice
    when `up` replayed it. Now `down`'s position is recorded in `up`, which
    keeps those files, and the RESTORE reads as exactly what it undid."""
    from spark_jobs.core.maintain import maintain
    from spark_jobs.core.rewind import rewind
    from spark_jobs.storage.consumers import consumers

    upstream, downstream = chain_specs(tmp_path)

    def run(spec_path: Path) -> str:
        return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status

    landing = tmp_path / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=1, records_per_file=60, users=20)
        assert run(upstream) == "committed"
    while run(downstream) == "committed":
        pass
    assert_chain_exact(upstream, downstream)
    state = load_spec(upstream).state_path
    [registered] = consumers(state)
    assert (registered.pipeline, registered.version) == ("buckets", DeltaTable(state).version())

    rewind(load_spec(upstream), 1, run_id="test-rewind")
    report = maintain(load_spec(upstream), keep_batches=1)
    assert report.readers == {"buckets": registered.version}
    assert run(downstream) == "committed"  # the rewind's RESTORE, read and subtracted
    got = {r["bucket"]: r["events"] for r in read_all(DeltaTable(load_spec(downstream).state_path)).to_pylist()}
    assert sum(got.values()) == 60, "batch 2's events were taken back, batch 1's kept"
    # `up` replays batch 2's file in its new epoch; `down` adds it once.
    assert run(upstream) == "committed"
    while run(downstream) == "committed":
        pass
    assert_chain_exact(upstream, downstream)
    # Once `down` has read everything, `maintain up` lets the old versions go.
    [registered] = consumers(state)
    assert registered.version == DeltaTable(state).version()
    report = maintain(load_spec(upstream), keep_batches=1)
    assert report.readers == {"buckets": registered.version}
    assert report.removed_files["state"] > 0


def test_the_change_data_every_reader_consumed_is_pruned(tmp_path, compute):
    """`_change_data` files are left alone by VACUUM: a change-feed state
    grew without bound on disk. `maintain` deletes those of versions every
    downstream has read and no kept version needs."""
    from spark_jobs.core.maintain import maintain

    upstream, downstream = chain_specs(tmp_path)

    def run(spec_path: Path) -> str:
        return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status

    landing = tmp_path / "landing"
    for wave in range(4):
        write_wave(landing, wave, files=1, records_per_file=40, users=10)  # every batch updates users: change data
        assert run(upstream) == "committed"
    change_data = Path(load_spec(upstream).state_path) / "_change_data"
    before = len(list(change_data.iterdir()))
    assert before >= 3
    report = maintain(load_spec(upstream), keep_batches=1)
    assert report.removed_files["change data"] == 0, "no downstream recorded yet: one may still need all of it"
    assert run(downstream) == "committed"  # versions 0..1 (max_versions: 2), and recorded there
    report = maintain(load_spec(upstream), keep_batches=1)
    assert report.readers == {"buckets": 1}
    after_first = len(list(change_data.iterdir()))
    while run(downstream) == "committed":  # the rest still reads
        pass
    assert_chain_exact(upstream, downstream)
    report = maintain(load_spec(upstream), keep_batches=1)
    assert report.removed_files["change data"] > 0
    assert len(list(change_data.iterdir())) < after_first
    # What is left still reads: a fifth batch flows down exactly.
    write_wave(landing, 4, files=1, records_per_file=40, users=10)
    assert run(upstream) == "committed"
    while run(downstream) == "committed":
        pass
    assert_chain_exact(upstream, downstream)


def test_a_restore_reads_as_the_changes_it_made_and_nothing_else(tmp_path):
    """Within a version, a row removed and added again unchanged is no change:
    a RESTORE (or a rewrite that kept every value) nets to what it changed."""
    from spark_jobs.engine.delta_read import read_versions
    from spark_jobs.sources.delta import DeltaManifest

    uri = _table(tmp_path / "t")
    _append(uri, {"a": 1, "b": 2})  # v1
    DeltaTable(uri).merge(
        pa.table({"k": ["a", "c"], "v": [10, 30]}, schema=SCHEMA), "t.k = s.k", source_alias="s", target_alias="t"
    ).when_matched_update_all().when_not_matched_insert_all().execute()  # v2
    DeltaTable(uri).restore(1)  # v3: back to a=1, b=2
    rows = read_versions(DeltaManifest(uri, "changes", 3, 3))
    got = sorted(zip(rows.column("k").to_pylist(), rows.column("v").to_pylist(), rows.column("_change_type").to_pylist()))
    assert got == [("a", 1, "insert"), ("a", 10, "delete"), ("c", 30, "delete")]  # b untouched
    rows = read_versions(DeltaManifest(uri, "changes", 2, 2))
    assert sorted(rows.column("_change_type").to_pylist()) == ["insert", "update_postimage", "update_preimage"]


def netting_rows(versions: tuple[int, ...] = (3,) * 8) -> pa.Table:
    """A feed whose rows test netting: nulls, NaN, texts that would run
    together, the same change twice (`versions`: each row's version)."""
    return pa.table({
        "k": ["a", "a", "b", "b", "c", "c", "x|1:y", "x"],
        "v": [None, None, float("nan"), float("nan"), 1.0, 1.0, 2.0, 2.0],
        "_change_type": ["delete", "insert", "update_preimage", "update_postimage", "delete", "delete", "delete", "insert"],
        "_commit_version": list(versions),
        "_commit_timestamp": pa.array([0] * 8, pa.timestamp("us", tz="UTC")),
    })


def test_netting_pairs_equal_rows_only_nulls_included_and_passes_nested_tables():
    """Within a version: a removal and an addition of the same row cancel,
    nulls and NaN included; texts that would run together do not; rows of
    other versions, or another change type twice, stay; a table with a
    nested column is passed as it is."""
    from spark_jobs.engine.delta_read import net_changes

    rows = netting_rows()
    stamp = rows.column("_commit_timestamp")
    netted = net_changes(rows)
    assert list(zip(netted["k"].to_pylist(), netted["_change_type"].to_pylist())) == [
        ("c", "delete"), ("c", "delete"), ("x|1:y", "delete"), ("x", "insert"),
    ]
    across = rows.set_column(3, "_commit_version", pa.array([3, 4, 3, 4, 3, 3, 3, 3]))
    assert net_changes(across).num_rows == 8, "another version's row is not the same change"
    nested = pa.table({"k": ["a", "a"], "l": [[1], [1]], "_change_type": ["delete", "insert"], "_commit_version": [1, 1],
                       "_commit_timestamp": stamp.slice(0, 2)})
    assert net_changes(nested).num_rows == 2


def test_a_downstream_rewind_moves_its_recorded_position_back_before_restoring(tmp_path, compute):
    """The replay after a downstream rewind needs the upstream versions after
    the target batch: the position recorded in the upstream moves back before
    the state is restored, so the upstream's `maintain` keeps them."""
    from spark_jobs.core.maintain import maintain
    from spark_jobs.core.rewind import rewind
    from spark_jobs.storage.consumers import consumers

    upstream, downstream = chain_specs(tmp_path)

    def run(spec_path: Path) -> str:
        return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status

    for wave in range(3):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=40, users=10)
        assert run(upstream) == "committed"
    while run(downstream) == "committed":
        pass
    spec = load_spec(downstream)
    from spark_jobs.core.ledger import OffsetLedger

    first = OffsetLedger(spec.ledger_path, spec.name).load().lineage()[0]
    rewind(spec, 1, run_id="test-rewind")
    [recorded] = consumers(load_spec(upstream).state_path)
    assert recorded.version == first.end_offsets["version"]
    maintain(load_spec(upstream), keep_batches=1)
    while run(downstream) == "committed":
        pass
    assert_chain_exact(upstream, downstream)


def test_a_downstream_rewind_the_upstream_can_no_longer_replay_is_refused_by_name(tmp_path, compute):
    """Issue 46, item 3, through the CLI: after `maintain up --keep-batches
    1`, `rewind down --to-batch 1` (and `--to-batch 0`, which a spec-change
    error recommends) exited 0, and every later downstream run exited 2 with
    "can no longer give versions 2..2". The rewind now asks the source
    first, refuses by name with the ways out, and changes nothing: the
    downstream runs on. (The batches run in this process, sharing the
    suite's Spark session; maintain, status and the rewinds through the CLI.)"""
    import json

    from tests.conftest import run_cli

    def run(spec_path: Path, run_id: str) -> str:
        return run_batch(load_spec(spec_path), RunOptions(run_id=run_id), compute_factory=compute).status

    upstream, downstream = chain_specs(tmp_path)
    for wave in range(3):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=40, users=10)
        for spec in (upstream, downstream):
            assert run(spec, f"w{wave}") == "committed"
    before = json.loads(run_cli("status", str(downstream), "--json").stdout)
    assert run_cli("maintain", str(upstream), "--keep-batches", "1").returncode == 0
    for target in ("1", "0"):
        refused = run_cli("rewind", str(downstream), "--to-batch", target)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert f"cannot rewind to batch {target}" in refused.stderr and "can no longer give versions" in refused.stderr
        assert "on_data_loss: skip" in refused.stderr and "Nothing was changed" in refused.stderr
    after = json.loads(run_cli("status", str(downstream), "--json").stdout)
    assert (after["epoch"], after["last_batch"]) == (before["epoch"], before["last_batch"])
    write_wave(tmp_path / "landing", 3, files=1, records_per_file=40, users=10)
    assert run(upstream, "w3") == "committed"
    for i in range(4):  # `batch.max_versions: 2`: drain
        if run(downstream, f"drain{i}") == "no_new_data":
            break
    assert_chain_exact(upstream, downstream)
