"""Shared helpers of the prefix-reuse tests: small managers, a prefill-like KV writer and reader, and
an exact reference count check."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache import CacheConfig, KVCache, KVCacheManager

TPB = 4
PATTERN_MOD = 2039  # < 2048, so every value is exact in float16


def make_manager(num_blocks: int = 32, *, windows: list[int | None] | None = None, sink_tokens: int = 0,
                 num_layers: int = 2, **kw: Any) -> KVCacheManager:
    """A small CPU manager: ``num_layers`` layers of 2 KV heads x 8 dims, float16, TPB tokens per block."""
    cfg = CacheConfig.for_model(num_layers, 2, 8, TPB, "float16", num_blocks, windows=windows,
                                sink_tokens=sink_tokens, **kw)
    return KVCacheManager(cfg)


def prefix_values(tokens: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """A value per position that depends on every token up to it (a polynomial prefix hash)."""
    out = np.empty(len(np.asarray(tokens)), dtype=np.int64)
    acc = 1
    for i, t in enumerate(np.asarray(tokens).tolist()):
        acc = (acc * 31 + int(t) + 7) % PATTERN_MOD
        out[i] = acc
    return out


def _expected(mgr: KVCacheManager, layer: int, role_index: int, values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The pattern of one layer/role for positions with prefix values ``values``: [n, heads, dim]."""
    view = mgr.buffer_view(layer, "key")
    heads, dim = view.shape[1], view.shape[3]
    h = np.arange(heads)[None, :, None]
    d = np.arange(dim)[None, None, :]
    return (values[:, None, None] + 13 * layer + 5 * role_index + 17 * h + d) % PATTERN_MOD


def write_kv(mgr: KVCacheManager, kv: KVCache, tokens: npt.ArrayLike, start: int, stop: int) -> None:
    """Write the KV pattern of positions [start, stop) of ``tokens`` into ``kv``'s pages, as a
    prefill step would (positions whose page is -1 are skipped)."""
    _apply(mgr, kv, tokens, start, stop, write=True)


def check_kv(mgr: KVCacheManager, kv: KVCache, tokens: npt.ArrayLike, start: int, stop: int) -> int:
    """Assert ``kv``'s pages hold the pattern of positions [start, stop); returns positions checked."""
    return _apply(mgr, kv, tokens, start, stop, write=False)


def _apply(mgr: KVCacheManager, kv: KVCache, tokens: npt.ArrayLike, start: int, stop: int, *, write: bool) -> int:
    values = prefix_values(tokens)[start:stop]
    pos = np.arange(start, stop)
    checked = 0
    layout = mgr.layout
    for lg in layout.layer_groups:
        blocks = kv.block_ids(lg.layer_group_id)
        slots = blocks[pos // TPB]
        keep = slots >= 0
        if not keep.any():
            continue
        s = torch.from_numpy(slots[keep].astype(np.int64))
        off = torch.from_numpy((pos[keep] % TPB).astype(np.int64))
        vals = values[keep]
        for layer in lg.layer_ids:
            for ri, role in enumerate(("key", "value")):
                view = mgr.buffer_view(layer, role)
                exp = _expected(mgr, layer, ri, vals)
                if write:
                    view[s, :, off, :] = torch.from_numpy(exp.astype(np.float32)).to(view.dtype)
                else:
                    got = view[s, :, off, :].to(torch.float32).numpy().astype(np.int64)
                    np.testing.assert_array_equal(got, exp, err_msg=f"layer {layer} {role} positions {pos[keep]}")
        checked += int(keep.sum())
    return checked


def check_references(mgr: KVCacheManager) -> None:
    """Every slot's reference count equals the references open caches and tree blocks hold."""
    layout = mgr.layout
    expected = [np.zeros(pg.num_slots, dtype=np.int64) for pg in layout.pool_groups]
    for kv in mgr.open_caches:
        for lg, ids in kv.block_id_map().items():
            np.add.at(expected[layout.layer_groups[lg].pool_group_index], ids[ids >= 0], 1)
    for node in mgr.prefix_tree.nodes():
        for lg, page in enumerate(node.pages.tolist()):
            if page >= 0:
                expected[layout.layer_groups[lg].pool_group_index][page] += 1
    for pg in range(len(layout.pool_groups)):
        np.testing.assert_array_equal(mgr.allocator(pg).refcount, expected[pg], err_msg=f"pool group {pg}")
        mgr.slot_accounting(pg)   # balances, or raises


def slot_bytes(mgr: KVCacheManager, pool_group: int, slot: int) -> list[bytes]:
    """The raw bytes of one slot in every pool of a pool group."""
    pg = mgr.layout.pool_groups[pool_group]
    return [bytes(mgr.pool_tensor(pool_group, p.pool_index).view(p.num_slots, p.slot_bytes)[slot].numpy())
            for p in pg.pools]


def prefill(mgr: KVCacheManager, tokens: npt.ArrayLike, *, close: bool = True, extra_capacity: int = 0,
            **create_kw: Any) -> KVCache:
    """Run one request's prefill: create (matching the tree), resume, resize, write the KV of the
    tokens not reused, commit them; closed afterwards unless ``close=False``."""
    arr = np.asarray(tokens, dtype=np.int64)
    kv = mgr.create_kv_cache_for_prompt(arr, **create_kw)
    assert kv.resume()
    assert kv.resize(arr.size + extra_capacity)
    write_kv(mgr, kv, arr, kv.num_committed_tokens, arr.size)
    kv.commit(arr[kv.num_committed_tokens:])
    if close:
        kv.close()
    return kv
