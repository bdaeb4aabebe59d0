"""The plugin's modules import one another without a circle (issue 65:
console -> console.app -> dag_factory -> operators -> links -> console)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "plugins" / "microbatch_airflow"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports, anywhere in it (a function's
    import counts: it runs when called) but under `if TYPE_CHECKING:`, a
    package's import counted as its `__init__`'s."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for block in ast.walk(tree):
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING":
            block.body = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in modules}
    return found


def test_the_plugin_has_no_import_circle():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(path) for path in paths}
    graph = {_module(path): _imports(path, modules) for path in paths}
    circles: list[list[str]] = []

    def walk(module: str, trail: list[str]) -> None:
        for target in sorted(graph[module] - {module}):
            if target in trail:
                circles.append(trail[trail.index(target):] + [target])
            elif len(trail) < len(graph):
                walk(target, trail + [target])

    for start in sorted(graph):
        walk(start, [start])
    assert not circles, f"import circles: {circles[:3]}"
