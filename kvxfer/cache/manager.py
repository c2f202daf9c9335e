"""KVCacheManager: owns the pools and slot allocators, hands out KVCaches, publishes the layout."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache import tiers as tier_storage
from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.common import (
    GPU_LEVEL,
    CacheLevel,
    CacheTier,
    DataRole,
    LayerGroupId,
    LayerId,
    LifeCycleId,
    MemAddress,
    PageIndexConverter,
    PageIndexMode,
    PlannedDropHandle,
    PoolGroupIndex,
    div_up,
    exact_div,
)
from kvxfer.cache.config import CacheConfig, DiskTier, HostTier, PrimaryTier
from kvxfer.cache.copy_engine import CopyEngine
from kvxfer.cache.descriptors import AggregatedPageDesc, BufferId, CacheLayoutDesc, PoolDesc
from kvxfer.cache.dtypes import torch_dtype
from kvxfer.cache.event_forwarding import ReferenceEventForwarder
from kvxfer.cache.events import AllCleared, Created, EventQueue, KVEvent, layer_group_subset
from kvxfer.cache.hashing import ExtraKeys, ReuseScope, block_keys, check_extra_keys, resolve_hash_algo
from kvxfer.cache.kv_cache import CacheState, KVCache, PriorityCallback, _as_tokens
from kvxfer.cache.layout import place_layout, plan_layout
from kvxfer.cache.manager_config import (
    EXTRA_REUSE_MATCH_BACKOFF,
    KVCacheManagerConfig,
    cache_config_of,
    copy_config,
    manager_config_of,
)
from kvxfer.cache.memory import MemoryRegion, allocate_pool
from kvxfer.cache.pins import PinnedPages
from kvxfer.cache.prefix_reuse import PrefixReuse, _check_scope
from kvxfer.cache.radix_tree import BlockNode, PrefixTree
from kvxfer.cache.stats import (
    ReusedBlocksByLevel,
    SsmSnapshotIterationStatsDelta,
    StatsCollector,
    StorageStatistics,
    TierTrafficCounter,
)
from kvxfer.cache.streams import SlotReadiness, TorchStreamOps
from kvxfer.cache.tiers import DiskTierStorage, MemoryTierStorage, TierStorage, primary_tier_of
from kvxfer.errors import CacheStateError, ConfigError, LayoutError, ManagerBusyError, TierError

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]
TokenArray = npt.NDArray[np.int64]

_log = logging.getLogger(__name__)
#: What a failed host-tier set-up raises (pinned or plain allocation failures); the manager then runs
#: without a host tier, keeping its disk tier.
HOST_TIER_SETUP_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, MemoryError, OSError)

#: Medium names of the colder tiers in events (the primary tier is "GPU" or "CPU").
HOST_MEDIUM = "CPU"
DISK_MEDIUM = "DISK"


class KVCacheManager(PrefixReuse):
    """A paged KV-cache manager over real torch memory, with optional colder tiers (host, disk).

    Other stages see it only through ``layout`` (a CacheLayoutDesc), ``memory_regions()`` and the
    block ids of each KVCache. A page is locked while an ACTIVE request holds it (it stays in the
    primary tier), held while only suspended requests (and maybe the prefix tree) hold it (it may be
    offloaded, never dropped), droppable when only the prefix tree holds it.
    """

    def __init__(self, config: KVCacheManagerConfig | CacheConfig, event_manager: Any | None = None,
                 cold_page_codec: Any | None = None) -> None:
        if cold_page_codec is not None:
            raise ConfigError("KVCacheManager: cold_page_codec is not supported (kvxfer keeps cold pages as "
                              "they are in the primary tier)")
        if isinstance(config, CacheConfig):
            self._init_config = manager_config_of(config)
        else:
            self._init_config = copy_config(config) if isinstance(config, KVCacheManagerConfig) else config
            config = cache_config_of(config)
        #: The configuration the manager was created with (never changes; see ``current_config``).
        self.config = config
        #: Tokens trimmed off the tail of every prefix match (``KVCacheManagerConfig.reuse_match_backoff``).
        self.reuse_match_backoff = int(dict(config.extra).get(EXTRA_REUSE_MATCH_BACKOFF, 0))
        self._event_manager = event_manager
        self._current = config
        self._hash_algo = resolve_hash_algo(config.hash_algo)
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
        self._events = EventQueue(config.event_queue_capacity, sink=None if event_manager is None else
                                  ReferenceEventForwarder(event_manager, self._hash_algo, lambda: self._media))
        self._medium = "GPU" if device.type == "cuda" else "CPU"
        self._has_windows = any(lg.window is not None for lg in self._layout.layer_groups)
        self._caches: dict[str, KVCache] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._shut_down = False
        self._pg_layer_groups = [[lg.layer_group_id for lg in self._layout.layer_groups
                                  if lg.pool_group_index == pg.pool_group_index] for pg in self._layout.pool_groups]
        self._pinned: set[str] = set()   # caches being resumed: their pages are not victims
        self._readiness = SlotReadiness([pg.num_slots for pg in self._layout.pool_groups], TorchStreamOps()) \
            if device.type == "cuda" else None
        self._tiers: list[TierStorage] = [primary_tier_of(self)]
        self._media = [self._medium]
        self._copy: CopyEngine | None = None
        #: Why the configured host tier is missing (its set-up failed; the manager runs without it), or None.
        self.host_tier_error: str | None = None
        kept: list[PrimaryTier | HostTier | DiskTier] = [primary]
        try:
            for tier in config.tiers[1:]:
                if isinstance(tier, HostTier):
                    try:
                        self._tiers.append(tier_storage.open_host_tier(config, tier))
                    except HOST_TIER_SETUP_ERRORS as exc:
                        self.host_tier_error = f"{type(exc).__name__}: {exc}"
                        _log.warning("KVCacheManager: the host tier (%d bytes) could not be set up (%s); running "
                                     "without it", tier.quota_bytes, self.host_tier_error)
                        continue
                    self._media.append(HOST_MEDIUM)
                elif isinstance(tier, DiskTier):
                    self._tiers.append(DiskTierStorage(config, tier))
                    self._media.append(DISK_MEDIUM)
                kept.append(tier)
            if len(self._tiers) > 1:
                self._copy = CopyEngine()
        except BaseException:
            for opened in self._tiers[1:]:
                opened.close()
            raise
        if len(kept) != len(config.tiers):
            self._current = dataclasses.replace(config, tiers=tuple(kept))
        # Per tier and pool group: which slots are tree pages, and the (node, layer group) owning each.
        self._in_tree_t = [self._in_tree] + [
            [np.zeros(pg.num_slots, dtype=bool) for pg in t.layout.pool_groups] for t in self._tiers[1:]]
        self._tree_owner: list[list[dict[int, tuple[BlockNode, int]]]] = [
            [{} for _ in self._layout.pool_groups] for _ in self._tiers]
        self._traffic = TierTrafficCounter(len(self._tiers))
        self._put_created()
        self._page_bytes = [sum(p.slot_bytes for p in pg.pools) for pg in self._layout.pool_groups]
        self._stats = StatsCollector(config.enable_stats, len(self._tiers), len(self._layout.pool_groups))
        self._suspend_resume = [0, 0]
        self._disk_prefetch_blocks = 0
        self._cached_tokens_by_level = [0] * len(self._tiers)
        self._reused_blocks_by_level: dict[LifeCycleId, ReusedBlocksByLevel] = {}
        self._sample_usage()

    # --- published view ---------------------------------------------------------------------

    def get_aggregated_pages(self, buffers: Iterable[BufferId]) -> tuple[AggregatedPageDesc, ...]:
        """The reference design's aggregated pages of ``buffers`` (see ``CacheLayoutDesc.aggregated_pages``)."""
        return self._layout.aggregated_pages(buffers)

    def pin_pages(self, block_ids: Mapping[int, npt.ArrayLike]) -> PinnedPages:
        """Hold one more reference on each primary-tier page ``block_ids`` lists (layer group -> slot ids;
        -1 skipped) until the returned pin is released, so that no page a transfer still reads is freed
        or reused, even when its request lets it go (commit adopting the tree's copy, sliding windows)."""
        with self._lock:
            parts: dict[int, list[IntArray]] = {}
            for lg, ids in block_ids.items():
                check_layer_group(self._layout, lg)
                arr = np.asarray(ids).astype(np.int32).ravel()
                parts.setdefault(self._lg_pool_group[lg], []).append(arr[arr >= 0])
            slots = {pg: np.concatenate(p) for pg, p in parts.items()}
            done: list[int] = []
            try:
                for pg, arr in slots.items():
                    self._allocators[pg].incref(arr)
                    done.append(pg)
            except BaseException:   # all or nothing: the pool groups already pinned are let go again
                for pg in done:
                    self._allocators[pg].decref(slots[pg])
                raise
            return PinnedPages(slots, self._unpin_pages)

    def pin_cache_pages(self, cache: KVCache) -> tuple[dict[int, IntArray], PinnedPages]:
        """``cache``'s block ids now (layer group -> slot ids) and a pin on those pages, taken together:
        another thread may free the request's pages meanwhile (its compute sliding a window, its commit),
        so ids read first and pinned later could name a page already freed."""
        with self._lock:
            ids = cache.block_id_map()
            return ids, self.pin_pages(ids)

    def _unpin_pages(self, slots: Mapping[int, IntArray]) -> None:
        with self._lock:
            for pg, arr in slots.items():
                self._allocators[pg].decref(arr)
            self._sample_usage()

    def memory_regions(self) -> list[MemoryRegion]:
        """One region per primary-tier pool, in (pool group, pool) order: what a transport registers."""
        return [MemoryRegion.of_tensor(t) for group in self._pools for t in group]

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

    def _release(self, layer_group: int, ids: IntArray, tiers: TierArray, stream: Any = None) -> None:
        """Drop one reference on each page ``ids[i]`` (>= 0) of tier ``tiers[i]``; the primary ones
        are stamped with ``stream`` (the releasing request's) first."""
        self._stamp(layer_group, ids, tiers, stream)
        pg = self._lg_pool_group[layer_group]
        live = ids >= 0
        for tier in np.unique(tiers[live]).tolist():
            self._alloc_of(tier, pg).decref(ids[live & (tiers == tier)])

    # --- tiers: placement, eviction across tiers, onboarding ---------------------------------------

    # --- KVCache lifecycle (called by KVCache) ------------------------------------------------
    def create_kv_cache(self, reuse_scope: ReuseScope | None = None,
                        input_tokens: Sequence[int] | npt.ArrayLike | None = None, id: Any = None,
                        custom_priority_callback: PriorityCallback | None = None,
                        expected_prompt_length: int | None = None, text_only: bool | None = None,
                        enable_request_stats: bool = False, *, extra_keys: ExtraKeys | None = None) -> KVCache:
        """A new, suspended KVCache; call ``resume()`` before ``resize``.

        With ``input_tokens`` and prefix reuse enabled, the longest reusable prefix of them within
        ``reuse_scope`` is matched (every token may be reused: a caller that must compute the last
        prompt token's logits passes the prompt without it), less ``reuse_match_backoff``: its pages
        are locked into the cache's first blocks and ``num_committed_tokens`` says how many tokens.
        ``id`` is any hashable (default: a fresh ``"kv-N"``). ``custom_priority_callback(block ordinal,
        life cycle)`` gives the eviction priority of each block the cache commits. ``extra_keys`` maps
        a block index to bytes (e.g. multimodal digests) that enter that block's key.
        ``expected_prompt_length`` (default ``len(input_tokens)``) is the prompt's length: blocks
        allocated inside it count as missed, past it as generation allocations.
        """
        return self._open_cache(reuse_scope, input_tokens, id, holdback=0, extra_keys=extra_keys,
                                expected_prompt_length=expected_prompt_length, priority_callback=custom_priority_callback,
                                text_only=text_only, enable_request_stats=enable_request_stats)

    def create_kv_cache_for_prompt(self, prompt: Sequence[int] | npt.ArrayLike | None = None, id: Any = None, *,
                                   reuse_scope: ReuseScope | None = None, extra_keys: ExtraKeys | None = None,
                                   expected_prompt_length: int | None = None) -> KVCache:
        """kvxfer's prompt-first form of ``create_kv_cache``: the prompt's prefix is reused except its
        last token, whose logits must be computed; ``expected_prompt_length`` defaults to the whole
        prompt (at least ``len(prompt)``)."""
        return self._open_cache(reuse_scope, prompt, id, holdback=1, extra_keys=extra_keys,
                                expected_prompt_length=expected_prompt_length)

    def _open_cache(self, reuse_scope: ReuseScope | None, tokens: Sequence[int] | npt.ArrayLike | None, id: Any,
                    holdback: int, extra_keys: ExtraKeys | None = None, expected_prompt_length: int | None = None,
                    priority_callback: PriorityCallback | None = None, text_only: bool | None = None,
                    enable_request_stats: bool = False) -> KVCache:
        with self._lock:
            if self._shut_down:
                raise ManagerBusyError("create_kv_cache: the manager has been shut down")
            cache_id = id if id is not None else f"kv-{next(self._ids)}"
            try:
                hash(cache_id)
            except TypeError as exc:
                raise ConfigError(f"create_kv_cache: id must be hashable, got {cache_id!r}") from exc
            if cache_id in self._caches:
                raise CacheStateError(f"create_kv_cache: a cache with id {cache_id!r} is already open")
            what = f"create_kv_cache({cache_id})"
            scope = _check_scope(reuse_scope, what)
            extras = check_extra_keys(extra_keys, what)
            arr = None if tokens is None else _as_tokens(tokens, what)
            prompt_length = _check_prompt_length(expected_prompt_length, arr, what)
            cache = KVCache(self, cache_id, arr, scope, extras, expected_prompt_length=prompt_length,
                            swa_scratch_reuse=self.config.swa_scratch_reuse)
            cache.priority_callback = priority_callback
            cache.text_only = bool(self._init_config.text_only if text_only is None else text_only)
            cache.enable_request_stats = bool(enable_request_stats)
            cache.reused_tokens_by_level = [0] * len(self._tiers)
            cache._root_key = scope.root_key_for(self._hash_algo)
            cache._last_used = self._tree.tick()
            if arr is not None and self.config.enable_prefix_reuse:
                cache._prompt_keys = self._keys(cache, arr, cache._root_key)
                plan = self._plan_matching(cache._root_key, cache._prompt_keys, arr, extras, holdback)
                self._lock_reuse(cache, arr, plan)
                self._count_reuse(cache, plan)
                self._count_reused_levels(cache, plan)
            self._caches[cache_id] = cache
            self._sample_usage()
            return cache

    # --- prefix reuse ---------------------------------------------------------------------------

    # --- events and statistics -------------------------------------------------------------------
    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first."""
        with self._lock:
            return self._events.drain()

    def _put_created(self) -> None:
        """Created events: each layer group's slots per tier (one event when all layer groups agree)."""
        counts = [tuple(t.layout.pool_groups[pg].num_slots for t in self._tiers) for pg in self._lg_pool_group]
        if all(c == counts[0] for c in counts):
            self._events.put(Created(tuple(self._media), counts[0]))
            return
        for lg, c in enumerate(counts):
            self._events.put(Created(tuple(self._media), c, layer_group_subset([i == lg for i in range(len(counts))])))

    @property
    def events_dropped(self) -> int:
        """Events dropped because the bounded queue was full."""
        return self._events.dropped

    # --- statistics (the reference design's API) -----------------------------------------------------

    # --- tiers: public view and quotas -----------------------------------------------------------

    # --- streams --------------------------------------------------------------------------------

    # --- KVCache lifecycle (called by KVCache) ---------------------------------------------------
    def _resume(self, cache: KVCache, stream: Any = None) -> bool:
        """Onboard the cache's offloaded pages and copy its partially reused block; False, changing
        nothing, when the primary tier cannot take them. ``stream`` waits for every page's last user."""
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
                if not self._copy_on_write(cache, stream):
                    return False
            finally:
                self._pinned.discard(cache.id)
            self._wait_ready(cache, stream)
            cache._last_used = self._tree.tick()
            self._sample_usage()
            return True

    def _suspend(self, cache: KVCache) -> None:
        with self._lock:
            for g, (blocks, tiers) in enumerate(zip(cache._blocks, cache._tiers, strict=True)):
                self._stamp(g, blocks, tiers, cache._stream)
            self._release_scratch(cache)
            cache._last_used = self._tree.tick()

    def _scratch_span(self, cache: KVCache, layer_group: int, old_n: int, new_n: int, capacity: int) -> tuple[int, int]:
        """Blocks ``[begin, end)`` among the new ones ``[old_n, new_n)`` that get scratch slots: with
        scratch reuse on, those of a sliding-window group already out of the window once history
        reaches ``capacity`` (the same rule ``_release_out_of_window`` frees by)."""
        if not cache._swa_scratch_reuse or self._layout.layer_groups[layer_group].window is None:
            return 0, 0
        lo, sink = self._window_start(layer_group, np.array([capacity], dtype=np.int64))
        begin, end = max(old_n, sink), min(int(lo[0]), new_n)
        return (begin, end) if end > begin else (0, 0)

    def _resize(self, cache: KVCache, capacity: int) -> None:
        with self._lock:
            tpb = self._layout.tokens_per_block
            new_n = math.ceil(capacity / tpb)
            old_n = cache.num_blocks
            n_lg = len(cache._blocks)
            spans = [self._scratch_span(cache, g, old_n, new_n, capacity) if new_n > old_n else (0, 0)
                     for g in range(n_lg)]
            if new_n > old_n:
                needs: dict[int, int] = {}
                for g, (begin, end) in enumerate(spans):
                    pg = self._lg_pool_group[g]
                    extra_scratch = max(0, (end - begin) - cache._scratch[g].size)
                    needs[pg] = needs.get(pg, 0) + (new_n - old_n) - (end - begin) + extra_scratch
                self._reserve(needs)
                for g, (begin, end) in enumerate(spans):
                    alloc = self._allocators[self._lg_pool_group[g]]
                    fresh = np.full(new_n - old_n, -1, dtype=np.int32)
                    real = np.ones(new_n - old_n, dtype=bool)
                    real[begin - old_n:end - old_n] = False
                    fresh[real] = alloc.alloc(int(np.count_nonzero(real)))
                    cache._blocks[g] = np.concatenate([cache._blocks[g], fresh])
                    cache._tiers[g] = np.concatenate([cache._tiers[g], np.zeros(new_n - old_n, dtype=np.int8)])
                    self._set_scratch(cache, g, begin, end)
                    self._wait_slots(g, fresh, cache._stream)
                self._count_allocation(cache, old_n, new_n, spans)
            else:
                if new_n < old_n:
                    self._uncount_allocation(cache, new_n, old_n)
                    for g in range(n_lg):
                        self._release(g, cache._blocks[g][new_n:], cache._tiers[g][new_n:], cache._stream)
                        cache._blocks[g] = cache._blocks[g][:new_n].copy()
                        cache._tiers[g] = cache._tiers[g][:new_n].copy()
                self._release_scratch(cache)
            self._sample_usage()

    def _set_scratch(self, cache: KVCache, layer_group: int, begin: int, end: int) -> None:
        """Hold exactly ``end - begin`` scratch slots for a layer group (reusing those held) and record
        the range they stand in for; the slots needed were reserved by the caller."""
        held = cache._scratch[layer_group]
        want = end - begin
        if want > held.size:
            more = self._allocators[self._lg_pool_group[layer_group]].alloc(want - held.size)
            self._wait_slots(layer_group, more, cache._stream)
            held = np.concatenate([held, more])
        elif want < held.size:
            surplus = held[want:]
            self._release(layer_group, surplus, np.zeros(surplus.size, dtype=np.int8), cache._stream)
            held = held[:want].copy()
        cache._scratch[layer_group] = held
        cache._scratch_range[layer_group] = (begin, end) if want else (0, 0)

    def _release_scratch(self, cache: KVCache) -> None:
        """Give back every scratch slot of the cache."""
        for g in range(len(cache._scratch)):
            if cache._scratch[g].size:
                self._set_scratch(cache, g, 0, 0)

    def _set_scratch_reuse(self, cache: KVCache, enable: bool) -> None:
        with self._lock:
            if not enable and any(end > begin for begin, end in cache._scratch_range):
                raise CacheStateError(f"KVCache {cache.id}: cannot disable SWA scratch reuse while the current "
                                      f"step uses scratch slots (resize first)")
            if not enable:
                self._release_scratch(cache)

    def _on_commit(self, cache: KVCache, priority: int | None = None) -> None:
        with self._lock:
            done, full = cache._published_blocks, cache.num_committed_tokens // self._layout.tokens_per_block
            if full > done:   # pages others may now reuse: ready once this request's writes are
                for g, (blocks, tiers) in enumerate(zip(cache._blocks, cache._tiers, strict=True)):
                    self._stamp(g, blocks[done:full], tiers[done:full], cache._stream)
                cache._published_blocks = full
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
                    self._release(lg.layer_group_id, released, released_tiers, cache._stream)
                    blocks[sink_blocks:first_needed] = -1
                    self._drop_window_pages(cache, lg.layer_group_id, sink_blocks, released, released_tiers)

    def _close(self, cache: KVCache) -> None:
        with self._lock:
            for g, (blocks, tiers) in enumerate(zip(cache._blocks, cache._tiers, strict=True)):
                self._release(g, blocks, tiers, cache._stream)
            self._release_scratch(cache)
            self._caches.pop(cache.id, None)
            self._touch_blocks(cache, 0, len(cache._tree_nodes))
            if cache._partial_src is not None:
                self._tree.touch(cache._partial_src)
                cache._partial_src = None
            self._stats.commit(cache.id, cache._pending)
            self._sample_usage()

    # --- manager lifecycle --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release all memory; refuses while caches are open."""
        with self._lock:
            if self._shut_down:
                return
            self._refuse_open("shutdown()")
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

    # --- the reference design's manager API -----------------------------------------------------
    @property
    def init_config(self) -> KVCacheManagerConfig:
        """The reference configuration the manager was created with (built from a CacheConfig when
        that was given)."""
        return self._init_config

    @property
    def event_manager(self) -> Any | None:
        """The event manager the manager forwards its events to (None: events are only drained)."""
        return self._event_manager

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block."""
        return self._layout.tokens_per_block

    @property
    def cache_tier_list(self) -> tuple[CacheTier, ...]:
        """The medium of each cache level in force, primary first."""
        kinds = {PrimaryTier: CacheTier.GPU_MEM, HostTier: CacheTier.HOST_MEM, DiskTier: CacheTier.DISK}
        return tuple(kinds[type(t)] for t in self._current.tiers)

    @property
    def allow_seq_rebasing(self) -> bool:
        """Whether a request's committed blocks may be swapped for identical tree blocks (kvxfer adopts
        the tree's copy of a block a request commits when one exists)."""
        return self.config.enable_prefix_reuse

    @property
    def enable_partial_match(self) -> bool:
        """Whether a prefix match may end inside a block."""
        return self.config.enable_partial_reuse

    @property
    def commit_min_snapshot(self) -> bool:
        """``KVCacheManagerConfig.commit_min_snapshot`` (kvxfer keeps only attention pages)."""
        return self._init_config.commit_min_snapshot

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """Both page index modes are supported."""
        return mode in (PageIndexMode.SHARED, PageIndexMode.PER_LAYER)

    @property
    def num_layers(self) -> int:
        """Layers the manager keeps."""
        return sum(len(lg.layer_ids) for lg in self._layout.layer_groups)

    @property
    def layer_ids(self) -> Iterator[LayerId]:
        """Every layer id, ascending."""
        return iter(sorted(LayerId(i) for lg in self._layout.layer_groups for i in lg.layer_ids))

    def get_layer_group_id(self, layer_id: LayerId) -> LayerGroupId:
        """The layer group (life cycle) of a layer."""
        for lg in self._layout.layer_groups:
            if layer_id in lg.layer_ids:
                return LayerGroupId(lg.layer_group_id)
        raise LayoutError(f"get_layer_group_id: no layer {layer_id} in this manager")

    @property
    def layer_grouping(self) -> tuple[tuple[LayerId, ...], ...]:
        """The layer ids of each layer group, in layer group order."""
        return tuple(tuple(LayerId(i) for i in lg.layer_ids) for lg in self._layout.layer_groups)

    @property
    def all_buffer_ids(self) -> Iterator[BufferId]:
        """Every (layer, role) buffer, by layer then role order."""
        return iter(bid for bid, _ in self._layout.formats)

    def _span(self, layer_id: LayerId, data_role: DataRole) -> tuple[PoolDesc, int, int]:
        pg, pool, span = self._layout.locate(BufferId(int(layer_id), str(data_role)))
        del pg
        return pool, span.offset, span.size

    def get_mem_pool_base_address(self, layer_id: LayerId, data_role: DataRole,
                                  index_mode: PageIndexMode | None = None) -> MemAddress:
        """Where page 0 of a buffer is: the buffer inside slot 0 (``PER_LAYER``, the default) or the
        pool's base (``SHARED``, every buffer of the pool indexing from it)."""
        pool, offset, _ = self._span(layer_id, data_role)
        if index_mode is PageIndexMode.SHARED:
            return MemAddress(pool.base_address)
        return MemAddress(pool.base_address + offset)

    def get_page_stride(self, layer_id: LayerId, data_role: DataRole) -> int:
        """Bytes of one page of a buffer (its bytes per block)."""
        return self._span(layer_id, data_role)[2]

    def get_page_index_scale(self, layer_id: LayerId, data_role: DataRole) -> int:
        """Pages of the buffer's stride in one slot of its pool: page index = slot id * scale."""
        pool, _, size = self._span(layer_id, data_role)
        return exact_div(pool.slot_bytes, size)

    def get_page_index_upper_bound(self, layer_id: LayerId, data_role: DataRole) -> int:
        """One past the largest page index of a buffer."""
        pool, _, _ = self._span(layer_id, data_role)
        return pool.num_slots * self.get_page_index_scale(layer_id, data_role)

    def get_page_index_converter(self, layer_id: LayerId, data_role: DataRole) -> PageIndexConverter:
        """Turns base page indices of the buffer's layer group into page indices of the buffer."""
        _, offset, size = self._span(layer_id, data_role)
        return PageIndexConverter(self.get_page_index_scale(layer_id, data_role), 1, exact_div(offset, size))

    def probe_reuse(self, reuse_scope: ReuseScope | None = None,
                    input_tokens: Sequence[int] | npt.ArrayLike | None = None, *,
                    extra_keys: ExtraKeys | None = None) -> int:
        """How many of ``input_tokens`` ``create_kv_cache(reuse_scope, input_tokens)`` would reuse now;
        takes nothing (no page, no LRU update, no statistics)."""
        return self._probe(reuse_scope, input_tokens, extra_keys, holdback=0, what="probe_reuse")

    def probe_first_new_block_key(self, reuse_scope: ReuseScope | None = None,
                                  input_tokens: Sequence[int] | npt.ArrayLike | None = None) -> bytes | None:
        """The key of the first full block of ``input_tokens`` that the prefix tree lacks (None: every
        full block is there, or there is none)."""
        with self._lock:
            scope = _check_scope(reuse_scope, "probe_first_new_block_key")
            if input_tokens is None:
                return None
            arr = _as_tokens(input_tokens, "probe_first_new_block_key")
            root = scope.root_key_for(self._hash_algo)
            keys = block_keys(arr, self._layout.tokens_per_block, root, algo=self._hash_algo, scope=scope)
            matched = len(self._tree.match(root, keys).nodes)
            return keys[matched] if matched < len(keys) else None

    def clear_reusable_blocks(self) -> None:
        """Drop every block of the prefix tree; LogicError while any KV cache is open."""
        with self._lock:
            self._refuse_open("clear_reusable_blocks()")
            self._clear_tree(list(self._tree.nodes()))
            self._events.put(AllCleared())
            self._sample_usage()

    def _refuse_open(self, what: str) -> None:
        open_ids = [c.id for c in self._caches.values() if c.state is not CacheState.CLOSED]
        if open_ids:
            raise ManagerBusyError(f"{what}: {len(open_ids)} KV cache(s) still open: {open_ids[:5]}")

    def resize(self, cache_level: CacheLevel, quota: int, best_efforts: bool = False) -> bool:
        """Give a cache level a new byte quota (see ``resize_quota``); False, changing nothing, when it
        cannot be done now (an active request, or held pages with no room). ``best_efforts`` is
        accepted for the reference's signature: kvxfer's resize is all or nothing."""
        del best_efforts
        try:
            self.resize_quota(int(cache_level), quota)
        except (ManagerBusyError, TierError):
            return False
        return True

    def get_quota(self, cache_level: CacheLevel) -> int:
        """The byte quota of a cache level in force."""
        self._check_tier_index(int(cache_level))
        return self._current.tiers[int(cache_level)].quota_bytes

    def get_storage_statistics(self, cache_level: CacheLevel = GPU_LEVEL) -> list[StorageStatistics]:
        """Slot counts of each pool group at a cache level."""
        with self._lock:
            self._check_tier_index(int(cache_level))
            out = []
            for pg in range(len(self._layout.pool_groups)):
                acc = self.slot_accounting(pg, int(cache_level))
                sizes = list(self._tiers[int(cache_level)].layout.pool_groups[pg].slot_desc.slot_size_list)
                out.append(StorageStatistics(sizes, acc.total, acc.free, acc.evictable))
            return out

    def get_life_cycle_pool_group_indices(self, cache_level: CacheLevel = GPU_LEVEL) -> list[PoolGroupIndex]:
        """The pool group of each layer group (life cycle), in layer group order."""
        self._check_tier_index(int(cache_level))
        return [PoolGroupIndex(pg) for pg in self._lg_pool_group]

    def get_and_reset_ssm_snapshot_iteration_stats(self) -> dict[LifeCycleId, SsmSnapshotIterationStatsDelta]:
        """Per-life-cycle SSM snapshot counters: always empty (no SSM layers in kvxfer)."""
        return {}

    def record_request_suspended(self) -> None:
        """Count a request suspension in this iteration's counters."""
        with self._lock:
            self._suspend_resume[0] += 1

    def record_request_resumed(self) -> None:
        """Count a request resumption in this iteration's counters."""
        with self._lock:
            self._suspend_resume[1] += 1

    def get_and_reset_iteration_suspend_resume_stats(self) -> tuple[int, int]:
        """(suspensions, resumptions) recorded since the last call."""
        with self._lock:
            out = (self._suspend_resume[0], self._suspend_resume[1])
            self._suspend_resume = [0, 0]
            return out

    def get_and_reset_iteration_disk_prefetch_blocks(self) -> int:
        """Pages prefetched out of the disk level since the last call."""
        with self._lock:
            out, self._disk_prefetch_blocks = self._disk_prefetch_blocks, 0
            return out

    def get_and_reset_iteration_cached_tokens_by_level(self) -> list[int]:
        """Reused tokens of the caches created since the last call, by the level their pages were at."""
        with self._lock:
            out = self._cached_tokens_by_level
            self._cached_tokens_by_level = [0] * len(self._tiers)
            return out

    def get_and_reset_iteration_reused_blocks_by_level(self) -> dict[LifeCycleId, ReusedBlocksByLevel]:
        """Reused blocks (full and partial) per layer group and level since the last call."""
        with self._lock:
            out = self._reused_blocks_by_level
            self._reused_blocks_by_level = {}
            return out

    def _count_reused_levels(self, cache: KVCache, plan: Any) -> None:
        """Record where the reused pages of a new cache were: per block, the coldest level among its
        layer groups' pages (what resuming has to fetch from)."""
        if plan.num_tokens == 0:
            return
        tpb = self._layout.tokens_per_block
        full = len(plan.nodes)
        levels = len(self._tiers)
        for b in range(plan.pages.shape[0]):
            live = plan.pages[b] >= 0
            level = int(plan.tiers[b][live].max()) if live.any() else 0
            tokens = min(tpb, plan.num_tokens - b * tpb)
            cache.reused_tokens_by_level[level] += tokens
            self._cached_tokens_by_level[level] += tokens
            for lg in np.flatnonzero(live).tolist():
                rec = self._reused_blocks_by_level.setdefault(
                    LifeCycleId(lg), ReusedBlocksByLevel([0] * levels, [0] * levels))
                (rec.full if b < full else rec.partial)[int(plan.tiers[b][lg])] += 1

    def clamp_max_seq_len_for_mem(self, batch_size: int, token_num_upper_bound: int) -> int:
        """The longest sequence (at most ``token_num_upper_bound``) of which ``batch_size`` fit in the
        primary level at once, counting each layer group's window and sink blocks."""
        if batch_size <= 0:
            raise ConfigError(f"clamp_max_seq_len_for_mem: batch_size must be > 0, got {batch_size}")
        tpb = self._layout.tokens_per_block

        def fits(seq_len: int) -> bool:
            for pg, alloc in enumerate(self._allocators):
                need = 0
                for lg in self._pg_layer_groups[pg]:
                    desc = self._layout.layer_groups[lg]
                    blocks = div_up(seq_len, tpb)
                    if desc.window is not None:
                        blocks = min(blocks, div_up(desc.window, tpb) + 1 + div_up(desc.sink_tokens, tpb))
                    need += blocks
                if need * batch_size > alloc.usable:
                    return False
            return True

        lo, hi = 0, max(0, int(token_num_upper_bound))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def need_adjustment(self) -> bool:
        """Whether ``adjust()`` would change the pool split: never, kvxfer's split changes only by
        ``rebalance_slots`` or ``resize``."""
        return False

    def adjust(self) -> None:
        """Apply a pending pool re-split; with ``need_adjustment`` always False there is none to apply."""
        return None

    def _plan_drop(self, cache: KVCache) -> PlannedDropHandle | None:
        nodes = [n for n in cache._tree_nodes if n is not None]
        if not nodes:
            return None
        return PlannedDropHandle(lambda: self._drop_chain(nodes))

    def _drop_chain(self, nodes: list[BlockNode]) -> None:
        """Take a chain's blocks out of the tree from its end back, while each is a leaf that only the
        tree holds (a block another chain continues, or a request shares, stays)."""
        with self._lock:
            victims: list[BlockNode] = []
            flat_pages: list[int] = []
            flat_tiers: list[int] = []
            for node in reversed(nodes):
                if node.removed or not node.is_leaf or not self._tree_only(node):
                    break
                self._tree.remove(node)
                victims.append(node)
                flat_pages.extend(node.pages.tolist())
                flat_tiers.extend(int(t) for t in node.tiers.tolist())
            self._evict_all(victims, flat_pages, flat_tiers)
            self._sample_usage()

    def _prefetch(self, cache: KVCache, target: int) -> bool:
        """Move a cache's pages in levels colder than ``target`` up to ``target``; False when that level
        has no room for them (pages already moved stay)."""
        with self._lock:
            self._check_tier_index(target)
            if target == 0:
                return cache.state is CacheState.ACTIVE or self._resume(cache, cache._stream)
            for pg, by_tier in self._offloaded_pages(cache).items():
                colder = {t: src for t, src in by_tier.items() if t > target}
                n = sum(src.size for src in colder.values())
                if not n:
                    continue
                alloc = self._alloc_of(target, pg)
                if alloc.num_free < n:
                    self._make_room_in(target, pg, n - alloc.num_free)
                colder = {t: src for t, src in self._offloaded_pages(cache).get(pg, {}).items() if t > target}
                n = sum(src.size for src in colder.values())
                if alloc.num_free < n:
                    return False
                jobs = [(t, src, target, alloc.alloc(src.size)) for t, src in sorted(colder.items())]
                self._copy_pages(pg, jobs)
                for t, src, _, dst in jobs:
                    self._relocate(pg, t, src, target, dst)
                    if isinstance(self._tiers[t], DiskTierStorage):
                        self._disk_prefetch_blocks += int(src.size)
            return True

    def __repr__(self) -> str:
        pgs = ", ".join(f"pg{i}: {a.num_used}/{a.num_slots} used" for i, a in enumerate(self._allocators))
        return f"KVCacheManager(device={self.device}, {pgs})"


def _check_prompt_length(length: int | None, tokens: TokenArray | None, what: str) -> int | None:
    """The prompt length a cache counts its allocations against: ``length`` (checked: an int no
    smaller than the tokens given) or the number of tokens given."""
    if length is None:
        return None if tokens is None else int(tokens.size)
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 0:
        raise ConfigError(f"{what}: expected_prompt_length must be an int >= 0, got {length!r}")
    if tokens is not None and length < tokens.size:
        raise ConfigError(f"{what}: expected_prompt_length={length} is shorter than the {tokens.size} prompt "
                          f"tokens given")
    return int(length)


def check_layer_group(layout: CacheLayoutDesc, layer_group: int) -> None:
    """Raise LayoutError when ``layer_group`` is not a layer group of ``layout``."""
    if not 0 <= layer_group < len(layout.layer_groups):
        raise LayoutError(f"no layer group {layer_group} (have 0..{len(layout.layer_groups) - 1})")
