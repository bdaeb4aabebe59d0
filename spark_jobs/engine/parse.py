"""From text to typed records: the casts and checks every read path shares.

A source field is first taken as text and then cast with `try_cast`, so a bad
value yields a precise reason ("field amount: 'abc' is not a DOUBLE")
instead of a silently null column. The same expressions serve the exact
read (numbered lines, `spark_jobs.engine.exact_read`), Spark's own readers
(`spark_jobs.engine.native_read`) and Kafka records: a record is judged the
same way whichever path read it, which is what lets a batch mix them.

Columns the read paths add beside the source's own fields start with two
underscores (the spec refuses source fields that do): ``__file``,
``__line``, ``__raw``, ``__reason`` (null for a valid record) and ``__keep``
(how much raw text a quarantine row keeps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.sql_text import spark_identifier

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = [
    "CORRUPT",
    "Check",
    "FILE",
    "KEEP",
    "LINE",
    "LONG_LINE_RAW_CHARS",
    "MAX_RAW_CHARS",
    "RAW",
    "REASON",
    "failing",
    "parse_lines",
    "reason",
    "reader_options",
    "shape_reason",
    "text_schema",
    "typed_fields",
]

FILE, LINE, RAW, REASON, KEEP = "__file", "__line", "__raw", "__reason", "__keep"
#: The parsers' column for the text of a record they could not read.
CORRUPT = "__corrupt"

#: Raw text kept for a quarantined record; longer lines are cut (and say so).
MAX_RAW_CHARS = 65_536
#: Raw text kept for a line over `source.max_line_bytes`: it was never parsed,
#: and a few such lines must not bloat the quarantine table.
LONG_LINE_RAW_CHARS = 1_024
_FLOATING = ("FLOAT", "DOUBLE")
_INTEGRAL = ("TINYINT", "SMALLINT", "INT", "BIGINT")


@dataclass(frozen=True)
class Check:
    """One way a record fails: a condition, and the reason quarantine gives."""

    fails: Column
    #: Non-null whenever `fails` holds.
    why: Column


def reason(checks: list[Check]) -> Column:
    """The first failed check's reason (checks in order of precedence); null for a valid record."""
    from pyspark.sql import functions as F

    return F.coalesce(*[F.when(check.fails, check.why) for check in checks])


def failing(checks: list[Check]) -> Column:
    """True when any check fails: `reason` is not null, without building its text
    (a read that only needs to know whether a record failed)."""
    from functools import reduce

    from pyspark.sql import functions as F

    return reduce(lambda a, b: a | b, [F.coalesce(check.fails, F.lit(False)) for check in checks])


def text_schema(spec: PipelineSpec) -> str:
    """Every field as text, plus the corrupt-record column: what the parsers are asked for."""
    return ", ".join(f"{spark_identifier(f.name)} STRING" for f in spec.source.fields) + f", `{CORRUPT}` STRING"


def reader_options(spec: PipelineSpec) -> dict[str, str]:
    """Parser options shared by `from_json`/`from_csv` and Spark's JSON and CSV readers.

    PERMISSIVE with a corrupt-record column: a record the parser cannot read
    is kept (and quarantined by its reason), never dropped.
    """
    options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT}
    if spec.source.format == "csv":
        options["sep"] = spec.source.csv.delimiter
    return options


def shape_reason(spec: PipelineSpec) -> str:
    """Why a record the parser could not read is quarantined."""
    if spec.source.format == "json":
        return "malformed JSON: not a JSON object on one line"
    return f"malformed CSV: expected {len(spec.source.fields)} columns separated by {spec.source.csv.delimiter!r}"


def typed_fields(spec: PipelineSpec, text: dict[str, Column], malformed: Column) -> tuple[list[Column], list[Check]]:
    """The source's fields cast from their `text`, and the checks a record must pass.

    `malformed` is true for a record the parser could not read. Checks come
    in order of precedence: shape, then each field's cast, then the values'
    own checks (`value_checks`).
    """
    from pyspark.sql import functions as F

    checks = [Check(malformed, F.lit(shape_reason(spec)))]
    typed: dict[str, Column] = {}
    for f in spec.source.fields:
        value_text = text[f.name]
        if f.type in _FLOATING:
            # The JSON parser hands JSON's bare NaN / Infinity tokens (and
            # numbers too large for a double, which Jackson reads as Infinity)
            # to a STRING field quoted; unquote them so they are reported as
            # non-finite rather than as text. (The quote is tested first: a
            # regular expression on every value costs.)
            value_text = F.when(
                value_text.startswith('"'), F.regexp_replace(value_text, '^"(NaN|[+-]?Infinity)"$', "$1")
            ).otherwise(value_text)
        value = value_text if f.type == "STRING" else value_text.try_cast(f.type)
        typed[f.name] = value
        if f.type != "STRING":
            checks.append(
                Check(
                    value_text.isNotNull() & value.isNull(),
                    F.concat(F.lit(f"field {f.name}: '"), F.substring(value_text, 1, 200), F.lit(f"' {_cast_problem(f.type)}")),
                )
            )
    checks.extend(value_checks(spec, typed))
    return [value.alias(name) for name, value in typed.items()], checks


def value_checks(spec: PipelineSpec, typed: dict[str, Column]) -> list[Check]:
    """Checks of typed values that are well-formed but unusable.

    NaN and infinities are refused in FLOAT/DOUBLE columns: one of them
    summed into the state would poison that key's total for good (JSON's
    1e400 arrives as Infinity). NOT NULL columns and keys must be present:
    a null key cannot be merged.
    """
    from pyspark.sql import functions as F

    checks = []
    for f in spec.source.fields:
        if f.type in _FLOATING:
            value = typed[f.name]
            checks.append(
                Check(
                    F.isnan(value) | (F.abs(value) == F.lit(float("inf"))),
                    F.concat(
                        F.lit(f"field {f.name}: "),
                        value.cast("string"),
                        F.lit(f" is not a finite {f.type} (NaN, Infinity and numbers beyond its range are refused)"),
                    ),
                )
            )
    for f in spec.source.fields:
        if not f.nullable:
            checks.append(Check(typed[f.name].isNull(), F.lit(f"field {f.name} is missing or null (NOT NULL in source.schema)")))
    checks.extend(Check(typed[key].isNull(), F.lit(f"key {key} is missing or null")) for key in spec.state.keys if key in typed)
    return checks


def parse_lines(spec: PipelineSpec, lines: DataFrame, checks: list[Check], extra: tuple[str, ...] = ()) -> DataFrame:
    """Typed fields and a reason from lines (``__file``, ``__line``, ``__raw``, ``__utf8``).

    Over-long and undecodable lines are not parsed at all. `checks` are the
    caller's own (a CSV header that does not fit, a Kafka record without a
    value), ranked after those two; `extra` columns pass through.
    """
    from pyspark.sql import functions as F

    limit = spec.source.max_line_bytes
    lines = lines.withColumn("__bytes", F.octet_length(RAW))
    too_long = F.col("__bytes") > F.lit(limit)
    not_utf8 = ~F.col("__utf8")
    parse_input = F.when(~too_long & ~not_utf8, F.col(RAW))
    checks = [
        Check(
            too_long,
            F.concat(
                F.lit("line is "),
                F.col("__bytes").cast("string"),
                F.lit(f" bytes, longer than source.max_line_bytes ({limit}); not parsed"),
            ),
        ),
        Check(not_utf8, F.lit("line is not valid UTF-8 (the bytes that are not were replaced by U+FFFD in raw); not parsed")),
        *checks,
    ]
    keep = F.when(too_long, F.lit(LONG_LINE_RAW_CHARS)).otherwise(F.lit(MAX_RAW_CHARS))
    if spec.source.format == "text":
        return lines.select(FILE, LINE, RAW, parse_input.alias("value"), reason(checks).alias(REASON), keep.alias(KEEP), *extra)
    if spec.source.format == "json":
        record = F.from_json(parse_input, text_schema(spec), reader_options(spec))
        if getattr(spec.source, "unknown_fields", "ignore") == "quarantine":
            checks.append(_unknown_fields(spec, parse_input))
    else:
        record = F.from_csv(parse_input, text_schema(spec), reader_options(spec))
    parsed = lines.withColumn("__r", record)
    # (A line not parsed has no record either; its own reason ranks first.)
    malformed = F.col("__r").isNull() | F.col(f"__r.{CORRUPT}").isNotNull()
    text = {f.name: F.col(f"__r.{spark_identifier(f.name)}") for f in spec.source.fields}
    typed, field_checks = typed_fields(spec, text, malformed)
    return parsed.select(FILE, LINE, RAW, *typed, reason(checks + field_checks).alias(REASON), keep.alias(KEEP), *extra)


def _unknown_fields(spec: PipelineSpec, text: Column) -> Check:
    """A JSON record naming a field `source.schema` does not (names match
    exactly, as the parser matches them): `source.unknown_fields:
    quarantine`. A record that is no JSON object has no keys, and fails by
    its shape instead."""
    from pyspark.sql import functions as F

    unknown = F.array_except(F.json_object_keys(text), F.array(*[F.lit(f.name) for f in spec.source.fields]))
    return Check(
        F.size(unknown) > 0,
        F.concat(
            F.lit("unknown field(s) "),
            # Quoted: a key may hold a comma, or be empty.
            F.substring(F.array_join(F.transform(unknown, lambda name: F.concat(F.lit("'"), name, F.lit("'"))), ", "), 1, 200),
            F.lit(" (source.schema does not name them; source.unknown_fields: quarantine)"),
        ),
    )


def _cast_problem(sql_type: str) -> str:
    """How a value that did not cast to `sql_type` is described."""
    if sql_type in _INTEGRAL:
        return f"is not a {sql_type} (or is out of its range)"
    if sql_type.startswith("DECIMAL"):
        return f"is not a {sql_type} (or has too many digits for it)"
    return f"is not a {sql_type}"
