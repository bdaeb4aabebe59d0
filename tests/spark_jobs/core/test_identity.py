"""Pipeline identity and spec changes over a pipeline's life (issue 11, sections 1 and 2).

JVM-free: the pure-Arrow compute runs the real protocol on real Delta tables.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from deltalake import write_deltalake

from spark_jobs.cli import main
from spark_jobs.core import faults
from spark_jobs.core.delta_io import ensure_table, open_table, read_all
from spark_jobs.core.identity import SPEC_RULES, SpecIdentity, changes
from spark_jobs.core.inspect import history, status
from spark_jobs.core.ledger import SCHEMA, OffsetLedger, RowStatus
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import EXIT_TERMINAL, RewindError, SpecChangedError, StateLedgerMismatchError
from tests.conftest import assert_exact, oracle_spec_dict, write_spec
from tests.spark_jobs.arrow_compute import ArrowCompute


def _run(spec_file: Path) -> str:
    return run_batch(load_spec(spec_file), RunOptions(run_id="test"), ArrowCompute).status


def _edit(spec_file: Path, change) -> None:
    data = yaml.safe_load(spec_file.read_text())
    change(data)
    spec_file.write_text(yaml.safe_dump(data, sort_keys=False))


def _ledger_rows(spec_file: Path) -> list:
    spec = load_spec(spec_file)
    return OffsetLedger(spec.ledger_path, spec.name).load().rows


# -- 1. spec changes ----------------------------------------------------------------------


def test_a_changed_merge_rule_is_refused_before_any_write(spec_path, capsys):
    """Reproduced: `sum` became `max` and the new rule was applied to old totals."""
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=40, users=5)
    assert _run(spec_path) == "committed"
    _edit(spec_path, lambda d: d["state"]["merge"].update(amount="max"))
    write_wave(landing, 1, files=1, records_per_file=40, users=5)
    before = len(_ledger_rows(spec_path))
    state_version = open_table(load_spec(spec_path).state_path).version()
    with pytest.raises(SpecChangedError, match="merge rule of 'amount' changed from sum to max") as info:
        _run(spec_path)
    message = str(info.value)
    assert "revert the spec" in message and "--to-batch 0" in message and "new state path and a new checkpoint" in message
    assert len(_ledger_rows(spec_path)) == before, "nothing is written"
    assert open_table(load_spec(spec_path).state_path).version() == state_version
    assert main(["-q", "run", str(spec_path)]) == EXIT_TERMINAL
    assert "merge rule of 'amount'" in capsys.readouterr().err
    # status shows the pending change; reverting the spec lets the pipeline go on, exact.
    assert "merge rule of 'amount' changed" in (status(load_spec(spec_path)).note or "")
    _edit(spec_path, lambda d: d["state"]["merge"].update(amount="sum"))
    assert _run(spec_path) == "committed"
    assert_exact(spec_path)


def test_changed_keys_are_refused_and_every_change_is_named(spec_path):
    """Reproduced: keys [user_id, day] became [user_id]; old rows stopped matching."""
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=20, users=3)
    assert _run(spec_path) == "committed"

    def change(d):
        d["state"]["keys"] = ["user_id", "last_seen"]
        d["state"]["merge"].pop("last_seen")
        d["source"]["schema"] = "event_id STRING, user_id STRING, amount FLOAT, ts TIMESTAMP"

    _edit(spec_path, change)
    with pytest.raises(SpecChangedError) as info:
        _run(spec_path)
    message = str(info.value)
    assert "state.keys changed from ['user_id'] to ['user_id', 'last_seen']" in message
    assert "merge column 'last_seen' (max) was removed or renamed" in message
    assert "source column 'amount' changed type from DOUBLE to FLOAT" in message


def test_rewind_to_0_recomputes_under_the_new_spec(spec_path):
    landing = spec_path.parent / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=1, records_per_file=30, users=4)
        assert _run(spec_path) == "committed"
    _edit(spec_path, lambda d: d["state"]["merge"].update(amount="max"))
    with pytest.raises(SpecChangedError):
        _run(spec_path)
    spec = load_spec(spec_path)
    with pytest.raises(RewindError, match="computed under another spec"):
        rewind(spec, 1, run_id="test-rewind")
    rewind(spec, 0, run_id="test-rewind")
    assert _run(spec_path) == "committed"
    # One replay batch read every file: the max of one batch's sums is the sum.
    assert [r.batch_id for r in assert_exact(spec_path)] == [1]
    fingerprints = {(r.epoch, r.status): r.spec_fingerprint for r in history(spec)}
    assert fingerprints[(0, RowStatus.COMMITTED)] != fingerprints[(1, RowStatus.COMMITTED)]


def test_a_new_transform_text_is_compatible_and_recorded(spec_path):
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    _edit(spec_path, lambda d: d.update(transform=d["transform"].replace("FROM batch", "FROM   batch")))
    write_wave(landing, 1, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    committed = sorted((r for r in _ledger_rows(spec_path) if r.status is RowStatus.COMMITTED), key=lambda r: r.batch_id)
    assert len({r.spec_fingerprint for r in committed}) == 2
    assert committed[1].spec["fields"]["transform"].count("FROM   batch") == 1
    assert_exact(spec_path)


def _identity(**fields) -> SpecIdentity:
    base = {"source.type": "files", "source.files.path": "/in", "source.files.format": "json",
            "source.files.schema": [["k", "STRING", True], ["n", "INT", True]], "source.files.after_commit": "keep",
            "state.path": "/state", "state.keys": ["k"], "state.merge": {"n": "sum"}, "transform": "SELECT 1"}
    return SpecIdentity({**base, **fields})


def test_compatibility_rules():
    base = _identity()
    assert changes(base, base) == ([], [])
    widened = _identity(**{"source.files.schema": [["k", "STRING", True], ["n", "BIGINT", True], ["x", "DATE", True]]})
    assert changes(base, widened) == ([], ["source column 'n' changed type from INT to BIGINT", "new source column 'x'"])
    narrowed = _identity(**{"source.files.schema": [["k", "STRING", True], ["n", "SMALLINT", True]]})
    assert changes(base, narrowed)[0] == ["source column 'n' changed type from INT to SMALLINT"]
    assert changes(base, _identity(**{"state.merge": {"n": "sum", "m": "max"}})) == ([], ["new merge column 'm' (max): old rows hold null"])
    assert changes(base, _identity(**{"state.path": "/other"}))[0] == ["state.path changed from '/state' to '/other'"]
    assert changes(base, _identity(**{"source.files.format": "csv"}))[0] == ["source.files.format changed from 'json' to 'csv'"]
    assert base.fingerprint != _identity(transform="SELECT 2").fingerprint
    # A new source type is one change: its fields are not listed one by one.
    kafka = SpecIdentity({**{k: v for k, v in base.values.items() if not k.startswith("source.")},
                          "source.type": "kafka", "source.kafka.topic": "t", "source.kafka.format": "json"})
    assert changes(base, kafka)[0] == ["source.type changed from 'files' to 'kafka'"]


def test_csv_read_by_position_may_not_move_its_columns():
    """CSV without a header is parsed by position (files and Kafka): a moved
    column would put keys and values in each other's places."""
    two = [["user_id", "STRING", True], ["page", "STRING", True]]
    for kind, extra in (("files", {"source.files.csv.header": False}), ("kafka", {"source.kafka.csv.header": False})):
        csv = SpecIdentity({"source.type": kind, f"source.{kind}.format": "csv", f"source.{kind}.schema": two, **extra})

        def with_schema(schema, fields=csv.values):
            return SpecIdentity({**fields, f"source.{kind}.schema": schema})

        refused, _ = changes(csv, with_schema(two[::-1]))
        assert refused == ["source columns moved from ['user_id', 'page'] to ['page', 'user_id']: CSV without a "
                           "header is read by position, so each old column must keep its place (new columns go at the end)"]
        # A column added at the end keeps every old column in its place.
        assert changes(csv, with_schema([*two, ["ref", "STRING", True]])) == ([], ["new source column 'ref'"])
        assert changes(csv, with_schema([["ref", "STRING", True], *two]))[0]
    # With a header, each file names its columns and a file in another order is
    # quarantined, not misread; JSON and Parquet read by name.
    headed = SpecIdentity({"source.type": "files", "source.files.format": "csv", "source.files.csv.header": True, "source.files.schema": two})
    assert changes(headed, SpecIdentity({**headed.values, "source.files.schema": two[::-1]})) == ([], [])
    as_json = SpecIdentity({"source.type": "files", "source.files.format": "json", "source.files.schema": two})
    assert changes(as_json, SpecIdentity({**as_json.values, "source.files.schema": two[::-1]})) == ([], [])


def test_every_spec_field_has_a_rule():
    """A field added to the spec model without a rule in `SPEC_RULES` fails
    here: decide whether changing it is refused, recorded or free."""
    from pydantic import BaseModel

    from spark_jobs.core.spec import DeltaSourceSpec, FilesSourceSpec, KafkaSourceSpec, PipelineSpec

    def paths(model: type[BaseModel], prefix: str) -> set[str]:
        found: set[str] = set()
        for name, field in model.model_fields.items():
            if field.exclude:
                continue  # not a spec field: where the spec was loaded from
            path = f"{prefix}{field.alias or name}"
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= paths(kind, path + ".")
            elif path != "source":
                found.add(path)
        return found

    fields = paths(PipelineSpec, "")
    for source in (FilesSourceSpec, DeltaSourceSpec, KafkaSourceSpec):
        kind = source.model_fields["type"].annotation.__args__[0]
        fields |= {p.replace("source.", f"source.{kind}.", 1) for p in paths(source, "source.") if p != "source.type"}
    fields.add("source.type")
    # A part of a field may have a rule of its own (`event_time.window` in `event_time`).
    parts = {p for p in SPEC_RULES if any(p.startswith(f + ".") for f in fields)}
    assert fields == set(SPEC_RULES) - parts, f"without a rule: {sorted(fields - set(SPEC_RULES))}; rules for no field: {sorted(set(SPEC_RULES) - parts - fields)}"
    documented = (Path(__file__).parents[3] / "docs" / "spec.md").read_text()
    for path, rule in SPEC_RULES.items():
        assert f"| `{path}` | {rule.rule.value} |" in documented, f"docs/spec.md's rule table lacks `{path}` ({rule.rule.value})"


def test_an_identity_of_format_1_reads_as_the_fields_it_held(spec_path):
    """Ledgers written before the rules table hold format 1; what it did not
    record counts as unchanged, and the next row records the whole identity."""
    spec = load_spec(spec_path)
    old = {"keys": ["user_id"], "merge": dict(spec.state.merge), "state": spec.state_path, "transform": spec.transform.strip(),
           "source": {"type": "files", "location": spec.source_path, "format": "json",
                      "schema": [[f.name, f.type, f.nullable] for f in spec.source.fields]}}
    now = SpecIdentity.of(spec)
    assert changes(SpecIdentity.from_dict(old), now) == ([], [])
    moved = {**old, "source": {**old["source"], "location": "/elsewhere"}}
    assert changes(SpecIdentity.from_dict(moved), now)[0] == [f"source.files.path changed from '/elsewhere' to {spec.source_path!r}"]
    kafka = {**old, "source": {"type": "kafka", "location": "kafka://clicks", "format": "json", "schema": []}}
    assert SpecIdentity.from_dict(kafka).values["source.kafka.topic"] == "clicks"


def test_switching_after_commit_between_keep_and_delete_is_refused(spec_path, capsys):
    """Reproduced: `delete` committed landing/events.json and deleted it; the
    spec then said `keep`, a new events.json landed, and the run said "no new
    data": under `keep` a consumed name is never read again."""
    landing = spec_path.parent / "landing"
    _edit(spec_path, lambda d: d["source"].update(after_commit="delete"))
    (landing / "events.json").write_text('{"event_id": "e1", "user_id": "u1", "amount": 1.0}\n')
    assert _run(spec_path) == "committed"
    assert not (landing / "events.json").exists()
    _edit(spec_path, lambda d: d["source"].update(after_commit="keep"))
    (landing / "events.json").write_text('{"event_id": "e2", "user_id": "u1", "amount": 5.0}\n')
    rows = len(_ledger_rows(spec_path))
    with pytest.raises(SpecChangedError, match="source.files.after_commit changed from 'delete' to 'keep'") as info:
        _run(spec_path)
    assert "would be skipped" in str(info.value) and "revert the spec" in str(info.value)
    assert len(_ledger_rows(spec_path)) == rows, "nothing is written"
    assert main(["-q", "run", str(spec_path)]) == EXIT_TERMINAL
    assert "after_commit" in capsys.readouterr().err
    # Reverted, the new file is read: it has another size and mtime.
    _edit(spec_path, lambda d: d["source"].update(after_commit="delete"))
    assert _run(spec_path) == "committed"
    state = {r["user_id"]: r["amount"] for r in read_all(open_table(load_spec(spec_path).state_path)).to_pylist()}
    assert state == {"u1": 6.0}
    # `delete` and `archive` tell files apart alike: switching between them is recorded.
    _edit(spec_path, lambda d: d["source"].update(after_commit="archive", archive="archived"))
    (landing / "more.json").write_text('{"event_id": "e3", "user_id": "u2", "amount": 2.0}\n')
    assert _run(spec_path) == "committed"
    assert (spec_path.parent / "archived" / "more.json").exists()


def test_switching_after_commit_from_keep_to_delete_is_refused(spec_path):
    """The reverse: files rewritten after they were consumed would count as new."""
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=10)
    assert _run(spec_path) == "committed"
    _edit(spec_path, lambda d: d["source"].update(after_commit="delete"))
    with pytest.raises(SpecChangedError, match="from 'keep' to 'delete'.*would be read again"):
        _run(spec_path)


def test_csv_columns_moved_under_a_running_pipeline_are_refused_by_the_cli(tmp_path, compute, capsys):
    """Reproduced with the CLI: `user_id STRING, page STRING` became `page
    STRING, user_id STRING`, and the next batch took `home` for a key.
    Refused now, before anything is written; a rewind to the batch made under
    the old order is refused too. (Batch 1 on real Spark.)"""
    source = {"type": "files", "path": "landing", "format": "csv", "schema": "user_id STRING, page STRING", "csv": {"header": False}}
    spec_file = write_spec(tmp_path, oracle_spec_dict(
        source=source,
        transform="SELECT user_id, count(*) AS views FROM batch GROUP BY user_id",
        state={"path": "lake/state", "keys": ["user_id"], "merge": {"views": "sum"}},
    ))
    landing = tmp_path / "landing"
    (landing / "a.csv").write_text("u1,home\nu2,cart\n")
    assert run_batch(load_spec(spec_file), RunOptions(run_id="test"), compute).status == "committed"
    _edit(spec_file, lambda d: d["source"].update(schema="page STRING, user_id STRING"))
    (landing / "b.csv").write_text("u1,home\n")
    capsys.readouterr()
    assert main(["-q", "run", str(spec_file)]) == EXIT_TERMINAL
    assert "source columns moved from ['user_id', 'page'] to ['page', 'user_id']" in capsys.readouterr().err
    assert main(["-q", "rewind", str(spec_file), "--to-batch", "1"]) == EXIT_TERMINAL
    state = {r["user_id"]: r["views"] for r in read_all(open_table(load_spec(spec_file).state_path)).to_pylist()}
    assert state == {"u1": 1, "u2": 1}


# -- 2. identity ---------------------------------------------------------------------------


def _twin(tmp_path: Path, folder: str) -> Path:
    """A pipeline named `clicks` with its own source and checkpoint, sharing one state table."""
    spec = oracle_spec_dict(
        source={**oracle_spec_dict()["source"], "path": f"{folder}/landing"},
        state={**oracle_spec_dict()["state"], "path": str(tmp_path / "shared" / "state")},
        checkpoint=f"{folder}/checkpoint",
    )
    return write_spec(tmp_path, spec, name=f"{folder}.yaml")


def test_two_pipelines_with_one_name_sharing_a_state_are_told_apart(tmp_path):
    """Reproduced: the second recorded the first's batch as its own, then skipped its own files."""
    first, second = _twin(tmp_path, "a"), _twin(tmp_path, "b")
    write_wave(tmp_path / "a" / "landing", 0, files=1, records_per_file=100)
    write_wave(tmp_path / "b" / "landing", 0, files=1, records_per_file=100)  # same file names
    assert _run(first) == "committed"
    with pytest.raises(StateLedgerMismatchError, match="not this state's"):
        _run(second)
    assert _ledger_rows(second) == [], "nothing was written to the second pipeline's ledger"
    assert main(["-q", "run", str(second)]) == EXIT_TERMINAL


def test_a_state_committed_by_another_pipeline_id_between_plan_and_commit_is_refused(tmp_path):
    """Both planned batch 1 with the same range; the first committed it. The
    second must not take that commit for its own, though names and offsets match."""
    first, second = _twin(tmp_path, "a"), _twin(tmp_path, "b")
    write_wave(tmp_path / "a" / "landing", 0, files=1, records_per_file=50)
    write_wave(tmp_path / "b" / "landing", 0, files=1, records_per_file=50)

    def other_pipeline_commits(point: str) -> None:
        if point == "after_plan":
            faults.set_hook(None)
            assert _run(first) == "committed"

    faults.set_hook(other_pipeline_commits)
    try:
        with pytest.raises(StateLedgerMismatchError, match="id "):
            _run(second)
    finally:
        faults.set_hook(None)
    [planned] = _ledger_rows(second)
    assert planned.status is RowStatus.PLANNED and planned.pipeline_id != _ledger_rows(first)[0].pipeline_id


def test_every_row_and_commit_carries_the_pipeline_id(spec_path):
    landing = spec_path.parent / "landing"
    for wave in range(2):
        write_wave(landing, wave, files=1, records_per_file=10)
        assert _run(spec_path) == "committed"
    rewind(load_spec(spec_path), 1, run_id="test-rewind")
    ids = {r.pipeline_id for r in _ledger_rows(spec_path)}
    assert len(ids) == 1 and None not in ids


def test_a_ledger_from_before_ids_is_upgraded_in_place(spec_path):
    """Format-1 ledgers lack the new columns: the next write adds them; old rows read as None."""
    spec = load_spec(spec_path)
    old_schema = pa.schema([f for f in SCHEMA if f.name not in ("pipeline_id", "spec", "spec_fingerprint")])
    old_row = {"pipeline": "other", "epoch": 0, "batch_id": 1, "status": "planned", "start_offsets": "{}",
               "end_offsets": "{}", "manifest": "{}", "format_version": 1}
    write_deltalake(ensure_table(spec.ledger_path, old_schema), pa.Table.from_pylist([old_row], old_schema), mode="append")
    write_wave(spec_path.parent / "landing", 0, files=1, records_per_file=10)
    assert _run(spec_path) == "committed"
    assert "pipeline_id" in pa.schema(open_table(spec.ledger_path).schema().to_arrow()).names
    assert_exact(spec_path)
    [old] = OffsetLedger(spec.ledger_path, "other").load().rows
    assert (old.pipeline_id, old.spec, old.spec_fingerprint) == (None, None, None)


def test_a_new_merge_column_joins_the_state_with_nulls_for_old_rows(tmp_path, compute):
    """Compatible: the state gains the column; rows no later batch touched hold null (Spark end to end)."""
    spec_path = write_spec(tmp_path, oracle_spec_dict(
        transform="SELECT user_id, count(*) AS events FROM batch GROUP BY user_id",
        state={"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum"}},
    ))
    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=40, users=8)
    assert run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute).status == "committed"

    def add_amount(d):
        d["transform"] = "SELECT user_id, count(*) AS events, sum(amount) AS amount FROM batch WHERE user_id < 'user000004' GROUP BY user_id"
        d["state"]["merge"]["amount"] = "sum"

    _edit(spec_path, add_amount)
    write_wave(landing, 1, files=1, records_per_file=40, users=8)
    assert run_batch(load_spec(spec_path), RunOptions(run_id="test"), compute).status == "committed"
    rows = {r["user_id"]: r for r in read_all(open_table(load_spec(spec_path).state_path)).to_pylist()}
    touched = {u for u, r in rows.items() if r["_batch_id"] == 2}
    assert touched and all(u < "user000004" for u in touched)
    assert {u for u, r in rows.items() if r["amount"] is not None} == touched, "old rows hold null"
    committed = [r for r in history(load_spec(spec_path)) if r.status is RowStatus.COMMITTED]
    assert len({r.spec_fingerprint for r in committed}) == 2
