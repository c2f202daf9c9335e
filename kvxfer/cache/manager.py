"""KVCacheManager: owns the pools and slot allocators, hands out KVCaches, publishes the layout."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.config import CacheConfig, DiskTier, HostTier, PrimaryTier
from kvxfer.cache.copy_engine import CopyEngine, CopyHandle
from kvxfer.cache.descriptors import AggregatedPageDesc, BufferId, CacheLayoutDesc, PoolGroupDesc
from kvxfer.cache.dtypes import torch_dtype
from kvxfer.cache.events import (
    AllCleared,
    Created,
    EventQueue,
    KVEvent,
    Removed,
    Stored,
    Updated,
    layer_group_subset,
    stored_extra_keys,
)
from kvxfer.cache.hashing import DEFAULT_SCOPE, ExtraKeys, ReuseScope, block_keys, check_extra_keys
from kvxfer.cache.kv_cache import CacheState, KVCache, _as_tokens
from kvxfer.cache.layout import place_layout, plan_layout
from kvxfer.cache.memory import MemoryRegion, allocate_pool
from kvxfer.cache.radix_tree import DEFAULT_PRIORITY, BlockNode, PrefixTree
from kvxfer.cache.stats import (
    IterationStats,
    PoolGroupPeaks,
    SlotAccounting,
    StatsCollector,
    TierTraffic,
    TierTrafficCounter,
)
from kvxfer.cache.tiers import (
    DiskTierStorage,
    MemoryTierStorage,
    TierStats,
    TierStorage,
    open_host_tier,
    primary_tier_of,
)
from kvxfer.errors import (
    CacheStateError,
    ConfigError,
    KVCacheError,
    KvxferError,
    LayoutError,
    ManagerBusyError,
    OutOfSlotsError,
    TierError,
)

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]
TokenArray = npt.NDArray[np.int64]

#: Medium names of the colder tiers in events (the primary tier is "GPU" or "CPU").
HOST_MEDIUM = "CPU"
DISK_MEDIUM = "DISK"
# Victim ordering key: held pages (a suspended request's) after droppable ones, then priority, then LRU.
_HELD_BIT = 60
_PRIORITY_SHIFT = 48
_LAST = (1 << _HELD_BIT) - 1


@dataclass(frozen=True)
class _ReusePlan:
    """What a new request takes from the prefix tree: ``pages[b, layer_group]`` for its first
    ``len(pages)`` blocks (-1 where not needed), the first ``len(nodes)`` of them full blocks."""

    num_tokens: int
    nodes: tuple[BlockNode, ...]
    partial: BlockNode | None
    pages: IntArray
    tiers: TierArray


class KVCacheManager:
    """A paged KV-cache manager over real torch memory, with optional colder tiers (host, disk).

    Other stages see it only through ``layout`` (a CacheLayoutDesc), ``memory_regions()`` and the
    block ids of each KVCache. A page is locked while an ACTIVE request holds it (it stays in the
    primary tier), held while only suspended requests (and maybe the prefix tree) hold it (it may be
    offloaded, never dropped), droppable when only the prefix tree holds it.
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
        self._tree = PrefixTree(len(self._layout.layer_groups), self._layout.tokens_per_block)
        self._in_tree = [np.zeros(pg.num_slots, dtype=bool) for pg in self._layout.pool_groups]
        self._events = EventQueue(config.event_queue_capacity)
        self._stats = StatsCollector(config.enable_stats, len(self._layout.pool_groups))
        self._medium = "GPU" if device.type == "cuda" else "CPU"
        self._has_windows = any(lg.window is not None for lg in self._layout.layer_groups)
        self._caches: dict[str, KVCache] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._shut_down = False
        self._pg_layer_groups = [[lg.layer_group_id for lg in self._layout.layer_groups
                                  if lg.pool_group_index == pg.pool_group_index] for pg in self._layout.pool_groups]
        self._pinned: set[str] = set()   # caches being resumed: their pages are not victims
        self._tiers: list[TierStorage] = [primary_tier_of(self)]
        self._media = [self._medium]
        self._copy: CopyEngine | None = None
        try:
            for tier in config.tiers[1:]:
                if isinstance(tier, HostTier):
                    self._tiers.append(open_host_tier(config, tier))
                    self._media.append(HOST_MEDIUM)
                elif isinstance(tier, DiskTier):
                    self._tiers.append(DiskTierStorage(config, tier))
                    self._media.append(DISK_MEDIUM)
            if len(self._tiers) > 1:
                self._copy = CopyEngine()
        except BaseException:
            for opened in self._tiers[1:]:
                opened.close()
            raise
        # Per tier and pool group: which slots are tree pages, and the (node, layer group) owning each.
        self._in_tree_t = [self._in_tree] + [
            [np.zeros(pg.num_slots, dtype=bool) for pg in t.layout.pool_groups] for t in self._tiers[1:]]
        self._tree_owner: list[list[dict[int, tuple[BlockNode, int]]]] = [
            [{} for _ in self._layout.pool_groups] for _ in self._tiers]
        self._traffic = TierTrafficCounter(len(self._tiers))
        self._put_created()
        self._page_bytes = [sum(p.slot_bytes for p in pg.pools) for pg in self._layout.pool_groups]

    # --- published view ---------------------------------------------------------------------
    @property
    def layout(self) -> CacheLayoutDesc:
        """The published layout descriptor (addresses of the primary tier's pools)."""
        return self._layout

    @property
    def pool_group_descs(self) -> tuple[PoolGroupDesc, ...]:
        """The pool groups of the published layout."""
        return self._layout.pool_groups

    def get_aggregated_pages(self, buffers: Iterable[BufferId]) -> tuple[AggregatedPageDesc, ...]:
        """The reference design's aggregated pages of ``buffers`` (see ``CacheLayoutDesc.aggregated_pages``)."""
        return self._layout.aggregated_pages(buffers)

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
    def allocator(self, pool_group: int, tier: int = 0) -> SlotAllocator:
        """The slot allocator of a pool group in a tier (0 = primary; read-only use: counts and
        reference counts)."""
        if tier:
            self._check_tier_index(tier)
            return self._alloc_of(tier, pool_group)
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

    def _make_room(self, pool_group: int, n: int) -> int:
        """Free ``n`` primary slots of ``pool_group`` (offloading or dropping pages), as far as
        possible; returns the slots freed."""
        return self._make_room_in(0, pool_group, n)

    def _tree_only(self, node: BlockNode) -> bool:
        """Whether every page of ``node`` is referenced by the tree alone."""
        for lg, (page, tier) in enumerate(zip(node.pages.tolist(), node.tiers.tolist(), strict=True)):
            if page >= 0 and self._alloc_of(tier, self._lg_pool_group[lg]).refcount[page] != 1:
                return False
        return True

    def _evict(self, node: BlockNode) -> None:
        """Drop a tree-only leaf and its pages (in whatever tiers they are); emits Removed."""
        self._tree.remove(node)
        media = [self._media[int(t)] if p >= 0 else None for p, t in zip(node.pages.tolist(), node.tiers.tolist(),
                                                                         strict=True)]
        for lg, (page, tier) in enumerate(zip(node.pages.tolist(), node.tiers.tolist(), strict=True)):
            if page >= 0:
                pg = self._lg_pool_group[lg]
                self._alloc_of(tier, pg).decref(np.array([page], dtype=np.int32))
                self._unmark_tree_page(tier, pg, page)
        for medium in dict.fromkeys(m for m in media if m is not None):   # one Removed per medium held
            self._events.put(Removed((node.key,), medium, layer_group_subset([m == medium for m in media])))
        self._traffic.dropped()

    def _release(self, layer_group: int, ids: IntArray, tiers: TierArray) -> None:
        """Drop one reference on each page ``ids[i]`` (>= 0) of tier ``tiers[i]``."""
        pg = self._lg_pool_group[layer_group]
        live = ids >= 0
        for tier in np.unique(tiers[live]).tolist():
            self._alloc_of(tier, pg).decref(ids[live & (tiers == tier)])

    # --- tiers: placement, eviction across tiers, onboarding ---------------------------------------
    def _alloc_of(self, tier: int, pool_group: int) -> SlotAllocator:
        return self._tiers[tier].allocator(pool_group)

    def _node_medium(self, node: BlockNode) -> str:
        """The medium of the coldest tier holding one of ``node``'s pages (the primary's when none)."""
        held = node.tiers[node.pages >= 0]
        return self._media[int(held.max()) if held.size else 0]

    def _unmark_tree_page(self, tier: int, pool_group: int, page: int) -> None:
        self._in_tree_t[tier][pool_group][page] = False
        self._tree_owner[tier][pool_group].pop(page, None)

    def _locked_mask(self, tier: int, pool_group: int) -> npt.NDArray[np.bool_]:
        """Slots of ``tier`` that must not move: pages of ACTIVE requests, and the primary pages of a
        request being resumed (its colder pages may still move down to let a swap through)."""
        mask = np.zeros(self._alloc_of(tier, pool_group).num_slots, dtype=bool)
        for cache in self._caches.values():
            if cache.state is CacheState.ACTIVE or (tier == 0 and cache.id in self._pinned):
                for lg in self._pg_layer_groups[pool_group]:
                    blocks, tiers = cache._blocks[lg], cache._tiers[lg]
                    mask[blocks[(blocks >= 0) & (tiers == tier)]] = True
        return mask

    def _victims(self, tier: int, pool_group: int) -> IntArray:
        """Movable slots of ``(tier, pool_group)`` in eviction order: droppable (tree-only) pages before
        held ones, then lowest priority, then least recently used."""
        alloc = self._alloc_of(tier, pool_group)
        movable = (alloc.refcount > 0) & ~self._locked_mask(tier, pool_group)
        if not movable.any():
            return np.empty(0, dtype=np.int32)
        recency = np.zeros(alloc.num_slots, dtype=np.int64)
        held_stamp = np.int64(DEFAULT_PRIORITY) << _PRIORITY_SHIFT
        for cache in self._caches.values():
            if cache.state is CacheState.ACTIVE:
                continue
            # A request being resumed moves last: its pages are about to come up.
            stamp = _LAST if cache.id in self._pinned else held_stamp | cache._last_used
            for lg in self._pg_layer_groups[pool_group]:
                blocks, tiers = cache._blocks[lg], cache._tiers[lg]
                np.maximum.at(recency, blocks[(blocks >= 0) & (tiers == tier)], stamp)
        for slot, (node, _) in self._tree_owner[tier][pool_group].items():
            recency[slot] = max(int(recency[slot]), (node.priority << _PRIORITY_SHIFT) | node.last_used)
        held = alloc.refcount > self._in_tree_t[tier][pool_group]
        key = (held.astype(np.int64) << _HELD_BIT) | recency
        idx = np.flatnonzero(movable)
        return idx[np.argsort(key[idx], kind="stable")].astype(np.int32)

    def _make_room_in(self, tier: int, pool_group: int, n: int) -> int:
        """Free up to ``n`` slots of ``(tier, pool_group)``; returns the slots freed.

        A warm tier offloads its coldest movable pages one tier down (making room there first,
        recursively); the coldest tier drops tree-only blocks (lowest priority, least recently used,
        leaves before parents). A warm tier drops its own droppable blocks only when the tiers below
        cannot take its pages (they are full of held pages).
        """
        if n <= 0:
            return 0
        alloc = self._alloc_of(tier, pool_group)
        before = alloc.num_free
        if tier < len(self._tiers) - 1:
            below = self._alloc_of(tier + 1, pool_group)
            while (freed := alloc.num_free - before) < n:
                victims = self._victims(tier, pool_group)
                want = min(n - freed, victims.size)
                if want == 0:
                    break
                if below.num_free < want:
                    self._make_room_in(tier + 1, pool_group, want - below.num_free)
                    # Dropping below may have freed pages of this tier too: pick victims afresh.
                    victims = self._victims(tier, pool_group)
                    want = min(n - (alloc.num_free - before), victims.size, below.num_free)
                    if want <= 0:
                        break
                self._move(pool_group, tier, victims[:want], tier + 1)
        freed = alloc.num_free - before
        if freed < n:
            self._drop_in(tier, pool_group, n - freed)
        return alloc.num_free - before

    def _droppable_here(self, node: BlockNode, tier: int) -> bool:
        """Whether dropping ``node`` is eviction at ``tier``: tree-only, no page in a warmer tier."""
        return self._tree_only(node) and not (node.tiers[node.pages >= 0] < tier).any()

    def _drop_in(self, tier: int, pool_group: int, n: int) -> int:
        """Drop tree-only leaves droppable at ``tier`` until ``n`` slots of ``(tier, pool_group)`` are
        free (or none is left); emits Removed. Returns the slots of that tier freed."""
        alloc = self._alloc_of(tier, pool_group)
        before = alloc.num_free
        kept: list[BlockNode] = []
        while alloc.num_free - before < n:
            node = self._tree.pop_leaf()
            if node is None:
                break
            if not self._tree_only(node):
                continue             # requeued when its request lets go
            if self._droppable_here(node, tier):
                self._evict(node)
            else:
                kept.append(node)
        for node in kept:
            self._tree.requeue(node)
        return alloc.num_free - before

    def _room_estimate(self, tier: int, pool_group: int) -> int:
        """About how many used slots of ``(tier, pool_group)`` ``_make_room_in`` can free now (it
        errs low: the caller still checks what it got)."""
        drop = self._droppable_pages(tier, pool_group)
        if tier == len(self._tiers) - 1:
            return drop
        movable = int(np.count_nonzero((self._alloc_of(tier, pool_group).refcount > 0)
                                       & ~self._locked_mask(tier, pool_group)))
        return max(min(movable, self._accept(tier + 1, pool_group)), drop)

    def _accept(self, tier: int, pool_group: int) -> int:
        """How many pages ``(tier, pool_group)`` can take from the tier above (free slots, plus what
        it can push further down or drop)."""
        free = self._alloc_of(tier, pool_group).num_free
        if tier == len(self._tiers) - 1:
            return free + self._droppable_pages(tier, pool_group)
        return free + self._accept(tier + 1, pool_group)

    def _droppable_pages(self, tier: int, pool_group: int) -> int:
        """Pages of ``(tier, pool_group)`` in blocks ``_drop_in(tier, ...)`` can reach: droppable at
        that tier, with every descendant droppable too (leaves go first)."""
        ready: dict[int, bool] = {}
        count = 0
        lgs = self._pg_layer_groups[pool_group]
        for node in reversed(list(self._tree.nodes())):   # children before parents
            ok = self._droppable_here(node, tier) and all(ready[id(c)] for c in node.children.values())
            ready[id(node)] = ok
            if ok:
                count += sum(1 for lg in lgs if node.pages[lg] >= 0 and node.tiers[lg] == tier)
        return count

    def _move(self, pool_group: int, src_tier: int, src: IntArray, dst_tier: int) -> None:
        """Move pages ``src`` of ``src_tier`` to fresh slots of ``dst_tier`` (one batched copy), then
        repoint every owner; on a failed copy the pages stay where they were."""
        dst = self._alloc_of(dst_tier, pool_group).alloc(src.size)
        self._copy_pages(pool_group, [(src_tier, src, dst_tier, dst)])
        self._relocate(pool_group, src_tier, src, dst_tier, dst)

    def _copy_pages(self, pool_group: int, jobs: list[tuple[int, IntArray, int, IntArray]]) -> None:
        """Run ``(src tier, src slots, dst tier, dst slots)`` copies back to back through the copy
        engine and wait for all; on failure the destination slots are freed and the error re-raised."""
        assert self._copy is not None
        if any(self._tiers[src_t].memory_kind == "cuda" for src_t, _, _, _ in jobs):
            torch.cuda.current_stream(self.device).synchronize()   # the KV being moved must be written
        handles: list[CopyHandle] = []
        try:
            for src_t, src, dst_t, dst in jobs:
                handles.append(self._copy.copy_slots(self._tiers[src_t], self._tiers[dst_t], pool_group, src, dst))
            for handle in handles:
                handle.wait()
        except BaseException:
            for handle in handles:   # let every queued copy finish before its slots are reused
                with contextlib.suppress(KvxferError):
                    handle.wait()
            for _, _, dst_t, dst in jobs:
                self._alloc_of(dst_t, pool_group).decref(dst)
            raise

    def _relocate(self, pool_group: int, src_tier: int, src: IntArray, dst_tier: int, dst: IntArray, *,
                  dst_alloc: SlotAllocator | None = None, dst_in_tree: npt.NDArray[np.bool_] | None = None,
                  dst_owner: dict[int, tuple[BlockNode, int]] | None = None) -> None:
        """Pages ``src`` of ``src_tier`` now live in slots ``dst`` (freshly allocated, one reference
        each) of ``dst_tier``: carry the reference counts over, repoint the tree blocks and the
        requests holding them, free the sources, emit Updated for a change of medium."""
        src_alloc = self._alloc_of(src_tier, pool_group)
        dst_alloc = dst_alloc if dst_alloc is not None else self._alloc_of(dst_tier, pool_group)
        dst_in_tree = dst_in_tree if dst_in_tree is not None else self._in_tree_t[dst_tier][pool_group]
        dst_owner = dst_owner if dst_owner is not None else self._tree_owner[dst_tier][pool_group]
        refs = src_alloc.refcount[src].astype(np.int64)
        extra = np.repeat(dst, refs - 1)
        if extra.size:
            dst_alloc.incref(extra)
        src_owner = self._tree_owner[src_tier][pool_group]
        moved: dict[int, list[bytes]] = {}
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            owner = src_owner.pop(s, None)
            if owner is not None:
                node, lg = owner
                node.pages[lg] = d
                node.tiers[lg] = dst_tier
                dst_owner[d] = owner
                moved.setdefault(lg, []).append(node.key)
        src_in_tree = self._in_tree_t[src_tier][pool_group]
        dst_in_tree[dst] = src_in_tree[src]
        src_in_tree[src] = False
        order = np.argsort(src)
        sorted_src, sorted_dst = src[order], dst[order]
        for cache in self._caches.values():
            for lg in self._pg_layer_groups[pool_group]:
                blocks, tiers = cache._blocks[lg], cache._tiers[lg]
                pos = np.flatnonzero((tiers == src_tier) & (blocks >= 0))
                if not pos.size:
                    continue
                idx = np.minimum(np.searchsorted(sorted_src, blocks[pos]), sorted_src.size - 1)
                hit = sorted_src[idx] == blocks[pos]
                blocks[pos[hit]] = sorted_dst[idx[hit]]
                tiers[pos[hit]] = dst_tier
        src_alloc.decref(np.repeat(src, refs))
        if src_tier != dst_tier:
            self._traffic.moved(src_tier, dst_tier, int(src.size), int(src.size) * self._page_bytes[pool_group])
        if moved and src_tier != dst_tier:
            self._put_moves(moved, self._media[src_tier], self._media[dst_tier])

    def _put_created(self) -> None:
        """Created events: each layer group's slots per tier (one event when all layer groups agree)."""
        counts = [tuple(t.layout.pool_groups[pg].num_slots for t in self._tiers) for pg in self._lg_pool_group]
        if all(c == counts[0] for c in counts):
            self._events.put(Created(tuple(self._media), counts[0]))
            return
        for lg, c in enumerate(counts):
            self._events.put(Created(tuple(self._media), c, layer_group_subset([i == lg for i in range(len(counts))])))

    def _put_moves(self, moved: dict[int, list[bytes]], old: str, new: str) -> None:
        """Updated events for blocks whose pages of the listed layer groups moved ``old`` -> ``new``
        (one event when every layer group moved the same blocks)."""
        n_lg = len(self._layout.layer_groups)
        keys = [tuple(dict.fromkeys(v)) for v in moved.values()]
        if len(moved) == n_lg and all(k == keys[0] for k in keys):
            self._events.put(Updated(keys[0], new, old_medium=old))
            return
        for lg, k in zip(moved, keys, strict=True):
            self._events.put(Updated(k, new, old_medium=old, layer_groups=layer_group_subset(
                [i == lg for i in range(n_lg)])))

    def _offloaded_pages(self, cache: KVCache) -> dict[int, dict[int, IntArray]]:
        """The cache's pages outside the primary tier: {pool group: {tier: slots}}."""
        out: dict[int, dict[int, list[IntArray]]] = {}
        for lg, (blocks, tiers) in enumerate(zip(cache._blocks, cache._tiers, strict=True)):
            away = (blocks >= 0) & (tiers > 0)
            for tier in np.unique(tiers[away]).tolist():
                out.setdefault(self._lg_pool_group[lg], {}).setdefault(tier, []).append(blocks[away & (tiers == tier)])
        return {pg: {t: np.unique(np.concatenate(parts)).astype(np.int32) for t, parts in by_tier.items()}
                for pg, by_tier in out.items()}

    def _cow_needs(self, cache: KVCache) -> dict[int, int]:
        """Primary slots the copy of a partially reused block will take, per pool group."""
        if cache._partial_src is None:
            return {}
        b = cache.num_committed_tokens // self._layout.tokens_per_block
        needs: dict[int, int] = {}
        for lg, blocks in enumerate(cache._blocks):
            if blocks[b] >= 0:
                needs[self._lg_pool_group[lg]] = needs.get(self._lg_pool_group[lg], 0) + 1
        return needs

    def _can_take(self, pool_group: int, n: int, swap: bool) -> bool:
        """Whether ``n`` more primary slots can be locked: within ``resume_max_utilization`` of the
        pool group, and obtainable (free, or freed by offloading/dropping unlocked pages). With
        ``swap`` (the slots are for onboarding pages from colder tiers) one slot to start with is
        enough: every page brought up frees a slot below that a displaced page can take."""
        alloc = self._allocators[pool_group]
        limit = math.floor(self.config.resume_max_utilization * alloc.num_slots + 1e-9)
        if int(np.count_nonzero(self._locked_mask(0, pool_group))) + n > limit:
            return False
        start = min(n, 1) if swap else n
        return alloc.num_free >= start or alloc.num_free + self._room_estimate(0, pool_group) >= start

    def _onboard(self, cache: KVCache, pool_group: int, n: int) -> bool:
        """Bring the cache's offloaded pages of a pool group back to the primary tier (warmest tier
        first) and leave ``n`` minus their count slots free for its partial-block copy. Room is made
        as it goes: when the tiers are full, each chunk brought up frees the slots the pages it
        displaces move down to. False when no room could be made (the cache must be pinned)."""
        alloc = self._allocators[pool_group]
        extra = n - sum(src.size for src in self._offloaded_pages(cache).get(pool_group, {}).values())
        while True:
            # Making room may move the cache's colder pages further down: read them afresh.
            by_tier = self._offloaded_pages(cache).get(pool_group, {})
            left = sum(src.size for src in by_tier.values())
            want = left + extra
            if alloc.num_free < want:
                self._make_room_in(0, pool_group, want - alloc.num_free)
                by_tier = self._offloaded_pages(cache).get(pool_group, {})
            if left == 0:
                return alloc.num_free >= want
            take = min(alloc.num_free, left)
            if take == 0:
                return False
            jobs: list[tuple[int, IntArray, int, IntArray]] = []
            for t in sorted(by_tier):                        # warmest first
                part = by_tier[t][:take]
                if part.size:
                    jobs.append((t, part, 0, alloc.alloc(part.size)))
                    take -= part.size
            self._copy_pages(pool_group, jobs)
            for t, src, _, dst in jobs:
                self._relocate(pool_group, t, src, 0, dst)

    # --- KVCache lifecycle (called by KVCache) ------------------------------------------------
    def create_kv_cache(self, tokens: Sequence[int] | npt.ArrayLike | None = None, id: str | None = None, *,
                        reuse_scope: ReuseScope | None = None, extra_keys: ExtraKeys | None = None) -> KVCache:
        """A new, suspended KVCache; call ``resume()`` before ``resize``.

        With ``tokens`` (the prompt) and prefix reuse enabled, the longest reusable prefix within
        ``reuse_scope`` is matched (never the last prompt token, whose logits must be computed): its
        pages are locked into the cache's first block ids and ``num_reused_tokens`` (= its committed
        tokens) says how much. ``extra_keys`` maps a block index to bytes (e.g. multimodal digests)
        that enter that block's key.
        """
        with self._lock:
            if self._shut_down:
                raise ManagerBusyError("create_kv_cache: the manager has been shut down")
            cache_id = id if id is not None else f"kv-{next(self._ids)}"
            if cache_id in self._caches:
                raise CacheStateError(f"create_kv_cache: a cache with id {cache_id!r} is already open")
            what = f"create_kv_cache({cache_id})"
            scope = _check_scope(reuse_scope, what)
            extras = check_extra_keys(extra_keys, what)
            arr = None if tokens is None else _as_tokens(tokens, what)
            cache = KVCache(self, cache_id, arr, scope, extras)
            cache._last_used = self._tree.tick()
            if arr is not None:
                tpb = self._layout.tokens_per_block
                plan = None
                if self.config.enable_prefix_reuse:
                    cache._prompt_keys = block_keys(arr, tpb, scope.root_key, extra_keys=extras)
                    plan = self._plan_reuse(scope, cache._prompt_keys, arr, extras)
                    self._lock_reuse(cache, arr, plan)
                if self._stats.enabled:
                    full = 0 if plan is None else len(plan.nodes)
                    partial = 0 if plan is None or plan.partial is None else 1
                    cache._pending.reused_full_blocks += full
                    cache._pending.reused_partial_blocks += partial
                    cache._pending.allocated_blocks += full + partial
                    cache._pending.missed_blocks += math.ceil(arr.size / tpb) - full - partial
            self._caches[cache_id] = cache
            self._sample_usage()
            return cache

    def probe_reuse(self, tokens: Sequence[int] | npt.ArrayLike, scope: ReuseScope | None = None,
                    extra_keys: ExtraKeys | None = None) -> int:
        """How many tokens ``create_kv_cache(tokens, reuse_scope=scope)`` would reuse now; takes
        nothing (no page, no LRU update, no statistics)."""
        with self._lock:
            scope = _check_scope(scope, "probe_reuse")
            extras = check_extra_keys(extra_keys, "probe_reuse")
            arr = _as_tokens(tokens, "probe_reuse")
            if not self.config.enable_prefix_reuse:
                return 0
            keys = block_keys(arr, self._layout.tokens_per_block, scope.root_key, extra_keys=extras)
            return self._plan_reuse(scope, keys, arr, extras).num_tokens

    # --- prefix reuse ---------------------------------------------------------------------------
    def _plan_reuse(self, scope: ReuseScope, keys: list[bytes], tokens: TokenArray,
                    extras: dict[int, bytes]) -> _ReusePlan:
        """The longest prefix whose pages exist for every layer group that needs them."""
        tpb = self._layout.tokens_per_block
        n_lg = len(self._layout.layer_groups)
        none = _ReusePlan(0, (), None, np.empty((0, n_lg), dtype=np.int32), np.empty((0, n_lg), dtype=np.int8))
        if tokens.size <= 1:
            return none
        match = self._tree.match(scope.root_key, keys, tokens if self.config.enable_partial_reuse else None,
                                 max_tokens=tokens.size - 1)
        nodes = match.nodes
        partial = match.partial if len(nodes) not in extras else None
        rows = [n.pages for n in nodes] + ([partial.pages] if partial is not None else [])
        if not rows:
            return none
        pages = np.concatenate(rows).reshape(len(rows), n_lg)
        tiers = np.concatenate([n.tiers for n in (*nodes, *(() if partial is None else (partial,)))]
                               ).reshape(len(rows), n_lg)
        full = len(nodes)
        if not self._has_windows:          # full attention keeps every page: the whole match holds
            return _ReusePlan(full * tpb + match.partial_tokens if partial is not None else full * tpb,
                              nodes, partial, pages, tiers)
        if partial is not None:
            n_tok = full * tpb + match.partial_tokens
            if self._window_pages_exist(pages, np.array([n_tok]), np.array([full + 1]))[0]:
                return _ReusePlan(n_tok, nodes, partial, self._needed_pages(pages[:full + 1], n_tok),
                                  tiers[:full + 1])
        b = np.arange(full + 1)
        ok = self._window_pages_exist(pages, b * tpb, b)
        best = int(np.flatnonzero(ok)[-1])
        if best == 0:
            return none
        return _ReusePlan(best * tpb, nodes[:best], None, self._needed_pages(pages[:best], best * tpb), tiers[:best])

    def _window_start(self, layer_group: int, num_tokens: npt.NDArray[np.int64]) -> tuple[
            npt.NDArray[np.int64], int]:
        """(first block a request of ``num_tokens`` still needs after its sinks, sink blocks) for a
        layer group; the same rule ``_release_out_of_window`` frees by."""
        lg = self._layout.layer_groups[layer_group]
        if lg.window is None:
            return np.zeros_like(num_tokens), 0
        tpb = self._layout.tokens_per_block
        sink = math.ceil(lg.sink_tokens / tpb)
        first = np.maximum(0, num_tokens - lg.window + 1) // tpb
        return np.where(first <= sink, 0, first), sink

    def _window_pages_exist(self, pages: IntArray, num_tokens: npt.NDArray[np.int64],
                            num_blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """For each candidate (num_tokens[i] in num_blocks[i] blocks): whether every page a layer
        group needs for it (sink blocks and the window before it) exists in ``pages``."""
        ok = np.ones(num_tokens.size, dtype=bool)
        for lg in range(pages.shape[1]):
            missing = np.concatenate([[0], np.cumsum(pages[:, lg] < 0)])
            lo, sink = self._window_start(lg, num_tokens.astype(np.int64))
            ok &= missing[num_blocks] - missing[np.minimum(lo, num_blocks)] == 0
            ok &= missing[np.minimum(sink, num_blocks)] == 0
        return ok

    def _needed_pages(self, pages: IntArray, num_tokens: int) -> IntArray:
        """``pages`` with -1 where a sliding-window group does not need the block."""
        out = pages.astype(np.int32, copy=True)
        idx = np.arange(pages.shape[0])
        for lg in range(pages.shape[1]):
            lo, sink = self._window_start(lg, np.array([num_tokens], dtype=np.int64))
            out[(idx >= sink) & (idx < int(lo[0])), lg] = -1
        return out

    def _lock_reuse(self, cache: KVCache, tokens: TokenArray, plan: _ReusePlan) -> None:
        """Take a reference on the planned pages and make them the cache's first blocks."""
        if plan.num_tokens == 0:
            return
        for lg in range(plan.pages.shape[1]):
            col, tiers = plan.pages[:, lg].copy(), plan.tiers[:, lg].copy()
            for tier in np.unique(tiers[col >= 0]).tolist():
                self._alloc_of(tier, self._lg_pool_group[lg]).incref(col[(col >= 0) & (tiers == tier)])
            cache._blocks[lg] = col
            cache._tiers[lg] = tiers
        cache._tokens = tokens[:plan.num_tokens].copy()
        cache._history = plan.num_tokens
        cache._capacity = plan.pages.shape[0] * self._layout.tokens_per_block
        cache.num_reused_tokens = plan.num_tokens
        cache._keys = cache._prompt_keys[:len(plan.nodes)]
        cache._tree_nodes = list(plan.nodes)
        cache._partial_src = plan.partial
        for node in (*plan.nodes, *(() if plan.partial is None else (plan.partial,))):
            self._tree.touch(node)

    def _copy_on_write(self, cache: KVCache) -> bool:
        """Give the cache private copies of its partially reused block (shared with the tree) before
        it may write there; False, changing nothing, when no slot can be had."""
        src_node = cache._partial_src
        if src_node is None:
            return True
        b = cache.num_committed_tokens // self._layout.tokens_per_block
        srcs = [int(blocks[b]) for blocks in cache._blocks]
        needs: dict[int, int] = {}
        for lg, src in enumerate(srcs):
            if src >= 0:
                needs[self._lg_pool_group[lg]] = needs.get(self._lg_pool_group[lg], 0) + 1
        try:
            self._reserve(needs)
        except OutOfSlotsError:
            return False
        by_pg: dict[int, tuple[list[int], list[int]]] = {}
        for lg, src in enumerate(srcs):
            if src < 0:
                continue
            pg = self._lg_pool_group[lg]
            dst = int(self._allocators[pg].alloc(1)[0])
            by_pg.setdefault(pg, ([], []))[0].append(src)
            by_pg[pg][1].append(dst)
            cache._blocks[lg][b] = dst
        for pg, (src_ids, dst_ids) in by_pg.items():
            self.copy_slots(pg, np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64))
            self._allocators[pg].decref(np.array(src_ids, dtype=np.int32))
        cache._partial_src = None
        self._tree.touch(src_node)
        return True

    def copy_slots(self, pool_group: int, src: npt.ArrayLike, dst: npt.ArrayLike) -> None:
        """Copy whole slots ``src[i] -> dst[i]`` in every pool of a pool group (one batched copy
        per pool, on the pool's device)."""
        pg = self._layout.pool_groups[pool_group]
        src_ids = self._allocators[pool_group].check(src, "copy source slot").astype(np.int64)
        dst_ids = self._allocators[pool_group].check(dst, "copy destination slot").astype(np.int64)
        if src_ids.shape != dst_ids.shape:
            raise KVCacheError(f"copy_slots: {src_ids.size} sources for {dst_ids.size} destinations")
        for pool, raw in zip(pg.pools, self._pools[pool_group], strict=True):
            rows = raw.view(pool.num_slots, pool.slot_bytes)
            rows[torch.from_numpy(dst_ids).to(raw.device)] = rows[torch.from_numpy(src_ids).to(raw.device)]

    def _insert_committed(self, cache: KVCache, priority: int | None) -> None:
        """Key the cache's newly full blocks and enter them into the tree (adopting duplicates)."""
        tpb = self._layout.tokens_per_block
        full = cache.num_committed_tokens // tpb
        have = len(cache._keys)
        if full <= have:
            return
        toks = cache._tokens
        known = min(full, len(cache._prompt_keys))
        upto = have
        if known > have and cache.input_tokens is not None:
            diff = np.flatnonzero(toks[have * tpb:known * tpb] != cache.input_tokens[have * tpb:known * tpb])
            upto = known if not diff.size else have + int(diff[0]) // tpb
        new_keys = cache._prompt_keys[have:upto]
        parent_key = cache._keys[-1] if cache._keys else cache.reuse_scope.root_key
        if upto > have:
            parent_key = new_keys[-1]
        new_keys += block_keys(toks[upto * tpb:full * tpb], tpb, parent_key, first_block=upto,
                               extra_keys=cache._extra_keys)
        pages = np.stack([blocks[have:full] for blocks in cache._blocks], axis=1)
        root_key = cache.reuse_scope.root_key
        for i, key in enumerate(new_keys):
            b = have + i
            cache._keys.append(key)
            parent = cache._tree_nodes[b - 1] if b > 0 else None
            if b > 0 and (parent is None or parent.removed):
                cache._tree_nodes.append(None)
                continue
            node = self._tree.child(root_key, parent, key)
            if node is None:
                node = self._tree.insert(root_key, parent, key, toks[b * tpb:(b + 1) * tpb], pages[i],
                                         has_extra_key=b in cache._extra_keys,
                                         priority=DEFAULT_PRIORITY if priority is None else priority)
                self._mark_tree_pages(node, range(len(cache._blocks)))
                self._events.put(Stored(None if parent is None else parent.key, (key,),
                                        tuple(toks[b * tpb:(b + 1) * tpb].tolist()), tpb,
                                        cache.reuse_scope.lora_id, self._medium,
                                        stored_extra_keys(b, 1, cache.reuse_scope.salt, cache._extra_keys),
                                        layer_group_subset((pages[i] >= 0).tolist())))
            else:
                self._adopt(cache, b, node)
                old = node.priority
                if priority is not None and self._tree.set_priority(node, priority):
                    self._events.put(Updated((node.key,), self._node_medium(node), priority, old_priority=old))
                self._tree.touch(node)
            cache._tree_nodes.append(node)

    def _mark_tree_pages(self, node: BlockNode, layer_groups: Sequence[int] | range) -> None:
        """Give the tree its reference on ``node``'s page of each listed layer group."""
        for lg in layer_groups:
            page, tier = int(node.pages[lg]), int(node.tiers[lg])
            if page >= 0:
                pg = self._lg_pool_group[lg]
                if self._in_tree_t[tier][pg][page]:
                    raise KVCacheError(f"pool group {pg}: slot {page} of tier {tier} is already a tree page")
                self._alloc_of(tier, pg).incref(np.array([page], dtype=np.int32))
                self._in_tree_t[tier][pg][page] = True
                self._tree_owner[tier][pg][page] = (node, lg)

    def _adopt(self, cache: KVCache, block: int, node: BlockNode) -> None:
        """A committed block duplicating ``node``: use the tree's pages and free the cache's own;
        a page the tree lacks (sliding window) is taken from the cache. A tree page in a colder tier
        is not adopted (an active request's pages stay primary): the cache keeps its own."""
        for lg, blocks in enumerate(cache._blocks):
            mine, theirs = int(blocks[block]), int(node.pages[lg])
            pg = self._lg_pool_group[lg]
            if theirs >= 0 and node.tiers[lg] != 0:
                continue
            if theirs >= 0 and mine >= 0 and mine != theirs:
                self._allocators[pg].incref(np.array([theirs], dtype=np.int32))
                self._allocators[pg].decref(np.array([mine], dtype=np.int32))
                blocks[block] = theirs
            elif theirs < 0 <= mine:
                node.pages[lg] = mine
                node.tiers[lg] = cache._tiers[lg][block]
                self._mark_tree_pages(node, [lg])
                parent = node.parent
                self._events.put(Stored(None if parent is None or parent.is_root else parent.key, (node.key,),
                                        tuple(node.tokens.tolist()), self._layout.tokens_per_block,
                                        cache.reuse_scope.lora_id, self._media[int(node.tiers[lg])],
                                        stored_extra_keys(block, 1, cache.reuse_scope.salt, cache._extra_keys),
                                        layer_group_subset([i == lg for i in range(len(cache._blocks))])))

    def _drop_window_pages(self, cache: KVCache, layer_group: int, start: int, released: IntArray,
                           tiers: TierArray) -> None:
        """The tree lets go of the sliding-window pages a request just released for blocks
        [start, start + len(released)) once no other request holds them (the node keeps -1 there),
        so window memory is not pinned by the tree; a node left without pages is requeued."""
        pg = self._lg_pool_group[layer_group]
        nodes = cache._tree_nodes[start:start + released.size]
        for node, page, tier in zip(nodes, released.tolist(), tiers.tolist(), strict=False):
            if node is None or node.removed or page < 0 or int(node.pages[layer_group]) != page \
                    or int(node.tiers[layer_group]) != tier:
                continue
            alloc = self._alloc_of(tier, pg)
            if self._in_tree_t[tier][pg][page] and alloc.refcount[page] == 1:
                alloc.decref(np.array([page], dtype=np.int32))
                self._unmark_tree_page(tier, pg, page)
                node.pages[layer_group] = -1
                self._events.put(Removed((node.key,), self._media[tier], layer_group_subset(
                    [i == layer_group for i in range(len(node.pages))])))
            self._tree.touch(node)

    def _set_priority(self, cache: KVCache, priority: int) -> None:
        with self._lock:
            for node in cache._tree_nodes:
                old = None if node is None else node.priority
                if node is not None and self._tree.set_priority(node, priority):
                    self._events.put(Updated((node.key,), self._node_medium(node), priority, old_priority=old))

    def _touch_blocks(self, cache: KVCache, start: int, stop: int) -> None:
        """Requeue the tree blocks tied to the cache's blocks [start, stop) for eviction."""
        for node in cache._tree_nodes[start:stop]:
            if node is not None:
                self._tree.touch(node)

    def reset_prefix_tree(self) -> bool:
        """Drop every block of the prefix tree (one AllCleared event); False, changing nothing, while
        a request still shares one of its pages."""
        with self._lock:
            nodes = list(self._tree.nodes())
            if any(not self._tree_only(n) for n in nodes):
                return False
            self._clear_tree(nodes)
            return True

    def _clear_tree(self, nodes: list[BlockNode]) -> None:
        self._tree.clear()
        if not nodes:
            return
        pages = np.stack([n.pages for n in nodes])
        tiers = np.stack([n.tiers for n in nodes])
        for lg in range(pages.shape[1]):
            pg = self._lg_pool_group[lg]
            for tier in range(len(self._tiers)):
                col = pages[:, lg][(pages[:, lg] >= 0) & (tiers[:, lg] == tier)]
                self._alloc_of(tier, pg).decref(col)
                self._in_tree_t[tier][pg][col] = False
        for per_tier in self._tree_owner:
            for owners in per_tier:
                owners.clear()
        self._events.put(AllCleared())

    @property
    def prefix_tree(self) -> PrefixTree:
        """The prefix tree (read-only use: inspection, tests, benchmarks)."""
        return self._tree

    # --- events and statistics -------------------------------------------------------------------
    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first."""
        with self._lock:
            return self._events.drain()

    @property
    def events_dropped(self) -> int:
        """Events dropped because the bounded queue was full."""
        return self._events.dropped

    def slot_accounting(self, pool_group: int = 0, tier: int = 0) -> SlotAccounting:
        """Where the slots of a pool group of a tier (0 = primary) are (free, request-only,
        evictable, shared); raises KVCacheError when the reference counts contradict the tree."""
        with self._lock:
            self._check_tier_index(tier)
            alloc = self._alloc_of(tier, pool_group)
            rc = alloc.refcount
            tree = self._in_tree_t[tier][pool_group]
            where = f"pool group {pool_group}" + (f" of the {self._tiers[tier].name} tier" if tier else "")
            free = int(np.count_nonzero(rc == 0))
            if free != alloc.num_free:
                raise KVCacheError(f"{where}: {free} slots unreferenced but {alloc.num_free} on the free stack")
            orphan = np.flatnonzero(tree & (rc == 0))
            if orphan.size:
                raise KVCacheError(f"{where}: tree page {int(orphan[0])} has no reference")
            return SlotAccounting(pool_group, int(rc.size), free,
                                  int(np.count_nonzero(~tree & (rc > 0))),
                                  int(np.count_nonzero(tree & (rc == 1))),
                                  int(np.count_nonzero(tree & (rc > 1))))

    def _sample_usage(self) -> None:
        """Feed the peak tracker after every allocation change: O(1) counts plus one pass over the
        tree mask (``slot_accounting`` also cross-checks the counts, too slow to run per call)."""
        if not self._stats.enabled:
            return
        for pg, alloc in enumerate(self._allocators):
            tree = self._in_tree[pg]
            rc = alloc.refcount
            tree_pages = int(np.count_nonzero(tree))
            evictable = int(np.count_nonzero(rc[tree] == 1)) if tree_pages else 0
            used = alloc.num_used
            self._stats.sample(SlotAccounting(pg, alloc.num_slots, alloc.num_free, used - tree_pages,
                                              evictable, tree_pages - evictable))

    def commit_pending_stats(self) -> IterationStats:
        """Merge every request's pending deltas into one iteration's counters (and the totals);
        all zero with ``enable_stats=False``."""
        with self._lock:
            return self._stats.merge([c._pending for c in self._caches.values()])

    @property
    def total_stats(self) -> IterationStats:
        """Every iteration merged so far."""
        return self._stats.total

    def read_peak_usage(self) -> tuple[PoolGroupPeaks, ...]:
        """Peak available / evictable / used slots per pool group since the last read."""
        with self._lock:
            current = [self.slot_accounting(pg) for pg in range(len(self._allocators))] if self._stats.enabled else []
            return self._stats.read_peaks(current)

    @property
    def open_caches(self) -> list[KVCache]:
        """Caches created and not yet closed."""
        return list(self._caches.values())

    # --- tiers: public view and quotas -----------------------------------------------------------
    @property
    def tier_media(self) -> tuple[str, ...]:
        """Each tier's medium name in events ("GPU", "CPU", "DISK"), primary first."""
        return tuple(self._media)

    @property
    def num_tiers(self) -> int:
        """Tiers of this manager, primary first (1 without host or disk tiers)."""
        return len(self._tiers)

    def tier_index(self, tier: int | type[PrimaryTier | HostTier | DiskTier]) -> int:
        """Index of a tier given as an index or as its config class (PrimaryTier, HostTier, DiskTier)."""
        if isinstance(tier, type):
            for i, cfg in enumerate(self.config.tiers):
                if isinstance(cfg, tier):
                    return i
            raise TierError(f"the manager has no {tier.__name__} (tiers: "
                            f"{[type(t).__name__ for t in self.config.tiers]})")
        self._check_tier_index(tier)
        return int(tier)

    def _check_tier_index(self, tier: int) -> None:
        if isinstance(tier, bool) or not isinstance(tier, int | np.integer) or not 0 <= tier < len(self._tiers):
            raise TierError(f"no tier {tier!r} (have 0..{len(self._tiers) - 1})")

    def tier_traffic(self) -> TierTraffic:
        """Pages offloaded into / onboarded from each tier, blocks dropped, bytes moved (cumulative)."""
        with self._lock:
            return self._traffic.snapshot()

    def storage_stats(self, tier: int | type[PrimaryTier | HostTier | DiskTier] = 0) -> TierStats:
        """Capacity and occupancy (slots per pool group) of one tier."""
        with self._lock:
            return self._tiers[self.tier_index(tier)].stats()

    def resize_quota(self, tier: int | type[HostTier | DiskTier], quota_bytes: int) -> None:
        """Give a host or disk tier a new quota; only while no request is ACTIVE (ManagerBusyError).

        A new tier of that size is built, the tier's live pages are copied into its first slots
        (after offloading or dropping the surplus, coldest first), and the old tier is closed. When
        the surplus cannot be evicted (held pages with no room below) nothing changes (TierError).
        The primary tier's pools are fixed (their addresses are published): TierError.
        """
        with self._lock:
            t = self.tier_index(tier)
            if t == 0:
                raise TierError("resize_quota: the primary tier's pools are fixed (their addresses are published "
                                "to transports); size it with PrimaryTier.quota_bytes")
            active = [c.id for c in self._caches.values() if c.state is CacheState.ACTIVE]
            if active:
                raise ManagerBusyError(f"resize_quota: {len(active)} KV caches are active: {active[:5]} "
                                       f"(suspend or close them first)")
            old_cfg = self.config.tiers[t]
            new_cfg: HostTier | DiskTier
            if isinstance(old_cfg, HostTier):
                new_cfg = HostTier(quota_bytes, old_cfg.pinned)
                new_tier: TierStorage = open_host_tier(self.config, new_cfg)
            else:
                assert isinstance(old_cfg, DiskTier)
                new_cfg = DiskTier(quota_bytes, old_cfg.path)
                new_tier = DiskTierStorage(self.config, new_cfg)
            try:
                self._shrink_to(t, new_tier)
                self._move_into(t, new_tier)
            except BaseException:
                new_tier.close()
                raise
            old = self._tiers[t]
            self._tiers[t] = new_tier
            old.close()
            tiers = list(self.config.tiers)
            tiers[t] = new_cfg
            self.config = dataclasses.replace(self.config, tiers=tuple(tiers))

    def _shrink_to(self, t: int, new_tier: TierStorage) -> None:
        """Evict pages of tier ``t`` until each pool group's live pages fit ``new_tier``."""
        surplus = {pg: self._alloc_of(t, pg).num_used - new_tier.allocator(pg).num_slots
                   for pg in range(len(self._allocators))}
        for pg, n in surplus.items():
            if n > 0 and self._room_estimate(t, pg) < n:
                raise TierError(f"resize_quota: the {self._tiers[t].name} tier holds {self._alloc_of(t, pg).num_used} "
                                f"pages of pool group {pg}, {n} more than {new_tier.allocator(pg).num_slots} slots "
                                f"of the new quota, and they cannot be evicted (held, no room below)")
        for pg, n in surplus.items():
            if n > 0 and self._make_room_in(t, pg, n) < n:
                raise TierError(f"resize_quota: could not evict {n} pages of pool group {pg} from the "
                                f"{self._tiers[t].name} tier")

    def _move_into(self, t: int, new_tier: TierStorage) -> None:
        """Copy tier ``t``'s live pages into the first slots of ``new_tier`` and repoint every owner."""
        assert self._copy is not None
        moves = []
        for pg in range(len(self._allocators)):
            live = np.flatnonzero(self._alloc_of(t, pg).refcount > 0).astype(np.int32)
            dst = new_tier.allocator(pg).alloc(live.size)
            handle = self._copy.copy_slots(self._tiers[t], new_tier, pg, live, dst)
            moves.append((pg, live, dst, handle))
        for *_, handle in moves:
            handle.wait()
        in_tree = [np.zeros(pg.num_slots, dtype=bool) for pg in new_tier.layout.pool_groups]
        owners: list[dict[int, tuple[BlockNode, int]]] = [{} for _ in new_tier.layout.pool_groups]
        for pg, live, dst, _ in moves:
            self._relocate(pg, t, live, t, dst, dst_alloc=new_tier.allocator(pg), dst_in_tree=in_tree[pg],
                           dst_owner=owners[pg])
        self._in_tree_t[t] = in_tree
        self._tree_owner[t] = owners

    def _resume(self, cache: KVCache) -> bool:
        """Onboard the cache's offloaded pages and copy its partially reused block; False, changing
        nothing, when the primary tier cannot take them."""
        with self._lock:
            offloaded = self._offloaded_pages(cache)
            needs = self._cow_needs(cache)
            for pg, by_tier in offloaded.items():
                needs[pg] = needs.get(pg, 0) + sum(src.size for src in by_tier.values())
            self._pinned.add(cache.id)   # its primary pages stay put while room is made
            try:
                if not all(self._can_take(pg, n, pg in offloaded) for pg, n in needs.items()):
                    return False
                for pg, n in needs.items():
                    if not self._onboard(cache, pg, n):
                        return False
                if not self._copy_on_write(cache):
                    return False
            finally:
                self._pinned.discard(cache.id)
            cache._last_used = self._tree.tick()
            self._sample_usage()
            return True

    def _suspend(self, cache: KVCache) -> None:
        with self._lock:
            cache._last_used = self._tree.tick()

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
                    cache._tiers[g] = np.concatenate([cache._tiers[g], np.zeros(new_n - old_n, dtype=np.int8)])
                if self._stats.enabled:
                    cache._pending.new_blocks += new_n - old_n
                    cache._pending.allocated_blocks += new_n - old_n
            elif new_n < old_n:
                for g in range(len(cache._blocks)):
                    self._release(g, cache._blocks[g][new_n:], cache._tiers[g][new_n:])
                    cache._blocks[g] = cache._blocks[g][:new_n].copy()
                    cache._tiers[g] = cache._tiers[g][:new_n].copy()
            self._sample_usage()

    def _on_commit(self, cache: KVCache, priority: int | None = None) -> None:
        with self._lock:
            if self.config.enable_prefix_reuse:
                self._insert_committed(cache, priority)
            self._sample_usage()

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
                    released = stale.copy()
                    released_tiers = cache._tiers[lg.layer_group_id][sink_blocks:first_needed].copy()
                    self._release(lg.layer_group_id, released, released_tiers)
                    blocks[sink_blocks:first_needed] = -1
                    self._drop_window_pages(cache, lg.layer_group_id, sink_blocks, released, released_tiers)

    def _close(self, cache: KVCache) -> None:
        with self._lock:
            for g, (blocks, tiers) in enumerate(zip(cache._blocks, cache._tiers, strict=True)):
                self._release(g, blocks, tiers)
            self._caches.pop(cache.id, None)
            self._touch_blocks(cache, 0, len(cache._tree_nodes))
            if cache._partial_src is not None:
                self._tree.touch(cache._partial_src)
                cache._partial_src = None
            self._stats.retire(cache._pending)
            self._sample_usage()

    # --- manager lifecycle --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release all memory; refuses while caches are open."""
        with self._lock:
            open_ids = [c.id for c in self._caches.values() if c.state is not CacheState.CLOSED]
            if open_ids:
                raise ManagerBusyError(f"shutdown: {len(open_ids)} KV caches still open: {open_ids[:5]}")
            self._clear_tree(list(self._tree.nodes()))
            self._shut_down = True
            if self._copy is not None:
                self._copy.close()
            for tier in self._tiers[1:]:
                tier.close()
            self._pools = [[] for _ in self._pools]
            # The primary view must not keep the pools' memory alive either (allocators stay readable).
            self._tiers[0] = MemoryTierStorage("primary", self._layout, [[] for _ in self._pools], self._allocators,
                                               owns_pools=False)
            self._tiers[0].close()

    def __repr__(self) -> str:
        pgs = ", ".join(f"pg{i}: {a.num_used}/{a.num_slots} used" for i, a in enumerate(self._allocators))
        return f"KVCacheManager(device={self.device}, {pgs})"


def _check_scope(scope: ReuseScope | None, what: str) -> ReuseScope:
    if scope is None:
        return DEFAULT_SCOPE
    if not isinstance(scope, ReuseScope):
        raise ConfigError(f"{what}: reuse_scope must be a ReuseScope, got {type(scope).__name__}")
    return scope


def check_layer_group(layout: CacheLayoutDesc, layer_group: int) -> None:
    """Raise LayoutError when ``layer_group`` is not a layer group of ``layout``."""
    if not 0 <= layer_group < len(layout.layer_groups):
        raise LayoutError(f"no layer group {layer_group} (have 0..{len(layout.layer_groups) - 1})")
