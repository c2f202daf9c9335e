"""KVCacheManager: owns the pools and slot allocators, hands out KVCaches, publishes the layout."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.config import CacheConfig
from kvxfer.cache.descriptors import BufferId, CacheLayoutDesc, PoolGroupDesc
from kvxfer.cache.dtypes import torch_dtype
from kvxfer.cache.events import AllCleared, EventQueue, KVEvent, Removed, Stored, Updated
from kvxfer.cache.hashing import DEFAULT_SCOPE, ExtraKeys, ReuseScope, block_keys, check_extra_keys
from kvxfer.cache.kv_cache import CacheState, KVCache, _as_tokens
from kvxfer.cache.layout import place_layout, plan_layout
from kvxfer.cache.memory import MemoryRegion, allocate_pool
from kvxfer.cache.radix_tree import DEFAULT_PRIORITY, BlockNode, PrefixTree
from kvxfer.cache.stats import IterationStats, PoolGroupPeaks, SlotAccounting, StatsCollector
from kvxfer.errors import (
    CacheStateError,
    ConfigError,
    KVCacheError,
    LayoutError,
    ManagerBusyError,
    OutOfSlotsError,
)

IntArray = npt.NDArray[np.int32]
TokenArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class _ReusePlan:
    """What a new request takes from the prefix tree: ``pages[b, layer_group]`` for its first
    ``len(pages)`` blocks (-1 where not needed), the first ``len(nodes)`` of them full blocks."""

    num_tokens: int
    nodes: tuple[BlockNode, ...]
    partial: BlockNode | None
    pages: IntArray


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

    def _make_room(self, pool_group: int, n: int) -> int:
        """Free ``n`` slots of ``pool_group`` by evicting tree-only blocks, as far as possible.

        Order: lowest priority, then least recently used, leaves before their parents; a block whose
        page a request still holds is never evicted. Returns the slots of ``pool_group`` freed.
        """
        freed = 0
        while freed < n:
            node = self._tree.pop_leaf()
            if node is None:
                break
            if self._tree_only(node):
                freed += self._evict(node, pool_group)
        return freed

    def _tree_only(self, node: BlockNode) -> bool:
        """Whether every page of ``node`` is referenced by the tree alone."""
        for lg, page in enumerate(node.pages.tolist()):
            if page >= 0 and self._allocators[self._lg_pool_group[lg]].refcount[page] != 1:
                return False
        return True

    def _evict(self, node: BlockNode, pool_group: int) -> int:
        """Drop a tree-only leaf and its pages; returns how many slots of ``pool_group`` it freed."""
        self._tree.remove(node)
        freed = 0
        for lg, page in enumerate(node.pages.tolist()):
            if page >= 0:
                pg = self._lg_pool_group[lg]
                self._allocators[pg].decref(np.array([page], dtype=np.int32))
                self._in_tree[pg][page] = False
                freed += pg == pool_group
        self._events.put(Removed((node.key,), self._medium))
        return freed

    def _release(self, layer_group: int, ids: IntArray) -> None:
        ids = ids[ids >= 0]
        if ids.size:
            self._allocators[self._lg_pool_group[layer_group]].decref(ids)

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
        none = _ReusePlan(0, (), None, np.empty((0, n_lg), dtype=np.int32))
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
        full = len(nodes)
        if not self._has_windows:          # full attention keeps every page: the whole match holds
            return _ReusePlan(full * tpb + match.partial_tokens if partial is not None else full * tpb,
                              nodes, partial, pages)
        if partial is not None:
            n_tok = full * tpb + match.partial_tokens
            if self._window_pages_exist(pages, np.array([n_tok]), np.array([full + 1]))[0]:
                return _ReusePlan(n_tok, nodes, partial, self._needed_pages(pages[:full + 1], n_tok))
        b = np.arange(full + 1)
        ok = self._window_pages_exist(pages, b * tpb, b)
        best = int(np.flatnonzero(ok)[-1])
        if best == 0:
            return none
        return _ReusePlan(best * tpb, nodes[:best], None, self._needed_pages(pages[:best], best * tpb))

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
            col = plan.pages[:, lg].copy()
            self._allocators[self._lg_pool_group[lg]].incref(col[col >= 0])
            cache._blocks[lg] = col
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
                self._mark_tree_pages(node.pages, range(len(cache._blocks)))
                self._events.put(Stored(None if parent is None else parent.key, (key,),
                                        tuple(toks[b * tpb:(b + 1) * tpb].tolist()), tpb,
                                        cache.reuse_scope.lora_id, self._medium))
            else:
                self._adopt(cache, b, node)
                if priority is not None and self._tree.set_priority(node, priority):
                    self._events.put(Updated((node.key,), self._medium, priority))
                self._tree.touch(node)
            cache._tree_nodes.append(node)

    def _mark_tree_pages(self, pages: IntArray, layer_groups: Sequence[int] | range) -> None:
        """Give the tree its reference on ``pages[lg]`` for each listed layer group."""
        for lg in layer_groups:
            page = int(pages[lg])
            if page >= 0:
                pg = self._lg_pool_group[lg]
                if self._in_tree[pg][page]:
                    raise KVCacheError(f"pool group {pg}: slot {page} is already a tree page")
                self._allocators[pg].incref(np.array([page], dtype=np.int32))
                self._in_tree[pg][page] = True

    def _adopt(self, cache: KVCache, block: int, node: BlockNode) -> None:
        """A committed block duplicating ``node``: use the tree's pages and free the cache's own;
        a page the tree lacks (sliding window) is taken from the cache."""
        for lg, blocks in enumerate(cache._blocks):
            mine, theirs = int(blocks[block]), int(node.pages[lg])
            pg = self._lg_pool_group[lg]
            if theirs >= 0 and mine >= 0 and mine != theirs:
                self._allocators[pg].incref(np.array([theirs], dtype=np.int32))
                self._allocators[pg].decref(np.array([mine], dtype=np.int32))
                blocks[block] = theirs
            elif theirs < 0 <= mine:
                node.pages[lg] = mine
                self._mark_tree_pages(node.pages, [lg])

    def _drop_window_pages(self, cache: KVCache, layer_group: int, start: int, released: IntArray) -> None:
        """The tree lets go of the sliding-window pages a request just released for blocks
        [start, start + len(released)) once no other request holds them (the node keeps -1 there),
        so window memory is not pinned by the tree; a node left without pages is requeued."""
        pg = self._lg_pool_group[layer_group]
        rc, in_tree = self._allocators[pg].refcount, self._in_tree[pg]
        for node, page in zip(cache._tree_nodes[start:start + released.size], released.tolist(), strict=False):
            if node is None or node.removed or page < 0 or int(node.pages[layer_group]) != page:
                continue
            if in_tree[page] and rc[page] == 1:
                self._allocators[pg].decref(np.array([page], dtype=np.int32))
                in_tree[page] = False
                node.pages[layer_group] = -1
            self._tree.touch(node)

    def _set_priority(self, cache: KVCache, priority: int) -> None:
        with self._lock:
            for node in cache._tree_nodes:
                if node is not None and self._tree.set_priority(node, priority):
                    self._events.put(Updated((node.key,), self._medium, priority))

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
        for lg in range(pages.shape[1]):
            col = pages[:, lg][pages[:, lg] >= 0]
            pg = self._lg_pool_group[lg]
            self._allocators[pg].decref(col)
            self._in_tree[pg][col] = False
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

    def slot_accounting(self, pool_group: int = 0) -> SlotAccounting:
        """Where the slots of a pool group are (free, request-only, evictable, shared); raises
        KVCacheError when the reference counts contradict the tree."""
        with self._lock:
            rc = self._allocators[pool_group].refcount
            tree = self._in_tree[pool_group]
            free = int(np.count_nonzero(rc == 0))
            if free != self._allocators[pool_group].num_free:
                raise KVCacheError(f"pool group {pool_group}: {free} slots unreferenced but "
                                   f"{self._allocators[pool_group].num_free} on the free stack")
            orphan = np.flatnonzero(tree & (rc == 0))
            if orphan.size:
                raise KVCacheError(f"pool group {pool_group}: tree page {int(orphan[0])} has no reference")
            return SlotAccounting(pool_group, int(rc.size), free,
                                  int(np.count_nonzero(~tree & (rc > 0))),
                                  int(np.count_nonzero(tree & (rc == 1))),
                                  int(np.count_nonzero(tree & (rc > 1))))

    def _sample_usage(self) -> None:
        if self._stats.enabled:
            for pg in range(len(self._allocators)):
                self._stats.sample(self.slot_accounting(pg))

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

    def _resume(self, cache: KVCache) -> bool:
        with self._lock:
            if not self._copy_on_write(cache):
                return False
            self._sample_usage()
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
                if self._stats.enabled:
                    cache._pending.new_blocks += new_n - old_n
                    cache._pending.allocated_blocks += new_n - old_n
            elif new_n < old_n:
                for g in range(len(cache._blocks)):
                    self._release(g, cache._blocks[g][new_n:])
                    cache._blocks[g] = cache._blocks[g][:new_n].copy()
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
                    self._release(lg.layer_group_id, released)
                    blocks[sink_blocks:first_needed] = -1
                    self._drop_window_pages(cache, lg.layer_group_id, sink_blocks, released)

    def _close(self, cache: KVCache) -> None:
        with self._lock:
            for g, blocks in enumerate(cache._blocks):
                self._release(g, blocks)
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
            self._pools = [[] for _ in self._pools]

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
