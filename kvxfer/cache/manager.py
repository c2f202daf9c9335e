"""KVCacheManager: owns the pools and slot allocators, hands out KVCaches, publishes the layout."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.config import CacheConfig
from kvxfer.cache.descriptors import BufferId, CacheLayoutDesc, PoolGroupDesc
from kvxfer.cache.dtypes import torch_dtype
from kvxfer.cache.kv_cache import CacheState, KVCache, _as_tokens
from kvxfer.cache.layout import place_layout, plan_layout
from kvxfer.cache.memory import MemoryRegion, allocate_pool
from kvxfer.errors import CacheStateError, LayoutError, ManagerBusyError, OutOfSlotsError

IntArray = npt.NDArray[np.int32]


class KVCacheManager:
    """A paged KV-cache manager over real torch memory.

    Other stages see it only through ``layout`` (a CacheLayoutDesc), ``memory_regions()`` and the
    block ids of each KVCache.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        primary = config.primary
        plan = plan_layout(config)
        device = torch.device(primary.device)
        self.device = device
        self._pools: list[list[torch.Tensor]] = [
            [allocate_pool(pool.nbytes, primary.device) for pool in pg.pools] for pg in plan.pool_groups]
        kind = "cuda" if device.type == "cuda" else "cpu"
        bases = [[int(t.data_ptr()) for t in group] for group in self._pools]
        self._layout = place_layout(plan, bases, kind, int(device.index or 0))
        self._allocators = [SlotAllocator(pg.num_slots, f"pool group {pg.pool_group_index}")
                            for pg in self._layout.pool_groups]
        self._lg_pool_group = [lg.pool_group_index for lg in self._layout.layer_groups]
        self._caches: dict[str, KVCache] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._shut_down = False

    # --- published view ---------------------------------------------------------------------
    @property
    def layout(self) -> CacheLayoutDesc:
        """The published layout descriptor (addresses of the primary tier's pools)."""
        return self._layout

    @property
    def pool_group_descs(self) -> tuple[PoolGroupDesc, ...]:
        """The pool groups of the published layout."""
        return self._layout.pool_groups

    def memory_regions(self) -> list[MemoryRegion]:
        """One region per primary-tier pool, in (pool group, pool) order: what a transport registers."""
        return [MemoryRegion.of_tensor(t) for group in self._pools for t in group]

    def pool_tensor(self, pool_group: int, pool: int) -> torch.Tensor:
        """The raw byte tensor of one pool (for copy engines and tests)."""
        return self._pools[pool_group][pool]

    def buffer_view(self, layer_id: int, role: str = "key") -> torch.Tensor:
        """A typed, zero-copy view of one (layer, role) over all slots:
        ``[num_slots, heads, tokens_per_block, head_dim]`` (HND) or ``[num_slots, tokens, heads, dim]`` (NHD)."""
        bid = BufferId(layer_id, role)
        pg, pool, eb = self._layout.locate(bid)
        fmt = self._layout.format_of(bid)
        raw = self._pools[pg.pool_group_index][pool.pool_index]
        rows = raw.view(pool.num_slots, pool.slot_bytes)[:, eb.offset:eb.offset + eb.size]
        typed = rows.view(torch_dtype(fmt.dtype))
        if fmt.order == "HND":
            return typed.view(pool.num_slots, fmt.num_heads, fmt.tokens_per_block, fmt.head_dim)
        return typed.view(pool.num_slots, fmt.tokens_per_block, fmt.num_heads, fmt.head_dim)

    # --- slots --------------------------------------------------------------------------------
    def allocator(self, pool_group: int) -> SlotAllocator:
        """The slot allocator of a pool group (read-only use: counts and reference counts)."""
        return self._allocators[pool_group]

    def num_free_slots(self, pool_group: int = 0) -> int:
        """Free slots of a pool group."""
        return self._allocators[pool_group].num_free

    def _reserve(self, needs: dict[int, int]) -> None:
        """Make sure every pool group has the slots ``needs`` asks for, or raise OutOfSlotsError."""
        for pg, n in needs.items():
            if n > self._allocators[pg].num_free:
                self._make_room(pg, n - self._allocators[pg].num_free)
            if n > self._allocators[pg].num_free:
                raise OutOfSlotsError(f"pool group {pg}: {n} slots needed, {self._allocators[pg].num_free} free "
                                      f"of {self._allocators[pg].num_slots}")

    def _make_room(self, pool_group: int, n: int) -> None:
        """Free ``n`` slots of ``pool_group`` by eviction, as far as possible (no eviction yet)."""

    def _release(self, layer_group: int, ids: IntArray) -> None:
        ids = ids[ids >= 0]
        if ids.size:
            self._allocators[self._lg_pool_group[layer_group]].decref(ids)

    # --- KVCache lifecycle (called by KVCache) ------------------------------------------------
    def create_kv_cache(self, tokens: Sequence[int] | npt.ArrayLike | None = None, id: str | None = None) -> KVCache:
        """A new, suspended KVCache; call ``resume()`` before ``resize``."""
        with self._lock:
            if self._shut_down:
                raise ManagerBusyError("create_kv_cache: the manager has been shut down")
            cache_id = id if id is not None else f"kv-{next(self._ids)}"
            if cache_id in self._caches:
                raise CacheStateError(f"create_kv_cache: a cache with id {cache_id!r} is already open")
            arr = None if tokens is None else _as_tokens(tokens, f"create_kv_cache({cache_id})")
            cache = KVCache(self, cache_id, arr)
            self._caches[cache_id] = cache
            return cache

    @property
    def open_caches(self) -> list[KVCache]:
        """Caches created and not yet closed."""
        return list(self._caches.values())

    def _resume(self, cache: KVCache) -> bool:
        return True

    def _suspend(self, cache: KVCache) -> None:
        return None

    def _resize(self, cache: KVCache, capacity: int) -> None:
        with self._lock:
            tpb = self._layout.tokens_per_block
            new_n = math.ceil(capacity / tpb)
            old_n = cache.num_blocks
            if new_n > old_n:
                needs: dict[int, int] = {}
                for g in range(len(cache._blocks)):
                    pg = self._lg_pool_group[g]
                    needs[pg] = needs.get(pg, 0) + (new_n - old_n)
                self._reserve(needs)
                for g in range(len(cache._blocks)):
                    fresh = self._allocators[self._lg_pool_group[g]].alloc(new_n - old_n)
                    cache._blocks[g] = np.concatenate([cache._blocks[g], fresh])
            elif new_n < old_n:
                for g in range(len(cache._blocks)):
                    self._release(g, cache._blocks[g][new_n:])
                    cache._blocks[g] = cache._blocks[g][:new_n].copy()

    def _on_commit(self, cache: KVCache) -> None:
        return None

    def _release_out_of_window(self, cache: KVCache) -> None:
        """Free sliding-window pages no future token can attend to (their ids become -1)."""
        tpb = self._layout.tokens_per_block
        for lg in self._layout.layer_groups:
            if lg.window is None:
                continue
            first_needed = max(0, cache.history_length - lg.window + 1) // tpb
            sink_blocks = math.ceil(lg.sink_tokens / tpb)
            if first_needed <= sink_blocks:
                continue
            blocks = cache._blocks[lg.layer_group_id]
            stale = blocks[sink_blocks:first_needed]
            if (stale >= 0).any():
                with self._lock:
                    self._release(lg.layer_group_id, stale.copy())
                    blocks[sink_blocks:first_needed] = -1

    def _close(self, cache: KVCache) -> None:
        with self._lock:
            for g, blocks in enumerate(cache._blocks):
                self._release(g, blocks)
            self._caches.pop(cache.id, None)

    # --- manager lifecycle --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release all memory; refuses while caches are open."""
        with self._lock:
            open_ids = [c.id for c in self._caches.values() if c.state is not CacheState.CLOSED]
            if open_ids:
                raise ManagerBusyError(f"shutdown: {len(open_ids)} KV caches still open: {open_ids[:5]}")
            self._shut_down = True
            self._pools = [[] for _ in self._pools]

    def __repr__(self) -> str:
        pgs = ", ".join(f"pg{i}: {a.num_used}/{a.num_slots} used" for i, a in enumerate(self._allocators))
        return f"KVCacheManager(device={self.device}, {pgs})"


def check_layer_group(layout: CacheLayoutDesc, layer_group: int) -> None:
    """Raise LayoutError when ``layer_group`` is not a layer group of ``layout``."""
    if not 0 <= layer_group < len(layout.layer_groups):
        raise LayoutError(f"no layer group {layer_group} (have 0..{len(layout.layer_groups) - 1})")
