"""The only way spec-derived text enters SQL: validated, quoted identifiers.

Spec validation already restricts identifiers to
`spark_jobs.core.spec.IDENTIFIER`. The helpers here check again and quote
anyway, so that a future code path that skips validation (or a
widened pattern) still cannot turn a name into SQL: a value that fails the
check raises instead of being spliced in.
"""

from __future__ import annotations

from spark_jobs.core.spec import IDENTIFIER

__all__ = ["datafusion_identifier", "spark_identifier"]


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
