"""The cache manager is composed, not chained: it owns parts with public interfaces, and no module of
kvxfer.cache reaches into another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import kvxfer.cache
from kvxfer.cache import KVCache, KVCacheManager
from kvxfer.cache.cache_lifecycle import CacheLifecycle
from kvxfer.cache.manager import ManagerParts
from kvxfer.cache.manager_state import ManagerState

CACHE_DIR = Path(kvxfer.cache.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, assigned attributes and variables, slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if _private(n)}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = _own_private_names(tree)
    modules = {p.stem for p in CACHE_DIR.glob("*.py")}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvxfer"):
            for alias in node.names:
                is_module = node.module == "kvxfer.cache" and alias.name in modules
                if _private(alias.name) and not is_module:
                    out.append(f"{path.name}:{node.lineno}: imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_checker_sees_a_reach_into_another_module(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from kvxfer.cache.kv_cache import _hidden\n\n\nclass A:\n    def f(self, cache):\n"
                     "        self._mine = 1\n        return cache._blocks, self._mine\n")
    assert _violations(probe) == ["probe.py:1: imports kvxfer.cache.kv_cache._hidden", "probe.py:7: cache._blocks"]


def test_no_module_touches_another_modules_private_names() -> None:
    found = [v for path in sorted(CACHE_DIR.glob("*.py")) for v in _violations(path)]
    assert found == []


def test_manager_is_composed_of_parts() -> None:
    assert KVCacheManager.__mro__ == (KVCacheManager, object)
    for cls in (ManagerParts, CacheLifecycle, ManagerState):
        assert cls.__mro__ == (cls, object)
    mgr = KVCacheManager(kvxfer.cache.CacheConfig.for_model(1, 1, 8, 4, "float16", 8))
    parts = mgr._parts
    for name in ("streams", "movement", "eviction", "usage", "quotas", "reuse", "lifecycle"):
        part = getattr(parts, name)
        assert type(part).__mro__ == (type(part), object)
        assert part.state is mgr._state and part.parts is parts
    assert mgr.lifecycle is parts.lifecycle


def test_kv_cache_calls_only_the_life_cycle_interface() -> None:
    mgr = KVCacheManager(kvxfer.cache.CacheConfig.for_model(1, 1, 8, 4, "float16", 8))
    kv = mgr.create_kv_cache()
    assert isinstance(kv, KVCache) and kv.manager is mgr
    source = ast.parse((CACHE_DIR / "kv_cache.py").read_text())
    calls = {node.attr for node in ast.walk(source) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Attribute) and node.value.attr == "_ops"}
    assert calls and all(not _private(c) for c in calls)
    assert calls <= {n for n in dir(mgr.lifecycle) if not n.startswith("_")}
    kv.close()
