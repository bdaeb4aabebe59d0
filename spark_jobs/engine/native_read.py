"""Spark's own JSON and CSV readers for local files, and the lines they might read differently.

The exact read (`spark_jobs.engine.exact_read`) numbers every line, which
quarantine needs, at a price: a file is one value before it is split, and
each line is then parsed from decoded text. Spark's JSON and CSV readers
parse straight from the file's bytes, several times faster, but they number
nothing. Line numbers matter only for records that fail, so a batch's local
files are read natively first, and a file goes the exact way only when it is
*suspect* (`spark_jobs.engine.spark_compute` does the routing):

* one of its records fails a check: the same casts and checks as the exact
  read (`spark_jobs.engine.parse`), over the same parser's text of each field;
* one of its lines (split at LF, as the exact read splits them) might be
  read differently by the two, found by a scan of the raw lines in the same
  Spark job:

  - longer than ``source.max_line_bytes``, or not valid UTF-8 (the exact
    read refuses such lines unparsed; Jackson reads some of them, e.g. an
    overlong encoding);
  - beginning with a byte-order mark (Jackson skips one at the start of
    every line, the exact read only at the start of the file);
  - JSON: NULs in its first bytes (Jackson's byte reader then guesses
    UTF-16 or UTF-32, and may read a line the exact read finds malformed);
  - JSON: a top-level array (Spark's reader makes one record of each
    element, or none of ``[]``; the exact read finds it malformed);
  - CSV: a CR anywhere but before the LF (Spark's CSV reader ends a line
    there; the exact read does not), or only control characters (Spark's
    reader drops the line as empty; the exact read finds a malformed record);
* CSV, checked on the driver, which plans these local files: its header does
  not name the schema's columns (which line is first, Spark's reader does
  not say), or it ends with a CR after its last LF.

A file that is not suspect reads the same both ways: its lines split the same
way, each field's text comes from the same Jackson or univocity converter
(`from_json`/`from_csv` call the parser the readers use), and the same casts
and checks then apply, so every one of its records is valid by both. Each
file is read by exactly one path, so no record is counted twice or lost
whichever path judged it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.sql_text import spark_identifier
from spark_jobs.engine.parse import CORRUPT, FILE, failing, reader_options, text_schema, typed_fields

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["IS_RECORD", "SUSPECT", "records", "suspect_on_driver"]

#: True for a record of the batch (false for the scan's line rows).
IS_RECORD = "__is_record"
#: True for a row that makes its file suspect.
SUSPECT = "__suspect"

#: Whitespace as Java's regular expressions (and so the exact read) know it.
_JAVA_SPACE = " \t\n\x0b\f\r"


def records(spark: SparkSession, spec: PipelineSpec, paths: list[str], *, scan_lines: bool = True) -> DataFrame:
    """The files' records as Spark's reader parses them, with the line scan's rows.

    Columns: ``__file``, the typed fields, `IS_RECORD` and `SUSPECT`.
    `scan_lines=False` leaves the scan out, for files already found clean.
    """
    columns = _columns(spark, spec)
    reader = spark.read.schema(text_schema(spec)).options(**reader_options(spec))
    if spec.source.format == "json":
        # Lines end at LF only, as in the exact read: a CR is whitespace to
        # JSON, so a CRLF line, or a CR inside a line, reads the same both ways.
        parsed = reader.option("lineSep", "\n").json(paths)
    else:
        # Not so in CSV, where a CR before LF would end up in the last value:
        # the reader ends lines at CR, LF or CRLF, and a CR anywhere but
        # before LF makes the file suspect (`_scan_columns`, `suspect_on_driver`).
        parsed = reader.option("header", str(spec.source.csv.header).lower()).csv(paths)
    rows = parsed.select(*columns.record)
    if not scan_lines:
        return rows
    return rows.unionByName(spark.read.option("lineSep", "\n").text(paths).select(*columns.line))


@dataclass(frozen=True)
class _Columns:
    """The select lists of a native read: a record's, and a scanned line's."""

    record: list[Column]
    line: list[Column]


#: Built once per session and spec: each list is some hundred calls into the
#: JVM (a tenth of a second a batch), and columns are plans' parts, not data.
_BUILT: WeakKeyDictionary[SparkSession, dict[str, _Columns]] = WeakKeyDictionary()


def _columns(spark: SparkSession, spec: PipelineSpec) -> _Columns:
    key = spec.source.model_dump_json() + "|" + ",".join(spec.state.keys)
    built = _BUILT.setdefault(spark, {})
    if key not in built:
        built[key] = _Columns(_record_columns(spec), _scan_columns(spec))
    return built[key]


def _record_columns(spec: PipelineSpec) -> list[Column]:
    from pyspark.sql import functions as F

    text = {f.name: F.col(spark_identifier(f.name)) for f in spec.source.fields}
    typed, checks = typed_fields(spec, text, F.col(CORRUPT).isNotNull())
    # Whether a record fails, not why: a failed record's file is read again
    # the exact way, which gives the reason.
    return [F.col("_metadata.file_path").alias(FILE), *typed, F.lit(True).alias(IS_RECORD), failing(checks).alias(SUSPECT)]


def _scan_columns(spec: PipelineSpec) -> list[Column]:
    """A raw line (split at LF, as the exact read splits), `SUSPECT` if the two
    reads might disagree on it. Only the UTF-8 check reads a whole line; the
    others look at its length and its ends."""
    from pyspark.sql import functions as F

    value = F.col("value")
    ends_cr = value.endswith("\r")
    odd: list[Column] = [
        # The exact read's line has no CR before the LF.
        (F.octet_length(value) - ends_cr.cast("int")) > F.lit(spec.source.max_line_bytes),
        ~F.expr("is_valid_utf8(value)"),
        value.startswith("\ufeff"),
    ]
    if spec.source.format == "json":
        # NULs at the start: what Jackson's byte reader takes for UTF-16 or UTF-32.
        odd.append(F.instr(F.substring(value, 1, 4), "\x00") > 0)
        odd.append(F.ltrim(value, F.lit(" \t\r")).startswith("["))
    else:
        first_cr = F.instr(value, "\r")
        odd.append((first_cr > 0) & (first_cr < F.length(value)))
        controls = "".join(chr(c) for c in range(0x21))
        odd.append((F.length(F.btrim(value, F.lit(controls))) == 0) & value.rlike("\\S"))
    return [
        F.col("_metadata.file_path").alias(FILE),
        *[F.lit(None).cast(f.type).alias(f.name) for f in spec.source.fields],
        F.lit(False).alias(IS_RECORD),
        reduce(lambda a, b: a | b, odd).alias(SUSPECT),
    ]


def suspect_on_driver(spec: PipelineSpec, path: str) -> bool:
    """What the line scan cannot tell of a local CSV file: whether its header
    fits (which line is first, Spark's reader does not say) and whether it
    ends with a CR after its last LF (the exact read keeps that CR in the
    last value, Spark's reader does not; within the file, the scan sees a
    line ending in CR either way)."""
    if spec.source.format != "csv":
        return False
    with open(path, "rb") as handle:
        if handle.seek(0, 2) and (handle.seek(-1, 2), handle.read(1))[1] == b"\r":
            return True
    return spec.source.csv.header and not _header_fits(spec, path)


def _header_fits(spec: PipelineSpec, path: str) -> bool:
    """Whether a CSV file's header names the schema's columns, by the exact read's rule.

    The header is the first line with a character that is not whitespace;
    a byte-order mark before it is dropped; names are compared one by one,
    spaces and one pair of quotes around each ignored.
    """
    expected = [f.name for f in spec.source.fields]
    line = _first_line(path, spec.source.max_line_bytes)
    if line is None:
        return True  # no lines, no records
    names = [re.sub(r'^"|"$', "", name.strip(" ")) for name in line.split(spec.source.csv.delimiter)]
    return ",".join(names) == ",".join(expected)


def _first_line(path: str, limit: int) -> str | None:
    """The first line of a file holding more than whitespace, as the exact read finds it.

    None if there is none; "" (a header that cannot fit) if the lines before
    it or itself are longer than `limit` bytes: the file then goes the exact
    way, which decides.
    """
    with open(path, "rb") as handle:
        first = True
        while raw := handle.readline(limit + 3):
            content = raw.removesuffix(b"\n").removesuffix(b"\r")
            if len(content) > limit:
                return ""
            text = content.decode("utf-8", errors="replace")
            if first:
                text, first = text.removeprefix("\ufeff"), False
            if text.strip(_JAVA_SPACE):
                return text
    return None
