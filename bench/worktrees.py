"""The code of another commit, checked out beside this tree for a benchmark's anchor."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def checked_out(commit: str, at: Path) -> Iterator[Path]:
    """`commit` as a detached git worktree at `at`, removed on the way out."""
    subprocess.run(["git", "worktree", "add", "--detach", str(at), commit], cwd=ROOT, check=True, capture_output=True)
    try:
        yield at
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(at)], cwd=ROOT, check=False)
