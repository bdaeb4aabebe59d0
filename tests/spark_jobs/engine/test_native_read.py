"""Spark's own readers against the exact read: the same batch, the same result.

`SparkCompute` reads local JSON and CSV files natively and sends a file the
exact way (numbered lines) only when it is suspect
(`spark_jobs.engine.native_read`). These tests generate files full of the
lines that make the two readers differ (byte-order marks, lone carriage
returns, NULs, top-level arrays, invalid and overlong UTF-8, over-long
lines, control characters, bad values, CSV headers that do not fit) mixed
with clean ones, and require the routed read to return exactly what the
exact read returns for every file: the same state updates, the same
quarantine rows (file, line, raw text, reason) and the same record count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_jobs.core.spec import load_spec
from spark_jobs.engine.spark_compute import SparkCompute
from spark_jobs.sources import make_source
from spark_jobs.sources.base import Caps
from tests.conftest import BatchesLineage, oracle_spec_dict, write_spec

SCHEMA = "event_id STRING, user_id STRING NOT NULL, amount DOUBLE, n BIGINT, ts TIMESTAMP"
TRANSFORM = (
    "SELECT user_id, count(*) AS events, sum(amount) AS amount, max(n) AS n, max(ts) AS ts, "
    "concat_ws('|', sort_array(collect_list(event_id))) AS ids FROM batch GROUP BY user_id"
)
STATE = {"path": "lake/state", "keys": ["user_id"], "merge": {"events": "sum", "amount": "sum", "n": "max", "ts": "max", "ids": "last"}}
MAX_LINE_BYTES = 200

# -- lines ------------------------------------------------------------------------------

_ids = st.integers(0, 999).map(lambda i: f"e{i}")
_users = st.sampled_from(["u1", "u2", "ü3", "u 4"])
_amounts = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
    st.integers(-5, 5),
    st.sampled_from(["12.5", "abc", True, None, "NaN", "-Infinity", 1e400, float("nan")]),
)
_ns = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**64, 1.5, "7", None, "x"]))
_tss = st.sampled_from(["2026-01-01T00:00:00Z", "2026-01-01 10:00:00", "2026-13-01", "yesterday", 1700000000, None])


@st.composite
def json_record(draw) -> bytes:
    fields = {"event_id": draw(_ids), "user_id": draw(_users), "amount": draw(_amounts), "n": draw(_ns), "ts": draw(_tss)}
    for name in draw(st.sets(st.sampled_from(list(fields)), max_size=2)):
        del fields[name]  # missing fields (user_id missing is a NOT NULL failure)
    if draw(st.booleans()):
        fields["extra"] = draw(st.sampled_from([{"nested": [1, {"a": "b"}]}, "x" * 150, "\u2028\u00e9"]))
    text = json.dumps(fields, ensure_ascii=draw(st.booleans()), allow_nan=True)
    return text.encode()


_json_odd = st.sampled_from(
    [
        b"this is not json",
        b'{"event_id": "broken", "user_id": "u1",',
        b"[1, 2, 3]",
        b'[{"event_id": "a1", "user_id": "u1"}, {"event_id": "a2", "user_id": "u2"}]',
        b"[]",
        b"  [ ]",
        b"null",
        b"42",
        b'"text"',
        b'{"event_id": "t1", "user_id": "u1"} {"event_id": "t2", "user_id": "u1"}',
        b'{"event_id": "z1", "user_id": "u\xff"}',
        b'{"event_id": "z2", "user_id": "u1", "other": "\xc0\x80"}',
        b'{"event_id": "z3", "user_id": "u\xed\xa0\x80"}',
        '{"event_id": "w1", "user_id": "u1"}'.encode("utf-32-be"),
        b'{"event_id": "nul", "user_id": "u1"}\x00',
        b'{"event_id": "c1", "user_id": "u1"}\r{"event_id": "c2", "user_id": "u2"}',
        b"\x0b",
        b"\x0c\x0c",
        b"\x01",
        b"   ",
        b"\t",
        b"",
    ]
)


@st.composite
def json_line(draw) -> bytes:
    line = draw(st.one_of(json_record(), json_record(), _json_odd))
    if draw(st.integers(0, 9)) == 0:
        line = b"\xef\xbb\xbf" + line  # a byte-order mark, on any line
    return line


_csv_values = st.sampled_from(["e1", "u1", "u2", "1.5", "x", "", '"q,uoted"', '"u1"', "NaN", "7", "2026-01-01T00:00:00Z", " u3 "])


@st.composite
def csv_line(draw, delimiter: str) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.sampled_from([b"", b"  ", b"\x01\x02", b"\x0b", b"a\rb", b"x\x00y", b"\xff\xfe", b"\xef\xbb\xbfe1,u1,1,2,"]))
    columns = draw(st.integers(3, 6))
    return delimiter.join(draw(_csv_values) for _ in range(columns)).encode()


def _header(delimiter: str, fits: bool, bom: bool) -> bytes:
    names = ["event_id", "user_id", "amount", "n", "ts"] if fits else ["event_id", "user", "amount", "n", "ts"]
    return (b"\xef\xbb\xbf" if bom else b"") + delimiter.join(f'"{n}"' if i == 1 else n for i, n in enumerate(names)).encode()


@st.composite
def files(draw, fmt: str, header: bool, delimiter: str) -> list[bytes]:
    """Up to 5 files; about half of them clean, so batches mix the two reads."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        clean = draw(st.booleans())
        if fmt == "json":
            lines = draw(st.lists(json_record() if clean else json_line(), max_size=8))
            if not clean and draw(st.booleans()):
                lines.append(b'{"event_id": "long", "user_id": "u1", "pad": "' + b"x" * MAX_LINE_BYTES + b'"}')
        else:
            lines = draw(st.lists(csv_line(delimiter), max_size=8))
            if header:
                lines.insert(draw(st.integers(0, 1)) if lines else 0, b"")
                lines.insert(1 if lines[0] == b"" else 0, _header(delimiter, fits=clean or draw(st.booleans()), bom=draw(st.booleans())))
        ending = draw(st.sampled_from([b"\n", b"\r\n"]))
        body = ending.join(lines) + (ending if draw(st.booleans()) else b"")
        out.append(body)
    return out


# -- the comparison ---------------------------------------------------------------------


def _spec(tmp_path: Path, fmt: str, header: bool = True, delimiter: str = ","):
    source = {"type": "files", "path": "landing", "format": fmt, "schema": SCHEMA, "max_line_bytes": MAX_LINE_BYTES}
    if fmt == "csv":
        source["csv"] = {"header": header, "delimiter": delimiter}
    return load_spec(write_spec(tmp_path, oracle_spec_dict(source=source, transform=TRANSFORM, state=STATE)))


def _both_reads(spark, spec, contents: list[bytes], suffix: str):
    landing = Path(spec.source_path)
    for old in landing.iterdir():
        old.unlink()
    for i, content in enumerate(contents):
        (landing / f"f{i}{suffix}").write_bytes(content)
    batch = make_source(spec).plan(BatchesLineage(), until=None, caps=Caps())
    if batch is None:
        return None, None
    routed = SparkCompute(session=spark).process(spec, batch)
    exact = SparkCompute(session=spark, native_reads=False).process(spec, batch)
    return routed, exact


def _same(routed, exact) -> None:
    assert routed.records_in == exact.records_in
    key = lambda row: tuple(str(v) for v in row.values())  # noqa: E731
    assert sorted(routed.updates.to_pylist(), key=key) == sorted(exact.updates.to_pylist(), key=key)
    assert sorted(routed.quarantine.to_pylist(), key=key) == sorted(exact.quarantine.to_pylist(), key=key)


@pytest.fixture(scope="module")
def json_spec(tmp_path_factory):
    return _spec(tmp_path_factory.mktemp("json"), "json")


@pytest.fixture(scope="module", params=[(True, ","), (False, "\t")], ids=["header-comma", "no-header-tab"])
def csv_spec(tmp_path_factory, request):
    header, delimiter = request.param
    return _spec(tmp_path_factory.mktemp("csv"), "csv", header, delimiter)


def _check(spark, spec, examples: int, *, derandomize: bool) -> None:
    """`examples` generated batches of `spec`'s format: the routed read equals the exact read."""
    fmt, csv = spec.source.format, spec.source.csv

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def batches(data):
        routed, exact = _both_reads(spark, spec, data.draw(files(fmt, csv.header, csv.delimiter)), f".{fmt}")
        if routed is not None:
            _same(routed, exact)

    batches()


#: Generated batches a format gets in `make test` (the same ones every run);
#: `make soak` generates 300 new ones a format.
EXAMPLES = 6


def test_json_batches_read_natively_equal_the_exact_read(spark, json_spec):
    _check(spark, json_spec, EXAMPLES, derandomize=True)


def test_csv_batches_read_natively_equal_the_exact_read(spark, csv_spec):
    _check(spark, csv_spec, EXAMPLES, derandomize=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_many_json_batches_read_natively_equal_the_exact_read(spark, json_spec):
    """The soak: new random batches every run."""
    _check(spark, json_spec, 300, derandomize=False)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_many_csv_batches_read_natively_equal_the_exact_read(spark, csv_spec):
    _check(spark, csv_spec, 300, derandomize=False)


def test_a_clean_batch_is_one_query_and_a_suspect_file_alone_is_read_again(tmp_path, spark):
    """Clean files cost one Spark query; a bad line sends only its own file the exact way."""
    spec = _spec(tmp_path, "json")
    good = b'{"event_id": "a", "user_id": "u1", "amount": 1.5}\n'
    queries = _QueryCounter(spark)
    routed, _ = _both_reads(spark, spec, [good * 3, good * 2], ".json")
    assert routed.records_in == 5 and routed.quarantine.num_rows == 0
    assert queries.since() == 1 + 1  # the routed read's one query, and the exact read's one
    routed, exact = _both_reads(spark, spec, [good * 3, good + b"[1]\n" + good], ".json")
    _same(routed, exact)
    assert [(r["file"].rsplit("/", 1)[1], r["line"]) for r in routed.quarantine.to_pylist()] == [("f1.json", 2)]
    # routed: the first read, the batch again (f1 by line), its quarantine; exact: the batch, its quarantine
    assert queries.since() == 3 + 2


class _QueryCounter:
    """SQL queries that ran Spark jobs since the last call (Spark's own status
    store, which keeps the newest executions; commands such as creating the
    `batch` view run no jobs)."""

    def __init__(self, spark) -> None:
        self._store = spark._jsparkSession.sharedState().statusStore()
        self._last = max((e.executionId() for e in self._newest()), default=-1)

    def _newest(self, most: int = 100) -> list:
        count = self._store.executionsCount()
        if count == 0:
            return []
        executions = self._store.executionsList(max(0, count - most), min(count, most))
        return [executions.apply(i) for i in range(executions.size())]

    def since(self) -> int:
        new = [e for e in self._newest() if e.executionId() > self._last]
        self._last = max([e.executionId() for e in new], default=self._last)
        return sum(1 for e in new if e.jobs().size() > 0)


# -- the driver's scan, rule by rule ----------------------------------------------------

_CLEAN_JSON = b'{"event_id": "a", "user_id": "u1", "amount": 1.5}\r\n{"event_id": "b", "user_id": "\xc3\xbc3", "pad": "[x]"}\n'
_CLEAN_CSV = b"event_id,user_id,amount,n,ts\r\ne1,u1,1.5,2,\r\n e2 , u2 ,\t,\x0b,\x0c\n"


@pytest.mark.parametrize(
    ("fmt", "content", "suspect"),
    [
        ("json", _CLEAN_JSON, False),
        ("json", b"", False),
        ("json", _CLEAN_JSON + b'{"event_id": "c", "user_id": "u\xff"}\n', True),  # not UTF-8
        ("json", _CLEAN_JSON + b'{"event_id": "c", "user_id": "u\xc0\x80"}', True),  # overlong, last line
        ("json", _CLEAN_JSON + b'\xef\xbb\xbf{"event_id": "c", "user_id": "u1"}\n', True),  # BOM on a later line
        ("json", _CLEAN_JSON + b'{"event_id": "c", "user_id": "u1"}\x00\n', True),  # NUL
        ("json", _CLEAN_JSON + b"\x01\n", True),  # control character
        ("json", _CLEAN_JSON + b" \t\r[1, 2]\n", True),  # top-level array, later line
        ("json", b'[{"event_id": "c", "user_id": "u1"}]', True),  # top-level array, first line
        ("json", _CLEAN_JSON + b'{"event_id": "c", "user_id": "u1", "pad": "' + b"x" * MAX_LINE_BYTES + b'"}\n', True),
        ("json", b'{"pad": "' + b"x" * (MAX_LINE_BYTES - 11) + b'"}\n' + _CLEAN_JSON, False),  # exactly the limit
        ("csv", _CLEAN_CSV, False),
        ("csv", _CLEAN_CSV + b"e3,u3\r1,2,\n", True),  # CR inside a line
        ("csv", _CLEAN_CSV + b"e3,u3,1,2,\r", True),  # CR after the last LF
        ("csv", _CLEAN_CSV + b"\x01\x02\n", True),  # control characters only
        ("csv", b"event_id,user,amount,n,ts\ne1,u1,1,2,\n", True),  # header does not fit
    ],
)
@pytest.mark.parametrize("chunk", [7, 1 << 24], ids=["small-chunks", "one-chunk"])
def test_the_driver_scan_finds_what_the_reads_might_read_differently(tmp_path, monkeypatch, fmt, content, suspect, chunk):
    """Every rule of the scan, also with chunk ends anywhere in a line."""
    from spark_jobs.engine import native_read

    monkeypatch.setattr(native_read, "_CHUNK_BYTES", chunk)
    spec = _spec(tmp_path, fmt)
    path = tmp_path / f"f.{fmt}"
    path.write_bytes(content)
    assert native_read.suspect_on_driver(spec, str(path)) is suspect
