"""Fail when a function of the library is longer than its bound (60 lines).

ruff bounds a function's statements (PLR0915, `make lint`); this bounds its
lines, docstring and comments included, which is what a reader scrolls
through: a function that no longer fits a screen is two concepts. Run by
`make lint`: ``python -m dev.function_size [--max-lines N] PATH...``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

MAX_LINES = 60


def too_long(paths: list[str], max_lines: int) -> list[str]:
    """Each function in `paths` (files or folders) longer than `max_lines`, as `file:line name (n lines)`."""
    found = []
    for root in paths:
        files = [Path(root)] if root.endswith(".py") else sorted(Path(root).rglob("*.py"))
        for path in files:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > max_lines:
                        found.append(f"{path}:{node.lineno} {node.name} ({lines} lines > {max_lines})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    found = too_long(args.paths, args.max_lines)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} function(s) longer than {args.max_lines} lines: split them", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
