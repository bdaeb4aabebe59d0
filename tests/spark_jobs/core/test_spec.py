"""Spec validation: each kind of mistake gets its own message, and nothing is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from spark_jobs.errors import SpecError
from spark_jobs.core.spec import load_spec, parse_schema
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
        (lambda s: s["source"].update(type="kinesis"), "'kinesis' is not a source type; use files, delta or kafka"),
        (lambda s: s["source"].update(schema="event_id STRING, amount MONEY"), "has type 'MONEY'"),
        (lambda s: s["source"].update(schema="event_id, amount DOUBLE"), "has no type"),
        (lambda s: s["source"].update(schema="a STRING, a INT"), "appears twice"),
        (lambda s: s["source"].update(schema="tags ARRAY<STRING>"), "read nested data as STRING"),
        (lambda s: s["state"]["merge"].update(events="avg"), "merge rule 'avg'; use one of sum, min, max, first, last"),
        (lambda s: s["state"].update(keys=[]), "field `state.keys`"),
        (lambda s: s["state"].update(keys=["user id; DROP TABLE x"]), "is not a plain identifier"),
        (lambda s: s["state"]["merge"].update({"x = 1 OR true": "sum"}), "is not a plain identifier"),
        (lambda s: s["state"]["merge"].update(user_id="last"), "listed both as key and under merge"),
        (lambda s: s["state"]["merge"].update(Events="sum"), "field `state.merge`: merge columns 'events' and 'Events' differ only in case"),
        (lambda s: s["state"]["merge"].update(_batch_id="last"), "reserved"),
        (lambda s: s["state"]["merge"].update(_Batch_id="sum"), "'_Batch_id' is reserved"),
        (lambda s: s["state"].update(keys=["_BATCH_ID"]), "'_BATCH_ID' is reserved"),
        (lambda s: s.update(transform="SELECT 1"), "must read the new records from the view `batch`"),
        (lambda s: s["batch"].update(max_files=0), "field `batch.max_files`"),
        (lambda s: s.update(checkpont="x"), "field `checkpont`: is not a known field"),
        (lambda s: s["state"].update(path="landing/state"), "field `state.path`: "),
        (lambda s: s.update(checkpoint="landing/_ckpt"), "overlaps source.path"),
        (lambda s: s["source"].update(path="lake"), "keep the source folder apart from the tables"),
        (lambda s: s.update(checkpoint="lake/state/_ckpt"), "is inside the state table's folder"),
        (lambda s: s["state"].update(path="lake/_checkpoints/clicks/offsets"), "overlaps the checkpoint's table"),
        (lambda s: s["state"].update(path="lake/a%41b/state"), "field `state.path`: "),
        (lambda s: s["state"].update(path="lake/a%41b/state"), "holds '%41', which delta-rs reads as 'A'"),
        (lambda s: s.update(checkpoint="lake/_ckpt%2Fx"), "field `checkpoint`: "),
        (lambda s: s["state"].update(path="s3://bucket/x%41b/state"), "holds '%41'"),
        (lambda s: s["state"].update(path="lake/a\\b/state"), "holds '\\\\', which delta-rs cannot open a table under"),
        (lambda s: s["state"].update(path="lake/team[1]/state"), "holds '['"),
        (lambda s: s.update(checkpoint="lake/a|b"), "field `checkpoint`: "),
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
    assert "line 2, column 9: not valid YAML" in message and "at line 3, column 1" in message


def test_an_unclosed_quote_is_named_where_it_opens_not_where_the_file_ends(tmp_path):
    """Issue 65: a quote left open was reported at the last line, where PyYAML gave up."""
    lines = ISSUE_SPEC.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("schema:"))
    assert lines[at].endswith('"') and '"' not in "".join(lines[at + 1:]).replace('"@hourly"', "")
    lines[at] = lines[at][:-1]
    lines = [line.replace('"@hourly"', "'@hourly'") for line in lines]
    message = _error_for(tmp_path, "\n".join(lines) + "\n")
    column = lines[at].index('"') + 1
    assert f"line {at + 1}, column {column}: not valid YAML (while scanning a quoted scalar that opens here" in message
    assert f"found unexpected end of stream at line {len(lines) + 1}, column 1" in message


@pytest.mark.parametrize("quote", ['"', "'"])
def test_an_unclosed_quote_closed_by_a_later_one_is_named_where_it_opens(tmp_path, quote):
    """Found by the review of issue 65: a quote left open on the schema line
    ran on to the next quote (line 21's "@hourly", or an apostrophe in a
    comment) and the error named that line."""
    lines = ISSUE_SPEC.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("schema:"))
    lines[at] = lines[at].replace('"', quote, 1)[:-1]
    message = _error_for(tmp_path, "\n".join(lines) + "\n")
    column = lines[at].index(quote) + 1
    assert f"line {at + 1}, column {column}: not valid YAML (a quoted value opens here and runs on to line" in message
    assert "is its closing quote missing? The parser stopped at line" in message


def test_a_yaml_error_inside_a_block_names_where_the_parser_stopped_and_the_block(tmp_path):
    message = _error_for(tmp_path, "name: x\nsource:\n  type: files\n  format: json\n schema: a\n")
    assert "line 5, column 2: not valid YAML (did not find expected key;" in message
    assert "while parsing a block mapping that starts at line 1, column 1" in message


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


def test_a_folder_with_a_percent_escape_fails_before_any_write(tmp_path):
    """delta-rs 1.6 writes a table under `a%41b/` and then looks for it
    under `aAb/`: a spec in such a folder is refused by name (its relative
    paths resolve there), and a `%` that is no escape, or a character
    delta-rs takes, is taken as it is."""
    folder = tmp_path / "team a%41b"
    folder.mkdir()
    path = write_spec(folder, oracle_spec_dict())
    (folder / "landing" / "a.json").write_text('{"event_id":"1","user_id":"u","amount":1}\n')
    result = run_cli("run", str(path))
    assert result.returncode == 2
    assert "field `state.path`" in result.stderr and "holds '%41', which delta-rs reads as 'A'" in result.stderr
    assert not (folder / "lake").exists()
    plain = tmp_path / "100% done #{1} é"
    plain.mkdir()
    assert load_spec(write_spec(plain, oracle_spec_dict())).state_path.startswith(str(plain))


def test_transform_not_matching_state_fails_before_any_write(tmp_path, compute):
    from spark_jobs.errors import TransformError
    from spark_jobs.core.protocol import RunOptions, run_batch

    spec = oracle_spec_dict(transform="SELECT user_id, count(*) AS n FROM batch GROUP BY user_id")
    path = write_spec(tmp_path, spec)
    (tmp_path / "landing" / "a.json").write_text('{"event_id":"1","user_id":"u","amount":1}\n')
    with pytest.raises(TransformError) as info:
        run_batch(load_spec(path), RunOptions(run_id="test"), compute_factory=compute)
    assert "lacks column(s) events, amount, idhash, last_seen" in str(info.value)
    assert "returns column(s) n that have no merge rule" in str(info.value)
    assert not (tmp_path / "lake").exists()


# -- hardening: identifiers, names, options ------------------------------------------

ATTACKS = ["user_id) OR 1=1 --", "a`; DROP TABLE t", "x' OR '1'='1", "user_id\n", "usеr_id", 'a" = "a']


FIELDS_UNDER_ATTACK = [
    ("state.keys", lambda s, a: s["state"].update(keys=[a]), "is not a plain identifier"),
    ("state.merge", lambda s, a: s["state"]["merge"].update({a: "sum"}), "is not a plain identifier"),
    ("source.schema", lambda s, a: s["source"].update(schema=f"{a} STRING, amount DOUBLE"), "is not a plain identifier"),
    ("name", lambda s, a: s.update(name=a), "is not a valid pipeline name"),
]


@pytest.mark.parametrize(
    ("attack", "where", "change", "expected"),
    [
        (attack, *field)
        for attack in ATTACKS
        for field in FIELDS_UNDER_ATTACK
        # In DDL a newline is whitespace between name and type, not part of the name.
        if not (field[0] == "source.schema" and attack == "user_id\n")
    ],
)
def test_injection_attempts_fail_at_validation(tmp_path, attack, where, change, expected):
    spec = oracle_spec_dict()
    change(spec, attack)
    message = _error_for(tmp_path, spec)
    assert f"field `{where}`" in message and expected in message


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ("event_id STRING) ; DROP TABLE t; --", "has type"),
        ("event_id STRING NOT NULL DEFAULT 'x'", "has type"),
        ("event_id STRING COMMENT 'x' OR 1=1", "has type"),
        ("event_id DECIMAL(10,2)) OR (1", "has type"),
    ],
)
def test_schema_ddl_accepts_only_name_type_not_null(tmp_path, schema, expected):
    message = _error_for(tmp_path, oracle_spec_dict(source={**oracle_spec_dict()["source"], "schema": schema}))
    assert "field `source.schema`" in message and expected in message


def test_not_null_in_the_schema():
    fields = parse_schema("user_id STRING NOT NULL, amount double not null, n INT")
    assert [(f.name, f.type, f.nullable) for f in fields] == [
        ("user_id", "STRING", False),
        ("amount", "DOUBLE", False),
        ("n", "INT", True),
    ]


@pytest.mark.parametrize("delimiter", ['"', "\\", "\n", "\r", "\x00"])
def test_csv_delimiters_that_break_records_are_refused(tmp_path, delimiter):
    source = {**oracle_spec_dict()["source"], "format": "csv", "csv": {"header": True, "delimiter": delimiter}}
    message = _error_for(tmp_path, oracle_spec_dict(source=source))
    assert "field `source.csv.delimiter`" in message and "cannot separate CSV columns" in message


def test_quoting_helpers_refuse_what_validation_would_refuse():
    from spark_jobs.core.sql_text import datafusion_identifier, spark_identifier

    assert spark_identifier("user_id") == "`user_id`"
    assert datafusion_identifier("user_id") == '"user_id"'
    for bad in ATTACKS:
        for quote in (spark_identifier, datafusion_identifier):
            with pytest.raises(ValueError):
                quote(bad)


# -- storage roots ----------------------------------------------------------------------


def _spec_file(tmp_path: Path, **changes) -> Path:
    spec = oracle_spec_dict()
    for key, value in changes.items():
        if key == "source_path":
            spec["source"]["path"] = value
        elif key == "state_path":
            spec["state"]["path"] = value
        else:
            spec[key] = value
    path = tmp_path / "specs" / "p.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_without_roots_relative_paths_cannot_climb_out(tmp_path, monkeypatch):
    monkeypatch.delenv("MICROBATCH_STORAGE_ROOTS", raising=False)
    path = _spec_file(tmp_path, state_path="lake/../../elsewhere/state", checkpoint="x/../../../etc")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert f"line {_line_of(path, 'elsewhere')}, field `state.path`: 'lake/../../elsewhere/state' climbs out" in message
    assert f"line {_line_of(path, 'checkpoint:')}, field `checkpoint`" in message
    # Absolute paths stay allowed when no roots are configured.
    assert load_spec(_spec_file(tmp_path, state_path=str(tmp_path / "abs" / "state"))).state_path == str(tmp_path / "abs" / "state")


def test_roots_confine_every_location(tmp_path, monkeypatch):
    root = tmp_path / "data"
    (root / "landing").mkdir(parents=True)
    monkeypatch.setenv("MICROBATCH_STORAGE_ROOTS", f"{root}{os.pathsep}s3://bucket/team")
    inside = _spec_file(
        tmp_path, source_path=str(root / "landing"), state_path="s3://bucket/team/state", checkpoint=str(root / "ckpt")
    )
    assert load_spec(inside).checkpoint_path == str(root / "ckpt")
    cases = {
        "source.path": dict(source_path=str(root / ".." / "outside")),
        "state.path": dict(state_path="s3://bucket/teammate/state"),
        "checkpoint": dict(checkpoint="s3://other-bucket/team/ckpt"),
    }
    for field, change in cases.items():
        base = dict(source_path=str(root / "landing"), state_path=str(root / "state"), checkpoint=str(root / "ckpt"))
        with pytest.raises(SpecError) as info:
            load_spec(_spec_file(tmp_path, **{**base, **change}))
        assert f"field `{field}`" in str(info.value) and "outside the allowed storage roots" in str(info.value)


def test_roots_follow_symlinks_and_refuse_dotdot_in_uris(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (tmp_path / "secret").mkdir()
    (root / "link").symlink_to(tmp_path / "secret")
    path = _spec_file(tmp_path, source_path=str(root), state_path=str(root / "link" / "state"), checkpoint=str(root / "c"))
    with pytest.raises(SpecError, match=r"field `state.path`: .* resolves to .*secret/state, outside"):
        load_spec(path, storage_roots=[str(root)])
    path = _spec_file(tmp_path, source_path=str(root), state_path="s3://bucket/team/../other/state", checkpoint=str(root / "c"))
    with pytest.raises(SpecError, match=r"field `state.path`: .*'\.\.' or '\.' segment"):
        load_spec(path, storage_roots=[str(root), "s3://bucket/team"])


def test_escaping_path_fails_on_the_cli_and_writes_nothing(tmp_path):
    root = tmp_path / "allowed"
    root.mkdir()
    path = _spec_file(tmp_path, source_path=str(root), state_path=str(tmp_path / "lake" / "state"), checkpoint=str(root / "ckpt"))
    (root / "a.json").write_text('{"event_id":"1","user_id":"u","amount":1}\n')
    result = run_cli("run", str(path), "--storage-root", str(root), "--storage-root", "s3://bucket/x")
    assert result.returncode == 2
    assert "field `state.path`" in result.stderr and "outside the allowed storage roots" in result.stderr
    assert not (tmp_path / "lake").exists() and not (root / "ckpt").exists()


def _kafka_spec(**source) -> dict:
    spec = oracle_spec_dict()
    spec["source"] = {"type": "kafka", "bootstrap_servers": "b:9092", "topic": "clicks", "format": "json", "schema": "user_id STRING, amount DOUBLE", **source}
    return spec


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"options": {"sasl.password": "x"}}, "option 'sasl.password' is a secret and a spec holds none: set MICROBATCH_KAFKA_SASL_PASSWORD"),
        ({"options": {"auto.offset.reset": "latest"}}, "option 'auto.offset.reset' is set by the job"),
        ({"options": {"sasl.oauthbearer.assertion.private.key.passphrase": "x"}}, "is a secret"),
        ({"format": "text"}, "format text has one STRING column `value`"),
        ({"schema": None}, "format json needs `schema`"),
        ({"schema": "user_id STRING, _kafka_offset BIGINT"}, "clash with the columns the Kafka source adds"),
        ({"csv": {"header": True}, "format": "csv"}, "a Kafka record is one CSV line with no header"),
        ({"topic": "has space"}, "field `source.topic`"),
        ({"format": "csv", "csv": {"delimiter": ";"}}, None),
        ({"format": "parquet"}, "'parquet' is not a format; use json, csv or text"),
    ],
)
def test_kafka_source_mistakes_are_named(tmp_path, source, expected):
    spec = _kafka_spec(**source)
    spec["source"] = {k: v for k, v in spec["source"].items() if v is not None}
    if expected is None:  # valid: a delimiter alone (no header is implied)
        path = tmp_path / "ok.yaml"
        path.write_text(yaml.safe_dump(spec))
        assert load_spec(path).source.csv.delimiter == ";"
        return
    assert expected in _error_for(tmp_path, spec)


def test_a_kafka_spec_has_no_storage_location_to_confine(tmp_path):
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(_kafka_spec()))
    spec = load_spec(path, storage_roots=[str(tmp_path)])
    assert spec.source_path == "kafka://clicks" and [f.name for f in spec.source.fields] == ["user_id", "amount"]


@pytest.mark.parametrize("column", ["_change_type", "_commit_version", "_COMMIT_TIMESTAMP"])
def test_a_change_feed_state_column_named_like_the_feed_s_own_is_refused_by_name(tmp_path, column):
    """Delta's change data feed gives each row `_change_type`,
    `_commit_version` and `_commit_timestamp`: a state column of such a name,
    with `change_feed`, failed every batch after the first (delta-rs's MERGE:
    "Projections require unique expression names"). Refused before any write,
    naming the column; without a change feed the name is free."""
    base = oracle_spec_dict()
    spec = oracle_spec_dict(state={**base["state"], "change_feed": True, "merge": {**base["state"]["merge"], column: "max"}})
    message = _error_for(tmp_path, spec)
    assert repr(column) in message and "change data feed" in message and "rename it with AS" in message
    spec["state"]["change_feed"] = False
    assert load_spec(write_spec(tmp_path, spec)).state.merge[column] == "max"
