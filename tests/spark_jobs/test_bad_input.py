"""Bad input: a catalogue of malformed records, each quarantined with its reason.

Every case is one small file holding one good record and the bad ones; the
check is always the same: each bad line has the expected reason, and
valid + quarantined = the records in the file. Unreadable files are the
exception: they fail the batch by name and nothing is consumed. The cases
run through `SparkCompute.process` directly (no Delta writes, so they are
quick); `test_end_to_end_through_the_protocol` runs a mixed batch through
the commit protocol and checks the quarantine table and the state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_jobs.core.delta_io import open_table, read_all
from spark_jobs.errors import SourceChangedError, SourceError
from spark_jobs.core.ledger import OffsetLedger, RowStatus
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.sources import make_source
from spark_jobs.sources.base import Caps
from spark_jobs.engine.parse import LONG_LINE_RAW_CHARS
from spark_jobs.engine.spark_compute import SparkCompute
from spark_jobs.core.spec import load_spec
from tests.conftest import BatchesLineage, oracle_spec_dict, write_spec

SCHEMA = "event_id STRING, user_id STRING NOT NULL, amount DOUBLE, n BIGINT"
SIMPLE = {
    "transform": "SELECT user_id, count(*) AS events, sum(amount) AS amount FROM batch GROUP BY user_id",
    "state": {"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum", "amount": "sum"}},
}
GOOD = b'{"event_id":"ok","user_id":"u1","amount":1.5,"n":1}'
NOT_NULL = "field user_id is missing or null (NOT NULL in source.schema)"


def _spec(tmp_path: Path, **source):
    base = {"type": "files", "path": "landing", "format": "json", "schema": SCHEMA}
    return load_spec(write_spec(tmp_path, oracle_spec_dict(source={**base, **source}, **SIMPLE)))


def _process(spark, spec, files: dict[str, bytes]):
    """Land `files`, plan them as one batch and compute it."""
    landing = Path(spec.source_path)
    for name, content in files.items():
        (landing / name).write_bytes(content)
    batch = make_source(spec).plan(BatchesLineage(), until=None, caps=Caps())
    return SparkCompute(session=spark).process(spec, batch)


def _line(record: dict) -> bytes:
    return json.dumps(record).encode()


CASES = {
    "broken JSON": (
        {},
        GOOD + b'\n{"event_id":"b","user_id":"u1",\n',
        2,
        {2: "malformed JSON: not a JSON object on one line"},
    ),
    "wrong type": (
        {},
        GOOD + b'\n{"event_id":"b","user_id":"u1","amount":"abc"}\n{"event_id":"c","user_id":"u1","amount":true}\n',
        3,
        {2: "field amount: 'abc' is not a DOUBLE", 3: "field amount: 'true' is not a DOUBLE"},
    ),
    "missing key field": ({}, GOOD + b'\n{"event_id":"b","amount":1}\n', 2, {2: NOT_NULL}),
    "null key field": ({}, GOOD + b'\n{"event_id":"b","user_id":null,"amount":1}\n', 2, {2: NOT_NULL}),
    "JSON array and scalars instead of an object": (
        {},
        GOOD + b'\n[1,2]\n"text"\n42\nnull\n',
        5,
        {n: "malformed JSON: not a JSON object on one line" for n in (2, 3, 4, 5)},
    ),
    "numeric overflow": (
        {},
        GOOD + b'\n{"event_id":"b","user_id":"u1","amount":1e400}\n{"event_id":"c","user_id":"u1","n":1180591620717411303424}\n',
        3,
        {
            2: "field amount: Infinity is not a finite DOUBLE (NaN, Infinity and numbers beyond its range are refused)",
            3: "field n: '1180591620717411303424' is not a BIGINT (or is out of its range)",
        },
    ),
    "NaN and Infinity": (
        {},
        GOOD + b'\n{"event_id":"b","user_id":"u1","amount":NaN}\n{"event_id":"c","user_id":"u1","amount":"-Infinity"}\n',
        3,
        {
            2: "field amount: NaN is not a finite DOUBLE (NaN, Infinity and numbers beyond its range are refused)",
            3: "field amount: -Infinity is not a finite DOUBLE (NaN, Infinity and numbers beyond its range are refused)",
        },
    ),
    "invalid UTF-8": (
        {},
        GOOD + b'\n{"event_id":"b","user_id":"u\xff\xfe","amount":1}\n',
        2,
        {2: "line is not valid UTF-8 (the bytes that are not were replaced by U+FFFD in raw); not parsed"},
    ),
    "UTF-8 byte-order mark is not part of the record": (
        {}, b"\xef\xbb\xbf" + GOOD + b"\n" + GOOD.replace(b'"ok"', b'"ok2"') + b"\n", 2, {}
    ),
    "CRLF line endings": ({}, GOOD + b"\r\n" + GOOD.replace(b'"ok"', b'"ok2"') + b"\r\n", 2, {}),
    "blank-line-only file": ({}, b"\n  \n\r\n\t\n", 0, {}),
    "empty file": ({}, b"", 0, {}),
    "CSV with the wrong column count": (
        {"format": "csv"},
        b"event_id,user_id,amount,n\nok,u1,1.5,1\nb,u1\nc,u1,1,2,extra\n",
        3,
        {3: "malformed CSV: expected 4 columns separated by ','", 4: "malformed CSV: expected 4 columns separated by ','"},
    ),
    "tab-separated CSV with a BOM and CRLF": (
        {"format": "csv", "csv": {"header": True, "delimiter": "\t"}},
        b"\xef\xbb\xbfevent_id\tuser_id\tamount\tn\r\nok\tu1\t1.5\t1\r\nb\t\t2\t\r\n",
        2,
        {3: NOT_NULL},
    ),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_record_catalogue(tmp_path, spark, kind):
    source, content, records, expected = CASES[kind]
    spec = _spec(tmp_path, **source)
    suffix = ".csv" if source.get("format") == "csv" else ".json"
    result = _process(spark, spec, {"case" + suffix: content})
    quarantined = {row["line"]: row for row in result.quarantine.to_pylist()}
    assert {line: row["reason"] for line, row in quarantined.items()} == expected
    valid = sum(result.updates.column("events").to_pylist())
    assert result.records_in == records
    assert valid + len(quarantined) == records, "valid + quarantined must equal the input"
    for row in quarantined.values():
        row["raw"].encode("utf-8")  # raw is always valid text, whatever the input bytes were


def test_huge_line_is_quarantined_unparsed_with_a_short_raw(tmp_path, spark):
    spec = _spec(tmp_path, max_line_bytes=1024)
    huge = _line({"event_id": "h", "user_id": "u1", "amount": 1.0, "pad": "x" * 5000})
    result = _process(spark, spec, {"case.json": GOOD + b"\n" + huge + b"\n"})
    [row] = result.quarantine.to_pylist()
    assert row["line"] == 2
    assert row["reason"] == (
        f"line is {len(huge)} bytes, longer than source.max_line_bytes (1024); not parsed "
        f"(raw text cut to {LONG_LINE_RAW_CHARS} characters)"
    )
    assert row["raw"] == huge.decode()[:LONG_LINE_RAW_CHARS]
    assert result.records_in == 2 and sum(result.updates.column("events").to_pylist()) == 1


def test_invalid_utf8_raw_keeps_the_readable_part(tmp_path, spark):
    spec = _spec(tmp_path)
    result = _process(spark, spec, {"case.json": b'{"event_id":"b","user_id":"u\xff","amount":1}\n'})
    [row] = result.quarantine.to_pylist()
    assert row["raw"] == '{"event_id":"b","user_id":"u\ufffd","amount":1}'


def test_a_misspelled_field_is_quarantined_when_unknown_fields_says_so(tmp_path, spark):
    """Issue 49: `{"amuont": 7.5}` under `amount DOUBLE` went in as a null
    amount, silently. With `source.unknown_fields: quarantine` (JSON, read
    the exact way) a field the schema does not name quarantines its record,
    by name; the default still ignores it. A NOT NULL field that is missing
    is quarantined either way."""
    from spark_jobs.errors import SpecError

    content = b"\n".join([
        GOOD,
        _line({"event_id": "t", "user_id": "u1", "amuont": 7.5, "n": 1}),
        _line({"event_id": "x", "user_id": "u2", "amount": 1.0, "n": 2, "extra": {"a": 1}, "z": 0}),
        b"[1, 2]",
        _line({"event_id": "m", "amount": 1.0}),
        _line({"event_id": "c", "user_id": "u3", "Amount": 2.0}),
    ]) + b"\n"
    why = " (source.schema does not name them; source.unknown_fields: quarantine)"
    malformed = "malformed JSON: not a JSON object on one line"
    strict = _process(spark, _spec(tmp_path / "strict", unknown_fields="quarantine"), {"case.json": content})
    reasons = {row["line"]: row["reason"] for row in strict.quarantine.to_pylist()}
    assert reasons == {
        2: "unknown field(s) 'amuont'" + why,
        3: "unknown field(s) 'extra', 'z'" + why,
        4: malformed,
        5: NOT_NULL,
        6: "unknown field(s) 'Amount'" + why,  # names match exactly, as the parser matches them
    }
    assert strict.records_in == 6 and sum(strict.updates.column("events").to_pylist()) == 1
    lenient = _process(spark, _spec(tmp_path / "lenient"), {"case.json": content})
    assert {row["line"]: row["reason"] for row in lenient.quarantine.to_pylist()} == {4: malformed, 5: NOT_NULL}
    assert sum(lenient.updates.column("events").to_pylist()) == 4
    with pytest.raises(SpecError, match="unknown_fields: quarantine is for JSON records"):
        _spec(tmp_path / "csv", format="csv", unknown_fields="quarantine")


def test_parquet_nan_and_not_null_are_quarantined(tmp_path, spark):
    spec = _spec(tmp_path, format="parquet")
    table = pa.table({"event_id": ["a", "b", "c"], "user_id": ["u1", "u1", None], "amount": [1.0, float("nan"), 2.0]})
    pq.write_table(table, Path(spec.source_path) / "a.parquet")
    batch = make_source(spec).plan(BatchesLineage(), until=None, caps=Caps())
    result = SparkCompute(session=spark).process(spec, batch)
    reasons = {row["line"]: row["reason"] for row in result.quarantine.to_pylist()}
    assert reasons == {2: "field amount: NaN is not a finite DOUBLE (NaN, Infinity and numbers beyond its range are refused)", 3: NOT_NULL}
    assert result.records_in == 3 and sum(result.updates.column("events").to_pylist()) == 1


def _truncated_parquet(path: Path) -> None:
    pq.write_table(pa.table({"event_id": ["a"], "user_id": ["u1"], "amount": [1.0]}), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", ["truncated", "empty", "not parquet"])
def test_unreadable_parquet_fails_at_plan_time_and_writes_nothing(tmp_path, compute, damage):
    spec = _spec(tmp_path, format="parquet")
    landing = Path(spec.source_path)
    pq.write_table(pa.table({"event_id": ["a"], "user_id": ["u1"], "amount": [1.0]}), landing / "good.parquet")
    bad = landing / "bad.parquet"
    if damage == "truncated":
        _truncated_parquet(bad)
    else:
        bad.write_bytes(b"" if damage == "empty" else b'{"this": "is json"}\n')
    with pytest.raises(SourceError) as info:
        run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    message = str(info.value)
    assert "source file bad.parquet" in message and "not a readable Parquet file" in message
    assert "move it out of the source folder" in message
    assert not (tmp_path / "lake").exists(), "nothing may be written before the file is readable"
    # Recovery: move it away; the next run consumes the rest.
    os.rename(bad, landing / "_bad.parquet")
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert outcome.status == "committed" and outcome.inputs == ("good.parquet",)


class _BreaksAFileAfterPlanning:
    """A compute that damages a planned file before reading it (a file replaced
    or corrupted between planning and reading)."""

    def __init__(self, inner, damage) -> None:
        self.inner, self.damage = inner, damage

    @property
    def reads_at_once(self) -> int:
        return self.inner.reads_at_once

    def start(self) -> None:
        self.inner.start()

    def check(self, spec, batch, **options) -> None:
        self.inner.check(spec, batch, **options)

    def process(self, spec, batch, **options):
        self.damage()
        return self.inner.process(spec, batch, **options)

    def close(self) -> None:
        self.inner.close()


def test_file_broken_after_planning_fails_by_name_and_replays_after_repair(tmp_path, compute):
    spec = _spec(tmp_path, format="parquet")
    landing = Path(spec.source_path)
    good = pa.table({"event_id": ["a", "b"], "user_id": ["u1", "u2"], "amount": [1.0, 2.0]})
    pq.write_table(good, landing / "a.parquet")
    with pytest.raises(SourceError) as info:
        run_batch(spec, RunOptions(run_id="test"), compute_factory=lambda: _BreaksAFileAfterPlanning(compute(), lambda: _truncated_parquet(landing / "a.parquet")))
    message = str(info.value)
    assert "cannot read source file a.parquet" in message and "microbatch rewind SPEC --to-batch K" in message
    rows = OffsetLedger(spec.ledger_path, spec.name).load().rows
    assert [r.status for r in rows] == [RowStatus.PLANNED], "planned, never committed"
    assert open_table(spec.state_path) is None
    # Neither removing nor replacing the file gets past the plan: a replay
    # reads exactly what was planned, and refuses by name what changed.
    (landing / "a.parquet").unlink()
    with pytest.raises(SourceChangedError, match="a.parquet .* is gone"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    pq.write_table(good, landing / "a.parquet")
    with pytest.raises(SourceChangedError, match="a.parquet .* was rewritten"):
        run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    # Giving up the plan does: the next run plans afresh from what is there.
    rewind(spec, 0, run_id="test-rewind")
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert (outcome.status, outcome.epoch, outcome.batch_id, outcome.records_in) == ("committed", 1, 1, 2)


def test_end_to_end_through_the_protocol(tmp_path, compute):
    spec = _spec(tmp_path, max_line_bytes=256)
    landing = Path(spec.source_path)
    files = {
        "a.json": b"\xef\xbb\xbf" + _line({"event_id": "a1", "user_id": "u1", "amount": 2.0}) + b"\r\n"
        + b"not json\r\n"
        + _line({"event_id": "a2", "user_id": "u2", "amount": 3.0}) + b"\r\n",
        "b.json": _line({"event_id": "b1", "user_id": None, "amount": 5.0}) + b"\n"
        + _line({"event_id": "b2", "user_id": "u1", "amount": "x"}) + b"\n"
        + _line({"event_id": "b3", "user_id": "u1", "amount": 4.0, "pad": "y" * 300}) + b"\n"
        + b'{"event_id":"b4","user_id":"u\xff","amount":1}\n'
        + b'{"event_id":"b5","user_id":"u2","amount":1e400}\n'
        + _line({"event_id": "b6", "user_id": "u2", "amount": 0.5}) + b"\n",
        "c.json": b"\n\n",
        "d.json": b"",
    }
    for name, content in files.items():
        (landing / name).write_bytes(content)
    outcome = run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)
    assert (outcome.status, outcome.records_in, outcome.records_quarantined) == ("committed", 9, 6)
    table = read_all(open_table(spec.quarantine_path)).to_pylist()
    got = sorted((r["file"].rsplit("/", 1)[1], r["line"], r["reason"]) for r in table)
    huge = len(_line({"event_id": "b3", "user_id": "u1", "amount": 4.0, "pad": "y" * 300}))
    expected = [
        ("a.json", 2, "malformed JSON: not a JSON object on one line"),
        ("b.json", 1, NOT_NULL),
        ("b.json", 2, "field amount: 'x' is not a DOUBLE"),
        ("b.json", 3, f"line is {huge} bytes, longer than source.max_line_bytes (256); not parsed"),
        ("b.json", 4, "line is not valid UTF-8"),
        ("b.json", 5, "field amount: Infinity is not a finite DOUBLE"),
    ]
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert all(g[2].startswith(e[2]) for g, e in zip(got, expected)), got
    assert all(r["pipeline"] == spec.name and (r["epoch"], r["batch_id"]) == (0, 1) for r in table)
    # Totals are exact for the valid records: u1 = a1; u2 = a2 + b6.
    state = {r["user_id"]: (r["events"], r["amount"]) for r in read_all(open_table(spec.state_path)).to_pylist()}
    assert state == {"u1": (1, 2.0), "u2": (2, 3.5)}
    [committed] = [r for r in OffsetLedger(spec.ledger_path, spec.name).load().rows if r.status == RowStatus.COMMITTED]
    assert (committed.records_in, committed.records_quarantined) == (9, 6)
    assert sorted(f["name"] for f in committed.manifest["files"]) == sorted(files), "empty files are consumed too"


def test_a_batch_over_the_quarantine_limit_commits_then_the_cli_exits_2_and_a_catch_up_stops(tmp_path, on_connect):
    """Issue 65: past `quarantine.max_records` the batch commits (nothing is
    lost) and `microbatch run` exits 2 naming the limit and the table; a
    catch-up stops after that batch; `on_exceed: warn` warns and exits 0."""
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import write_wave
    from tests.conftest import assert_exact, oracle_spec_dict, run_cli, write_spec

    path = write_spec(tmp_path, oracle_spec_dict(quarantine={"max_records": 3}, batch={"max_files": 1}))
    for wave in (0, 1):
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=50, bad_every=10)  # 5 quarantined each
    done = run_cli("run", str(path), "--catch-up")
    assert done.returncode == 2, done.stderr
    assert "batch 1 (epoch 0) committed, but it quarantined 5 of its" in done.stderr
    assert "over quarantine.max_records (3)" in done.stderr and "/quarantine" in done.stderr
    spec = load_spec(path)
    committed = [r for r in OffsetLedger(spec.ledger_path, spec.name).load().rows if r.status == RowStatus.COMMITTED]
    assert [(r.batch_id, r.records_quarantined) for r in committed] == [(1, 5)], "the catch-up stopped after batch 1"
    write_spec(tmp_path, oracle_spec_dict(quarantine={"max_records": 3, "on_exceed": "warn"}, batch={"max_files": 1}))
    done = run_cli("run", str(path))
    assert done.returncode == 0, done.stderr
    assert "warning (quarantine.on_exceed: warn): pipeline clicks: batch 2 (epoch 0) committed" in done.stderr
    assert_exact(path)
