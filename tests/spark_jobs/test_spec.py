"""Spec validation: each kind of mistake gets its own message, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spark_jobs.errors import SpecError
from spark_jobs.spec import load_spec, parse_schema
from tests.conftest import ROOT, oracle_spec_dict, run_cli, write_spec

ISSUE_SPEC = ROOT / "dags" / "pipelines" / "clicks_per_user.yaml"


def _error_for(tmp_path: Path, spec: dict | str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value)


def test_the_issue_spec_loads_as_written():
    spec = load_spec(ISSUE_SPEC)
    assert spec.name == "clicks_per_user"
    assert spec.state.keys == ["user_id"]
    assert spec.state.merge == {"events": "sum", "amount": "sum", "last_seen": "max"}
    assert spec.batch.max_files == 100
    assert [f.name for f in spec.source.fields] == ["event_id", "user_id", "amount", "ts"]
    # Relative paths resolve against the spec file's folder, not the cwd.
    assert spec.source_path == str((ISSUE_SPEC.parent / "landing" / "clicks").resolve())
    assert spec.ledger_path.endswith("lakehouse/_checkpoints/clicks_per_user/offsets")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: s.pop("name"), "field `name`: is required"),
        (lambda s: s.update(name="Clicks-Per-User"), "not a valid pipeline name"),
        (lambda s: s["source"].update(format="xml"), "'xml' is not a format; use json, csv or parquet"),
        (lambda s: s["source"].update(type="kafka"), "'kafka' is not a source type"),
        (lambda s: s["source"].update(schema="event_id STRING, amount MONEY"), "has type 'MONEY'"),
        (lambda s: s["source"].update(schema="event_id, amount DOUBLE"), "has no type"),
        (lambda s: s["source"].update(schema="a STRING, a INT"), "appears twice"),
        (lambda s: s["source"].update(schema="tags ARRAY<STRING>"), "read nested data as STRING"),
        (lambda s: s["state"]["merge"].update(events="avg"), "merge rule 'avg'; use one of sum, min, max, first, last"),
        (lambda s: s["state"].update(keys=[]), "field `state.keys`"),
        (lambda s: s["state"].update(keys=["user id; DROP TABLE x"]), "is not a plain identifier"),
        (lambda s: s["state"]["merge"].update({"x = 1 OR true": "sum"}), "is not a plain identifier"),
        (lambda s: s["state"]["merge"].update(user_id="last"), "listed both as key and under merge"),
        (lambda s: s["state"]["merge"].update(_batch_id="last"), "reserved"),
        (lambda s: s.update(transform="SELECT 1"), "must read the new records from the view `batch`"),
        (lambda s: s["batch"].update(max_files=0), "field `batch.max_files`"),
        (lambda s: s.update(checkpont="x"), "field `checkpont`: is not a known field"),
    ],
)
def test_each_mistake_has_its_own_message(tmp_path, change, expected):
    spec = oracle_spec_dict()
    change(spec)
    message = _error_for(tmp_path, spec)
    assert expected in message
    assert "bad.yaml" in message


def test_error_names_the_yaml_line(tmp_path):
    text = ISSUE_SPEC.read_text().replace("merge: {events: sum", "merge: {events: average")
    message = _error_for(tmp_path, text)
    line = next(i for i, l in enumerate(text.splitlines(), 1) if "merge:" in l)
    assert f"line {line}, field `state.merge`" in message


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    message = _error_for(tmp_path, "name: x\nsource: [unclosed\n")
    assert "not valid YAML" in message and "line 3" in message


def test_all_problems_reported_at_once(tmp_path):
    spec = oracle_spec_dict()
    spec["source"]["format"] = "xml"
    spec["state"]["merge"]["events"] = "avg"
    message = _error_for(tmp_path, spec)
    assert "source.format" in message and "state.merge" in message


def test_missing_file():
    with pytest.raises(SpecError, match="file not found"):
        load_spec("/nonexistent/spec.yaml")


def test_schema_parser_handles_decimals():
    fields = parse_schema("id STRING, price DECIMAL(10, 2), n bigint")
    assert [(f.name, f.type) for f in fields] == [("id", "STRING"), ("price", "DECIMAL(10,2)"), ("n", "BIGINT")]


def test_bad_spec_fails_on_the_cli_before_any_write(tmp_path):
    spec = oracle_spec_dict()
    spec["state"]["merge"]["events"] = "avg"
    path = write_spec(tmp_path, spec)
    (tmp_path / "landing" / "a.json").write_text('{"event_id":"1","user_id":"u","amount":1}\n')
    result = run_cli("run", str(path))
    assert result.returncode == 2
    assert "merge rule 'avg'" in result.stderr
    assert not (tmp_path / "lake").exists()


def test_transform_not_matching_state_fails_before_any_write(tmp_path, compute):
    from spark_jobs.errors import TransformError
    from spark_jobs.protocol import run_batch

    spec = oracle_spec_dict(transform="SELECT user_id, count(*) AS n FROM batch GROUP BY user_id")
    path = write_spec(tmp_path, spec)
    (tmp_path / "landing" / "a.json").write_text('{"event_id":"1","user_id":"u","amount":1}\n')
    with pytest.raises(TransformError) as info:
        run_batch(load_spec(path), compute_factory=compute)
    assert "lacks column(s) events, amount, idhash, last_seen" in str(info.value)
    assert "returns column(s) n that have no merge rule" in str(info.value)
    assert not (tmp_path / "lake").exists()
