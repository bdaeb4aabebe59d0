"""Where the pinned JAR sets live once fetched: a cache outside the repository.

Each set is listed by a POM under the repository's ``jars/<name>/pom.xml``
and fetched once, at set-up, by ``python jars/fetch.py <name>`` (Maven). Its
folder is ``~/.cache/microbatch/jars/<name>-<hash of the POM>``
(``MICROBATCH_JARS_CACHE`` moves the root), so a changed POM gets a new
folder instead of mixing two versions on one class path, and a ``.complete``
stamp, written last, tells a finished fetch from an interrupted one.

This module only *finds* folders; it never downloads, so run-time code
(`spark_jobs.engine.session`) can ask for the JARs without touching the
network. Standard library only: set-up imports it before the virtualenv has
anything else.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["CACHE_ENV", "POMS", "STAMP", "cache_dir", "cache_root", "complete_dir", "pom"]

#: The repository's folder of POMs (absent when the package is installed
#: without its repository: then no set is found, and nothing is fetched).
POMS = Path(__file__).resolve().parent.parent / "jars"
STAMP = ".complete"
CACHE_ENV = "MICROBATCH_JARS_CACHE"


def pom(name: str) -> Path:
    """The POM that lists the JARs of ``name`` (``jars/<name>/pom.xml``)."""
    path = POMS / name / "pom.xml"
    if not path.is_file():
        known = sorted(p.parent.name for p in POMS.glob("*/pom.xml"))
        raise ValueError(f"no JAR set named {name!r} (no {path}); known: {', '.join(known) or 'none'}")
    return path


def cache_root() -> Path:
    """Where fetched folders live; ``MICROBATCH_JARS_CACHE`` moves it (CI caches, read-only homes)."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "microbatch" / "jars"


def cache_dir(name: str) -> Path:
    """The folder for the current POM of ``name``: a changed POM gets a new folder, never a mixed one."""
    digest = hashlib.sha256(pom(name).read_bytes()).hexdigest()[:12]
    return cache_root() / f"{name}-{digest}"


def complete_dir(name: str) -> Path | None:
    """The folder if a fetch finished (its stamp exists), else None; never touches the network."""
    folder = cache_dir(name)
    return folder if (folder / STAMP).is_file() else None
