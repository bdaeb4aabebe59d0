"""A pure-Arrow `Compute` for the oracle pipeline: the protocol without a JVM.

The protocol (`spark_jobs.core.protocol.run_batch`) takes its compute as a
factory, so protocol properties can be explored at Delta speed (milliseconds
a batch) instead of Spark speed (seconds). This compute supports exactly one
pipeline shape: JSON-lines files with the oracle's source schema and
`ORACLE_TRANSFORM` as the transform. It mirrors what `SparkCompute` does for
that shape:

* lines are split on ``\\r?\\n``; blank lines are not records; line numbers
  count every line of the file, from 1;
* a line that is not a JSON object is quarantined; each field is extracted
  and then cast, and a value that does not cast is quarantined with a reason
  naming the field and value; a record with a null or missing key is
  quarantined (reasons worded as Spark's, first failing check wins);
* valid records are aggregated per ``user_id``: ``count(*)``, ``sum(amount)``,
  ``sum(<40-bit sha256 of event_id>)``, ``max(ts)``, as `ORACLE_TRANSFORM`.

It is written independently of the oracle (`clickstream.fold`), so the
machine's state-equals-fold check also cross-checks the two.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa

from spark_jobs.demo.clickstream import ORACLE_TRANSFORM
from spark_jobs.core.compute import QUARANTINE_COLUMNS, ComputeResult, check_result_columns, validate_updates
from spark_jobs.errors import TransformError
from spark_jobs.sources.base import BatchRange
from spark_jobs.core.spec import PipelineSpec

#: Arrow types for the source schema types this compute can parse.
ARROW_TYPES: dict[str, pa.DataType] = {
    "STRING": pa.string(),
    "DOUBLE": pa.float64(),
    "BIGINT": pa.int64(),
    "TIMESTAMP": pa.timestamp("us", tz="UTC"),
}

#: What `ORACLE_TRANSFORM` returns, in order.
RESULT_SCHEMA = pa.schema(
    [
        ("user_id", pa.string()),
        ("events", pa.int64()),
        ("amount", pa.float64()),
        ("idhash", pa.int64()),
        ("last_seen", pa.timestamp("us", tz="UTC")),
    ]
)

_SHAPE_REASON = "malformed JSON: not a JSON object on one line"


class Uncastable(ValueError):
    """A field's text does not convert to its declared type."""


def id_hash(event_id: str) -> int:
    """The transform's per-record hash: first 10 hex digits of sha256 (40 bits)."""
    return int(hashlib.sha256(event_id.encode("utf-8")).hexdigest()[:10], 16)


def _normalise_sql(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).strip()


def _as_text(value: Any) -> str:
    """A JSON value as the text Spark's from_json extracts into a STRING field."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _cast(value: Any, sql_type: str) -> Any:
    """Convert one extracted JSON value (not None) to `sql_type`, or raise `Uncastable`."""
    if sql_type == "STRING":
        return _as_text(value)
    if sql_type == "DOUBLE":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Uncastable
        return float(value)
    if sql_type == "BIGINT":
        if isinstance(value, bool) or not isinstance(value, int):
            raise Uncastable
        return value
    if sql_type == "TIMESTAMP":
        if not isinstance(value, str):
            raise Uncastable
        try:
            ts = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise Uncastable from None
        return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
    raise AssertionError(sql_type)  # `check` rejected other types


def _path_of(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path))


class ArrowCompute:
    """`Compute` for the oracle pipeline with pyarrow and the standard library only."""

    reads_at_once = 1

    def start(self) -> None:
        """No engine to start."""

    def check(self, spec: PipelineSpec, batch: BatchRange | None = None, *, alongside: bool = False) -> None:
        """Refuse any pipeline this compute does not implement, before anything is written."""
        if spec.source.format != "json":
            raise TransformError(f"pipeline {spec.name}: ArrowCompute reads JSON lines only, not {spec.source.format}")
        unsupported = [f"{f.name} {f.type}" for f in spec.source.fields if f.type not in ARROW_TYPES]
        if unsupported:
            raise TransformError(f"pipeline {spec.name}: ArrowCompute cannot parse {', '.join(unsupported)}")
        if _normalise_sql(spec.transform) != _normalise_sql(ORACLE_TRANSFORM):
            raise TransformError(f"pipeline {spec.name}: ArrowCompute implements ORACLE_TRANSFORM only")
        check_result_columns(spec, RESULT_SCHEMA.names)

    def process(self, spec: PipelineSpec, batch: BatchRange, *, alongside: bool = False) -> ComputeResult:
        self.check(spec)
        fields = spec.source.fields
        keys = set(spec.state.keys)
        valid: dict[str, list[Any]] = {f.name: [] for f in fields}
        bad: dict[str, list[Any]] = {name: [] for name in QUARANTINE_COLUMNS.names}
        records_in = 0
        for uri in batch.manifest.uris:
            text = _path_of(uri).read_text(encoding="utf-8")
            for number, raw in enumerate(re.split(r"\r?\n", text), start=1):
                if not raw.strip():
                    continue
                records_in += 1
                record, reason = self._parse(raw, fields, keys)
                if reason is None:
                    for f in fields:
                        valid[f.name].append(record[f.name])
                else:
                    for column, value in zip(QUARANTINE_COLUMNS.names, (uri, number, raw, reason)):
                        bad[column].append(value)
        parsed = pa.table({f.name: pa.array(valid[f.name], ARROW_TYPES[f.type]) for f in fields})
        quarantine = pa.table(bad, schema=QUARANTINE_COLUMNS)
        return ComputeResult(validate_updates(spec, self._transform(parsed)), quarantine, records_in)

    def close(self) -> None:
        """Nothing to release: no engine, no threads."""

    @staticmethod
    def _parse(raw: str, fields: list, keys: set[str]) -> tuple[dict[str, Any], str | None]:
        """One line to typed values, or the reason it is quarantined."""
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return {}, _SHAPE_REASON
        if not isinstance(obj, dict):
            return {}, _SHAPE_REASON
        record: dict[str, Any] = {}
        for f in fields:
            value = obj.get(f.name)
            if value is None:
                record[f.name] = None
                continue
            try:
                record[f.name] = _cast(value, f.type)
            except Uncastable:
                return {}, f"field {f.name}: '{_as_text(value)[:200]}' is not a {f.type}"
        for f in fields:
            if f.name in keys and record[f.name] is None:
                return {}, f"key {f.name} is missing or null"
        return record, None

    @staticmethod
    def _transform(parsed: pa.Table) -> pa.Table:
        """`ORACLE_TRANSFORM` over the valid records."""
        hashes = pa.array(
            [None if e is None else id_hash(e) for e in parsed.column("event_id").to_pylist()], pa.int64()
        )
        grouped = parsed.append_column("_idhash", hashes).group_by("user_id").aggregate(
            [([], "count_all"), ("amount", "sum"), ("_idhash", "sum"), ("ts", "max")]
        )
        renamed = grouped.rename_columns(
            {"count_all": "events", "amount_sum": "amount", "_idhash_sum": "idhash", "ts_max": "last_seen"}
        )
        return renamed.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA)
