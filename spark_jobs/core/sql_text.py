"""The only ways spec-derived text enters SQL: validated, quoted identifiers
and escaped string literals.

Spec validation already restricts identifiers to `spark_jobs.core.spec.IDENTIFIER`
and pipeline names to `PIPELINE_NAME`. The helpers here check again and
quote anyway, so that a future code path that skips validation (or a
widened pattern) still cannot turn a name into SQL: a value that fails the
check raises instead of being spliced in.
"""

from __future__ import annotations

from spark_jobs.core.spec import IDENTIFIER, PIPELINE_NAME


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


def pipeline_literal(name: str) -> str:
    """A pipeline name as a SQL string literal (single quotes doubled)."""
    if not PIPELINE_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a valid pipeline name and cannot be used in SQL")
    return "'" + name.replace("'", "''") + "'"
