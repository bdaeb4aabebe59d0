"""Spark's own JSON and CSV readers for local files, and the files they might read differently.

The exact read (`spark_jobs.engine.exact_read`) numbers every line, which
quarantine needs, at a price: a file is one value before it is split, and
each line is then parsed from decoded text. Spark's JSON and CSV readers
parse straight from the file's bytes, several times faster, but they number
nothing. Line numbers matter only for records that fail, so a batch's local
files are read natively first, and a file goes the exact way only when it is
*suspect* (`spark_jobs.engine.spark_compute` does the routing):

* one of its records fails a check: the same casts and checks as the exact
  read (`spark_jobs.engine.parse`), over the same parser's text of each field;
  found by the native read itself;
* its bytes hold something the two reads might read differently, found by a
  scan of the file on the driver before the batch is read
  (`suspect_on_driver`). The rules are wider than the differences, so a file
  rarely goes the exact way for nothing, and never stays native wrongly:

  - a line (split at LF, as the exact read splits) longer than
    ``source.max_line_bytes``, or bytes that are not valid UTF-8 (the exact
    read refuses such lines unparsed; Jackson reads some of them, e.g. an
    overlong encoding);
  - a byte-order mark anywhere (Jackson skips one at the start of every
    line, the exact read only at the start of the file);
  - a control byte other than tab, LF, VT, FF and CR: a NUL in a JSON line's
    first bytes makes Jackson's byte reader guess UTF-16 or UTF-32, and a CSV
    line of control characters only is empty to Spark's reader but a
    malformed record to the exact read;
  - JSON: a line that is a top-level array (Spark's reader makes one record
    of each element, or none of ``[]``; the exact read finds it malformed);
  - CSV: a CR anywhere but before an LF (Spark's CSV reader ends a line
    there; the exact read does not), or a header that does not name the
    schema's columns (which line is first, Spark's reader does not say).

A file that is not suspect reads the same both ways: its lines split the same
way, each field's text comes from the same Jackson or univocity converter
(`from_json`/`from_csv` call the parser the readers use), and the same casts
and checks then apply, so every one of its records is valid by both. Each
file is read by exactly one path, so no record is counted twice or lost
whichever path judged it.

The scan used to be a second read of the lines in the batch's Spark job,
which cost a quarter of a warm batch and more while the JVM warmed up. On
the driver, with vectorised byte checks, it costs far less
(docs/benchmarks.md, "Figures behind the code's choices").
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.sql_text import spark_identifier
from spark_jobs.engine.parse import CORRUPT, FILE, failing, reader_options, text_schema, typed_fields
from spark_jobs.engine.session import built_once

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["SUSPECT", "records", "suspect_on_driver"]

#: True for a record that fails a check (its file is then read the exact way).
SUSPECT = "__suspect"

#: Whitespace as Java's regular expressions (and so the exact read) know it.
_JAVA_SPACE = " \t\n\x0b\f\r"
#: How much of a file the driver's scan holds at once.
_CHUNK_BYTES = 16 * 1024 * 1024
_BOM = "\ufeff".encode()
#: A line that is a top-level JSON array, in text that starts at a line's start.
_ARRAY_FIRST = re.compile(rb"[ \t\r]*\[")
_ARRAY_LATER = re.compile(rb"\n[ \t\r]*\[")
_LONE_CR = re.compile(rb"\r(?!\n)")


def records(spark: SparkSession, spec: PipelineSpec, paths: list[str], *, one_task: bool = False) -> DataFrame:
    """The files' records as Spark's reader parses them, in one partition
    with `one_task` (else as Spark splits the files).

    Columns: ``__file``, the typed fields and `SUSPECT`.
    """
    reader = spark.read.schema(text_schema(spec)).options(**reader_options(spec))
    if spec.source.format == "json":
        # Lines end at LF only, as in the exact read: a CR is whitespace to
        # JSON, so a CRLF line, or a CR inside a line, reads the same both ways.
        parsed = reader.option("lineSep", "\n").json(paths)
    else:
        # Not so in CSV, where a CR before LF would end up in the last value:
        # the reader ends lines at CR, LF or CRLF, and a CR anywhere but
        # before LF makes the file suspect (`suspect_on_driver`).
        parsed = reader.option("header", str(spec.source.csv.header).lower()).csv(paths)
    rows = parsed.select(*_columns(spark, spec))
    # `coalesce` merges the files' splits into one task without a shuffle,
    # and says so in the plan: one partition, which any grouping accepts.
    return rows.coalesce(1) if one_task else rows


def _columns(spark: SparkSession, spec: PipelineSpec) -> list[Column]:
    """The record columns, built once per session and spec (`built_once`)."""
    key = ("native records", spec.source.model_dump_json(), *spec.state.keys)
    return built_once(spark, key, lambda: _record_columns(spec))


def _record_columns(spec: PipelineSpec) -> list[Column]:
    from pyspark.sql import functions as F

    text = {f.name: F.col(spark_identifier(f.name)) for f in spec.source.fields}
    typed, checks = typed_fields(spec, text, F.col(CORRUPT).isNotNull())
    # Whether a record fails, not why: a failed record's file is read again
    # the exact way, which gives the reason.
    return [F.col("_metadata.file_path").alias(FILE), *typed, failing(checks).alias(SUSPECT)]


def suspect_on_driver(spec: PipelineSpec, path: str) -> bool:
    """Whether the two reads might read the local file at `path` differently
    (the module's docstring lists what makes a file suspect).

    Read in chunks that end at an LF, so every chunk starts a line and no
    character is cut; a line without an LF longer than the limit is found
    as the rest of a chunk that grows past it.
    """
    if spec.source.format == "csv" and spec.source.csv.header and not _header_fits(spec, path):
        return True
    limit = spec.source.max_line_bytes
    with open(path, "rb") as handle:
        rest = b""
        while chunk := handle.read(_CHUNK_BYTES):
            text = rest + chunk
            end = text.rfind(b"\n") + 1
            text, rest = text[:end], text[end:]
            if len(rest) > limit or (text and _odd(spec, text, limit)):
                return True
        return bool(rest) and _odd(spec, rest, limit)


def _odd(spec: PipelineSpec, text: bytes, limit: int) -> bool:
    """Whether whole lines of a file (`text` starts a line) hold anything suspect."""
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return True
    if _BOM in text:
        return True
    octets = np.frombuffer(text, dtype=np.uint8)
    if ((octets < 0x09) | ((octets > 0x0D) & (octets < 0x20))).any():
        return True
    if len(text) > limit:
        # Line lengths from the LFs' positions; a CR before an LF counts,
        # which can only make a file suspect that the exact read would take.
        lengths = np.diff(np.flatnonzero(octets == 0x0A), prepend=-1, append=len(text)) - 1
        if int(lengths.max()) > limit:
            return True
    if spec.source.format == "json":
        return b"[" in text and bool(_ARRAY_FIRST.match(text) or _ARRAY_LATER.search(text))
    return b"\r" in text and bool(_LONE_CR.search(text))


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
