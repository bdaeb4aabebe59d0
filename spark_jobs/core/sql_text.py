"""The only way text enters SQL: validated, quoted identifiers and quoted literals.

Spec validation already restricts identifiers to
`spark_jobs.core.spec.IDENTIFIER`. The helpers here check again and quote
anyway, so that a future code path that skips validation (or a
widened pattern) still cannot turn a name into SQL: a value that fails the
check raises instead of being spliced in.
"""

from __future__ import annotations

from spark_jobs.core.spec import IDENTIFIER, PIPELINE_NAME

__all__ = ["datafusion_identifier", "pipeline_literal", "spark_identifier", "string_literal"]


def _checked(name: str) -> str:
    if not IDENTIFIER.fullmatch(name):
        raise ValueError(f"{name!r} is not a plain identifier and cannot be used in SQL")
    return name


def spark_identifier(name: str) -> str:
    """A column name for Spark SQL: backtick-quoted (backticks doubled)."""
    return "`" + _checked(name).replace("`", "``") + "`"


def datafusion_identifier(name: str) -> str:
    """A column name for delta-rs (DataFusion) SQL: double-quoted (quotes doubled)."""
    return '"' + _checked(name).replace('"', '""') + '"'


def string_literal(value: str) -> str:
    """Any text as a delta-rs (DataFusion) SQL string literal: single-quoted,
    quotes doubled. (A plain literal gives backslashes no meaning; a NUL,
    which no file name holds, is refused.)"""
    if "\x00" in value:
        raise ValueError("a NUL character cannot be used in SQL text")
    return "'" + value.replace("'", "''") + "'"


def pipeline_literal(name: str) -> str:
    """A pipeline name as a SQL string literal, checked against the name rule first."""
    if not PIPELINE_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a pipeline name and cannot be used in SQL")
    return string_literal(name)
