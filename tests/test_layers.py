"""The package's layering, read from the source with `ast`: every import (module level or inside a function)
runs from a layer to the same or a lower one, and no two modules import each other through any chain."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ascq"

# Lowest first. A module belongs to the longest prefix listed; it may import its own layer and those below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ascq.core",),  # imports nothing else of ascq
    ("ascq.envs", "ascq.paths", "ascq.atomic_file"),
    ("ascq.platforms",),
    ("ascq.formats",),
    ("ascq.kernels",),
    ("ascq.reference", "ascq.evaluate"),
    ("ascq.quantize",),
    ("ascq.zoo",),
    ("ascq.runtime.sampling",),
    ("ascq.runtime.sched",),
    ("ascq.runtime.distributed",),
    ("ascq.runtime.layers",),
    ("ascq.runtime.models",),
    ("ascq.runtime.worker",),
    ("ascq.runtime.executor",),
    ("ascq.runtime.spec_decode",),
    ("ascq.runtime.engine",),
    ("ascq.runtime.server",),
    ("ascq.runtime.bench",),
    ("ascq.runtime", "ascq.cli", "ascq.__main__", "ascq"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every `ascq` module `path` imports, relative imports resolved; `from pkg import name` counts as
    pkg.name when that is a module, else as pkg."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in ALL_MODULES else base)
    return {m for m in found if m == "ascq" or m.startswith("ascq.")}


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (annotations only, never imported at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


ALL_MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    best, level = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    assert level is not None, f"{module} is in no layer: add it to LAYERS"
    return level


GRAPH = {module_name(p): imported_modules(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer():
    for module in GRAPH:
        layer_of(module)


def test_no_import_runs_upwards():
    upward = sorted(f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps if layer_of(b) > layer_of(a))
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_core_imports_nothing_else_of_ascq():
    outside = sorted(
        f"{a} -> {b}" for a, deps in GRAPH.items() if layer_of(a) == 0 for b in deps if layer_of(b) != 0
    )
    assert not outside, "\n".join(outside)


def _cycle() -> list[str] | None:
    """One import cycle between modules (a package's __init__ importing its own submodules excluded), or
    None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(GRAPH.get(module, ())):
            if module.startswith(dep + "."):
                continue  # a module reaching its own package's __init__ is not a cycle of logic
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep in GRAPH and not state.get(dep):
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if not state.get(module):
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["ascq.core.qmath", "ascq.core.errors"])
def test_layer_table_places_core(module):
    assert layer_of(module) == 0
