"""Module structure: the page tables import no cache (MemoryRegion is a leaf), and the cache modules
form no import circle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import kvxfer

PACKAGE = Path(kvxfer.__file__).parent


def modules_after_import(module: str) -> list[str]:
    """kvxfer modules (and torch) in sys.modules after importing ``module`` in a fresh interpreter."""
    code = (f"import sys, json, {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvxfer') or m == 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def test_pagetable_imports_neither_the_cache_nor_torch() -> None:
    loaded = modules_after_import("kvxfer.pagetable")
    assert "kvxfer.memory_region" in loaded
    assert not [m for m in loaded if m.startswith("kvxfer.cache")], loaded
    assert "torch" not in loaded


def internal_imports(path: Path) -> set[str]:
    """kvxfer.cache modules ``path`` imports, at run time or under TYPE_CHECKING alike."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvxfer.cache"):
            if node.module == "kvxfer.cache":
                found.update(f"kvxfer.cache.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvxfer.cache."))
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep):], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (cycle := visit(mod)) is not None:
            return cycle
    return None


def test_cache_modules_form_no_import_circle() -> None:
    graph = {f"kvxfer.cache.{p.stem}": internal_imports(p) for p in (PACKAGE / "cache").glob("*.py")
             if p.stem != "__init__"}
    assert find_cycle(graph) is None, find_cycle(graph)
    # the cycle finder itself finds the circle this module once had
    assert find_cycle({"m": {"k"}, "k": {"t"}, "t": {"m"}}) == ["k", "t", "m", "k"]
