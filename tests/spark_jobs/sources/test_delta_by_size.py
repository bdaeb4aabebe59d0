"""`source.reader: auto` on `local[*]`: each batch of a Delta source read by
the driver or by Spark's executors by its size (issue 64).

Real Delta tables in `tmp_path`, a real chain run in process on the
suite's Spark session (which has delta-spark). The size bound is lowered
for the test (a batch of a few kilobytes stands for one of gigabytes).
"""

from __future__ import annotations

import pytest
from deltalake import DeltaTable

from spark_jobs.core.delta_io import version_actions
from spark_jobs.core.ledger import OffsetLedger
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.sources import delta as delta_source
from spark_jobs.sources import make_source
from spark_jobs.errors import SourceRefusedError
from spark_jobs.sources.delta import DeltaManifest
from tests.conftest import BatchesLineage, assert_chain_exact, chain_specs, crash_at


def _run(spec_path, compute) -> str:
    return run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute_factory=compute).status


def _readers(spec_path) -> list[str | None]:
    spec = load_spec(spec_path)
    return [r.manifest.get("reader") for r in OffsetLedger(spec.ledger_path, spec.name).load().lineage()]


@pytest.mark.parametrize(("bound", "reader"), [(1, "spark"), (2**40, "driver")])
def test_a_big_range_is_read_by_spark_a_small_one_by_the_driver_and_a_replay_reads_as_planned(tmp_path, compute, monkeypatch, spark, bound, reader):
    """Each batch records who reads it; the chain is exact either way; a
    batch planned for one reader and replayed after a crash reads the same
    way, even when the bound changed meanwhile."""
    upstream, downstream = chain_specs(tmp_path, reader="auto")
    monkeypatch.setattr(delta_source, "READ_ON_EXECUTORS_FROM", bound)
    landing = tmp_path / "landing"
    for wave in (0, 1):
        write_wave(landing, wave, files=1, records_per_file=200, users=40)
        assert _run(upstream, compute) == "committed"
    assert _run(downstream, compute) == "committed"
    write_wave(landing, 2, files=1, records_per_file=200, users=40)
    assert _run(upstream, compute) == "committed"
    with crash_at("after_plan"):
        _run(downstream, compute)
    monkeypatch.setattr(delta_source, "READ_ON_EXECUTORS_FROM", 2**40 if bound == 1 else 1)
    while _run(downstream, compute) == "committed":
        pass
    assert_chain_exact(upstream, downstream)
    assert _readers(downstream) == [reader, reader]


def test_planning_weighs_the_versions_and_a_column_mapped_table_stays_with_the_driver(tmp_path, compute, spark, monkeypatch):
    """The manifest's size is the bytes of the files its versions' change feed reads;
    auto keeps a column-mapped upstream on the driver's reader, whose
    refusal names `reader: spark`."""
    upstream, downstream = chain_specs(tmp_path, reader="auto")
    write_wave(tmp_path / "landing", 0, files=1, records_per_file=100, users=20)
    assert _run(upstream, compute) == "committed"
    monkeypatch.setattr(delta_source, "READ_ON_EXECUTORS_FROM", 1)
    batch = make_source(load_spec(downstream)).plan(BatchesLineage())
    assert isinstance(batch.manifest, DeltaManifest) and batch.manifest.reader == "spark"
    state = DeltaTable(load_spec(upstream).state_path)
    entries = [version_actions(state.table_uri, v) for v in range(state.version() + 1)]
    # The first batch's entry has change files (delta-rs writes its inserts' too): those are what its feed reads.
    read = [a["cdc"]["size"] for entry in entries for a in entry if "cdc" in a]
    assert batch.manifest.size == sum(read) > 0
    assert batch.manifest.input_bytes() == batch.manifest.size
    spark.sql(f"ALTER TABLE delta.`{state.table_uri}` SET TBLPROPERTIES ('delta.columnMapping.mode' = 'name', "
              "'delta.minReaderVersion' = '2', 'delta.minWriterVersion' = '5')")
    with pytest.raises(SourceRefusedError, match="reader: spark"):
        make_source(load_spec(downstream)).plan(BatchesLineage())


def test_a_reader_the_spec_names_reads_a_batch_planned_for_the_other():
    """A planned batch records `auto`'s choice; a spec that names a reader
    afterwards is followed (both read the same rows: a user who set
    `reader: driver` after the planned read failed means it)."""
    planned = DeltaManifest("lake/state", "changes", 0, 3, (), "spark", 40 * 2**20)
    assert planned.reader_for("auto") == "spark"
    assert planned.reader_for("driver") == "driver"
    assert DeltaManifest("lake/state", "changes", 0, 3).reader_for("auto") == "driver"


def test_a_version_weighs_the_files_its_read_reads():
    """`read_bytes_of`, on log entries as writers make them: a MERGE's change
    files and not its rewrite of the state's files; without change files,
    the files added and removed (a RESTORE's removal is read as deletes);
    appends, the files added alone; a compaction, nothing; a size not given,
    not light."""
    merge = [{"commitInfo": {}}, {"add": {"size": 9_000_000, "dataChange": True}}, {"remove": {"size": 8_000_000, "dataChange": True}},
             {"cdc": {"size": 300, "dataChange": False}}, {"cdc": {"size": 200, "dataChange": False}}]
    restore = [{"add": {"size": 10, "dataChange": True}}, {"remove": {"size": 7_000_000, "dataChange": True}}]
    optimize = [{"add": {"size": 5_000, "dataChange": False}}, {"remove": {"size": 4_000, "dataChange": False}}]
    assert [delta_source.read_bytes_of(e, "changes") for e in (merge, restore, optimize)] == [500, 7_000_010, 0]
    assert [delta_source.read_bytes_of(e, "appends") for e in (merge, restore, optimize)] == [9_000_000, 10, 0]
    unsized = [{"remove": {"dataChange": True}}]
    # (A file of unknown size alone goes to Spark: the bound is exceeded, not met. A review found it met.)
    assert delta_source.read_bytes_of(unsized, "changes") == delta_source.read_bytes_of(None, "changes") > delta_source.READ_ON_EXECUTORS_FROM
