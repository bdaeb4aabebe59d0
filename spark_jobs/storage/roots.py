"""Where a spec may read and write: an optional allow-list of storage roots.

A spec names three locations: `source.path`, `state.path` and `checkpoint`
(the ledger and quarantine live under it). A spec file is often written by
someone other than the operator running the job, so the operator can confine
those locations to a few roots: ``MICROBATCH_STORAGE_ROOTS`` (separated by
`os.pathsep`) or ``--storage-root`` on the CLI, each a local folder or an
``s3://bucket/prefix`` URI.

* With roots set, every location must resolve inside one of them. Local
  paths are resolved with ``..`` and symlinks followed (a link inside a root
  pointing out of it is outside); URIs are compared as normalised
  scheme/bucket/key segments, and ``..`` or ``.`` segments are refused
  outright because object stores do not resolve them, but tools that
  normalise URIs would.
* Without roots, a relative path may not climb out of the spec's folder
  with ``..`` (absolute paths stay allowed: the operator chose no roots).

Each check returns a problem message (or None); `spark_jobs.core.spec` turns them
into a `SpecError` naming the field and YAML line, before anything is read
or written.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["ENV", "Root", "check_location", "is_uri", "parse_roots", "roots_from_env", "split_uri"]

ENV = "MICROBATCH_STORAGE_ROOTS"


@dataclass(frozen=True)
class Root:
    """One allowed root: a resolved local folder, or a URI's scheme, bucket and key segments."""

    text: str
    local: Path | None = None
    scheme: str = ""
    bucket: str = ""
    segments: tuple[str, ...] = ()

    def contains(self, location: str) -> bool:
        if self.local is not None:
            if is_uri(location):
                return False
            return Path(location).is_relative_to(self.local)
        if not is_uri(location):
            return False
        scheme, bucket, segments = split_uri(location)
        return (scheme, bucket) == (self.scheme, self.bucket) and segments[: len(self.segments)] == self.segments


def is_uri(location: str) -> bool:
    return "://" in location


def split_uri(uri: str) -> tuple[str, str, tuple[str, ...]]:
    """``s3://bucket/a//b/`` -> ("s3", "bucket", ("a", "b")); refuses ``..`` and ``.`` segments."""
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    segments = tuple(s for s in key.split("/") if s)
    if not scheme or not bucket:
        raise ValueError(f"{uri!r} is not a storage URI; write scheme://bucket/prefix")
    if any(s in ("..", ".") for s in segments) or bucket in ("..", "."):
        raise ValueError(f"{uri!r} has a '..' or '.' segment; write the prefix without them")
    return scheme.lower(), bucket, segments


def parse_roots(texts: list[str]) -> list[Root]:
    """Roots from their text form. Raises ValueError for an unusable root."""
    roots = []
    for text in texts:
        text = text.strip()
        if not text:
            continue
        if is_uri(text):
            scheme, bucket, segments = split_uri(text)
            roots.append(Root(text, scheme=scheme, bucket=bucket, segments=segments))
        else:
            path = Path(text).expanduser()
            if not path.is_absolute():
                raise ValueError(f"storage root {text!r} must be an absolute folder or a URI such as s3://bucket/prefix")
            roots.append(Root(text, local=path.resolve()))
    return roots


def roots_from_env() -> list[str]:
    """The roots in ``MICROBATCH_STORAGE_ROOTS`` (empty when unset).

    Split on `os.pathsep`, except where it is the colon of ``scheme://``
    (on POSIX the separator is ':' too).
    """
    parts = re.split(re.escape(os.pathsep) + "(?!//)", os.environ.get(ENV, ""))
    return [p for p in parts if p.strip()]


def check_location(raw: str, resolved: str, roots: list[Root]) -> str | None:
    """What is wrong with a spec location (`raw` as written, `resolved` as the job uses it), or None."""
    if is_uri(raw):
        try:
            scheme, _, _ = split_uri(raw)
        except ValueError as exc:
            return str(exc)
        if scheme not in ("s3", "s3a"):
            return f"{raw!r}: {scheme}:// locations are not supported; use a local path or s3://bucket/prefix"
    elif not roots and not Path(raw).expanduser().is_absolute() and ".." in PurePosixPath(raw.replace("\\", "/")).parts:
        return (
            f"{raw!r} climbs out of the spec's folder with '..'; write a path inside it, an "
            f"absolute path, or allow the location with {ENV} / --storage-root"
        )
    if roots and not any(root.contains(resolved) for root in roots):
        allowed = ", ".join(r.text for r in roots)
        return (
            f"{raw!r} resolves to {resolved}, outside the allowed storage roots ({allowed}); "
            f"move it under one of them or ask the operator to add a root ({ENV} / --storage-root)"
        )
    return None
