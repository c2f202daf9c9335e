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


#: The decode worker's concerns, lowest first: each module imports (at run time) none above it; the worker
#: (last) builds one part of each and hands it only the parts below it.
DECODE_LAYERS = ["kvxfer.disagg.worker", "kvxfer.disagg.decode_jobs", "kvxfer.disagg.decode_peers",
                 "kvxfer.disagg.decode_requests", "kvxfer.disagg.decode_receive", "kvxfer.disagg.worker_decode"]


def runtime_imports(path: Path, prefix: str) -> set[str]:
    """Modules under ``prefix`` that ``path`` imports at run time (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(prefix))
    return found


def test_the_decode_worker_concerns_are_layered() -> None:
    """Peers know no request lifecycle, the lifecycle no receive path, and none of them the worker that
    composes them (each may import only the layers below it)."""
    for i, module in enumerate(DECODE_LAYERS):
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        above = set(DECODE_LAYERS[i + 1:])
        assert not runtime_imports(path, "kvxfer.disagg") & above, (module, runtime_imports(path, "kvxfer") & above)
    # the check sees a run-time import and skips a typing-only one
    sample = PACKAGE.parent / "kvxfer" / "disagg" / "decode_jobs.py"
    assert "kvxfer.disagg.worker" in runtime_imports(sample, "kvxfer.disagg")
    assert "kvxfer.disagg.decode_peers" not in runtime_imports(sample, "kvxfer.disagg")


def test_the_decode_worker_owns_its_concerns_as_parts() -> None:
    """The decode worker inherits only the shared worker base; each concern is a class of its own, no base
    of another, built from what it needs and never handed the worker."""
    import abc
    import inspect

    from kvxfer.disagg.decode_jobs import JobTable
    from kvxfer.disagg.decode_peers import PrefillPeers
    from kvxfer.disagg.decode_receive import DecodeReceive
    from kvxfer.disagg.decode_requests import DecodeRequests
    from kvxfer.disagg.worker import WorkerBase
    from kvxfer.disagg.worker_decode import DecodeWorker
    assert DecodeWorker.__mro__ == (DecodeWorker, WorkerBase, abc.ABC, object)
    for part in (JobTable, PrefillPeers, DecodeRequests, DecodeReceive):
        assert part.__mro__ == (part, object), part
        for param in inspect.signature(part).parameters.values():
            assert "DecodeWorker" not in str(param.annotation) and "WorkerBase" not in str(param.annotation), \
                (part.__name__, param)
    # the worker builds one of each (the attributes callers and tests reach them by)
    source = inspect.getsource(DecodeWorker.__init__)
    for attr, part in (("jobs", JobTable), ("peers", PrefillPeers), ("requests", DecodeRequests),
                       ("receive", DecodeReceive)):
        assert f"self.{attr} = {part.__name__}(" in source, attr


def test_the_worker_modules_keep_their_public_names() -> None:
    """What callers import from ``worker_decode`` stays importable there after the split."""
    from kvxfer.disagg import worker_decode
    for name in ("DecodeWorker", "GenerationResult", "JobState", "JOB_TRANSITIONS", "check_move",
                 "one_host_landing_s", "RECONNECT_ATTEMPT_S", "RECONNECT_PAUSE_S"):
        assert hasattr(worker_decode, name), name
