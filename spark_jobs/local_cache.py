"""The folder of the project's caches on this machine: JVM class archives
(`engine.jvm_cache`), idle hints (`engine.idle_hint`), parsed specs
(`plugins/microbatch_airflow/spec_cache.py`) and states' key directories
(`core.key_directory`). Everything in it is derived and built again when
deleted. (The JARs have their own: `spark_jobs.jar_cache`.)"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_home"]

#: Moves the folder (CI caches, read-only homes).
CACHE_ENV = "MICROBATCH_CACHE_DIR"


def cache_home() -> Path:
    """``$MICROBATCH_CACHE_DIR``, by default ``~/.cache/microbatch``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "microbatch")
