"""KVCacheManager: a facade over the manager's state and parts (see ``ManagerParts``) that hands out
KVCaches, publishes the layout and speaks the reference design's API (docs/architecture.md)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache import tiers as tier_storage
from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.cache_lifecycle import CacheLifecycle
from kvxfer.cache.common import (
    GPU_LEVEL,
    CacheLevel,
    CacheTier,
    DataRole,
    LayerGroupId,
    LayerId,
    LifeCycleId,
    LifeCycleRegistry,
    MemAddress,
    PageIndexConverter,
    PageIndexMode,
    PoolGroupIndex,
    div_up,
    exact_div,
)
from kvxfer.cache.config import (
    CacheConfig,
    DiskTier,
    HostTier,
    PrimaryTier,
    cache_config_of,
    manager_config_of,
)
from kvxfer.cache.copy_engine import CopyEngine
from kvxfer.cache.descriptors import AggregatedPageDesc, BufferId, CacheLayoutDesc, PoolDesc, PoolGroupDesc
from kvxfer.cache.dtypes import torch_dtype
from kvxfer.cache.event_forwarding import ReferenceEventForwarder
from kvxfer.cache.events import AllCleared, EventQueue, KVEvent
from kvxfer.cache.eviction import EvictionController
from kvxfer.cache.hashing import (
    DigestTable,
    ExtraKeys,
    ReuseScope,
    TokenIdExt,
    block_keys,
    resolve_hash_algo,
)
from kvxfer.cache.kv_cache import CacheState, KVCache, PriorityCallback
from kvxfer.cache.layout import check_placed, place_layout, plan_layout
from kvxfer.cache.manager_config import (
    EXTRA_POOL_RATIO,
    EXTRA_REUSE_MATCH_BACKOFF,
    KVCacheManagerConfig,
    copy_config,
)
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.memory import MemoryRegion, allocate_pool
from kvxfer.cache.page_movement import PageMovement
from kvxfer.cache.pins import PinnedPages
from kvxfer.cache.pool_ratio import check_batch, check_initial_pool_ratio, planner_for
from kvxfer.cache.pool_tuner import PoolTuner
from kvxfer.cache.prefix_reuse import PrefixReuse, check_scope
from kvxfer.cache.radix_tree import PrefixTree
from kvxfer.cache.recurrent import RecurrentStates
from kvxfer.cache.scratch import layer_pages_per_block
from kvxfer.cache.stats import (
    KVCacheIterationStatsDelta,
    KVCacheStatsDelta,
    PoolGroupPeakBlockStats,
    ReusedBlocksByLevel,
    SlotAccounting,
    SsmSnapshotIterationStatsDelta,
    StatsCollector,
    StorageStatistics,
    TierTraffic,
    TierTrafficCounter,
)
from kvxfer.cache.stream_ordering import StreamOrdering
from kvxfer.cache.streams import SlotReadiness, TorchStreamOps
from kvxfer.cache.tier_quotas import TierQuotas
from kvxfer.cache.tiers import DiskTierStorage, MemoryTierStorage, TierStats, primary_tier_of
from kvxfer.cache.usage_stats import UsageStats
from kvxfer.errors import (
    ConfigError,
    LayoutError,
    ManagerBusyError,
    TierError,
)

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


class ManagerParts:
    """The manager's parts, each behind its public interface: stream ordering, page movement between
    slots and tiers, eviction, usage statistics, tier quotas, prefix reuse (the radix tree) and the kv
    caches' life cycle. Every part reaches the shared state and the others through this."""

    def __init__(self, manager: KVCacheManager, state: ManagerState) -> None:
        self.manager = manager
        self.streams = StreamOrdering(state, self)
        self.movement = PageMovement(state, self)
        self.eviction = EvictionController(state, self)
        self.usage = UsageStats(state, self)
        self.quotas = TierQuotas(state, self)
        self.reuse = PrefixReuse(state, self)
        self.recurrent = RecurrentStates(state, self)
        self.lifecycle = CacheLifecycle(state, self)
        self.tuner = PoolTuner(state, self)


class KVCacheManager:
    """A paged KV-cache manager over real torch memory, with optional colder tiers (host, disk).

    Other stages see it only through ``layout`` (a CacheLayoutDesc), ``memory_regions()`` and the
    block ids of each KVCache. A page is locked while an ACTIVE request holds it (it stays in the
    primary tier), held while only suspended requests (and maybe the prefix tree) hold it (it may be
    offloaded, never dropped), droppable when only the prefix tree holds it.
    """

    def __init__(self, config: KVCacheManagerConfig | CacheConfig, event_manager: Any | None = None,
                 cold_page_codec: Any | None = None) -> None:
        self._state = ManagerState()
        self._parts = ManagerParts(self, self._state)
        # Page index converters by (layer, role), for the layout they were made from (a new layout
        # object, e.g. after a primary quota change, starts afresh).
        self._converters: dict[tuple[Any, ...], PageIndexConverter] = {}
        self._converters_layout: Any = None
        if cold_page_codec is not None:
            raise ConfigError("KVCacheManager: cold_page_codec is not supported (kvxfer keeps cold pages as "
                              "they are in the primary tier)")
        if isinstance(config, CacheConfig):
            self._state.init_config = manager_config_of(config)
        else:
            self._state.init_config = copy_config(config) if isinstance(config, KVCacheManagerConfig) else config
            config = cache_config_of(config)
        #: The configuration the manager was created with (never changes; see ``current_config``).
        self._state.config = config
        #: Tokens trimmed off the tail of every prefix match (``KVCacheManagerConfig.reuse_match_backoff``).
        self._state.reuse_match_backoff = int(dict(config.extra).get(EXTRA_REUSE_MATCH_BACKOFF, 0))
        self._state.event_manager = event_manager
        self._state.current = config
        self._state.key_algo = resolve_hash_algo(config.hash_algo)
        self._state.digests = DigestTable()
        primary = config.primary
        plan = plan_layout(config)
        init_cfg = self._state.init_config
        check_initial_pool_ratio(getattr(init_cfg, "initial_pool_ratio", None), len(plan.layer_groups))
        #: Slot counts per pool group by ratio (``pool_ratio``); the tuner re-splits with the same planner.
        scratch_cfg = getattr(init_cfg, "swa_scratch_reuse", None)
        self._state.planner = planner_for(config, plan, list(getattr(init_cfg, "constraints", None) or []),
                                          None if scratch_cfg is None else int(scratch_cfg.max_rewind_len),
                                          float(config.resume_max_utilization))
        # The ratio every colder tier starts with (a ``KVCacheManagerConfig`` manager's initial ratio, as
        # the reference sizes every level by it), or None (a ``CacheConfig`` manager: equal slots).
        colder_ratio: list[float] | None = None
        if dict(config.extra).get(EXTRA_POOL_RATIO):
            granularity = self._state.planner.granularity(primary.quota_bytes)
            colder_ratio = self._state.planner.initial_ratio(init_cfg, granularity)
            plan = plan_layout(config, num_slots=self._state.planner.slot_counts(
                primary.quota_bytes, colder_ratio, granularity))
        planned = sum(pool.nbytes for pg in plan.pool_groups for pool in pg.pools)
        if planned > primary.quota_bytes:     # slot floors raised the primary level past its quota
            self._state.current = dataclasses.replace(
                config, tiers=(dataclasses.replace(primary, quota_bytes=planned), *config.tiers[1:]))
        device = torch.device(primary.device)
        self._state.device = device
        self._state.pools = [
            [allocate_pool(pool.nbytes, primary.device) for pool in pg.pools] for pg in plan.pool_groups]
        if device.type == "cuda":   # the zero fill runs on this thread's stream, which a request's stream
            torch.cuda.current_stream(device).synchronize()   # (non-blocking) is not ordered after
        kind = "cuda" if device.type == "cuda" else "cpu"
        bases = [[int(t.data_ptr()) for t in group] for group in self._state.pools]
        self._state.layout = place_layout(plan, bases, kind, int(device.index or 0))
        check_placed(self._state.layout, self._state.pools)
        self._state.allocators = [SlotAllocator(pg.num_slots, f"pool group {pg.pool_group_index}")
                            for pg in self._state.layout.pool_groups]
        self._state.lg_pool_group = [lg.pool_group_index for lg in self._state.layout.layer_groups]
        self._state.tree = PrefixTree(len(self._state.layout.layer_groups), self._state.layout.tokens_per_block)
        self._state.in_tree = [np.zeros(pg.num_slots, dtype=bool) for pg in self._state.layout.pool_groups]
        self._state.events = EventQueue(config.event_queue_capacity, sink=None if event_manager is None else
                                  ReferenceEventForwarder(event_manager, self._state.key_algo, lambda: self._state.media,
                                                          decode=self._state.digests.key_tokens,
                                                          num_layer_groups=len(self._state.layout.layer_groups)))
        self._state.medium = "GPU" if device.type == "cuda" else "CPU"
        self._state.has_windows = any(lg.window is not None for lg in self._state.layout.layer_groups)
        self._state.recurrent_groups = [lg.layer_group_id for lg in self._state.layout.layer_groups if lg.recurrent]
        self._state.recurrent_pool_groups = {
            pg.pool_group_index for pg in self._state.layout.pool_groups
            if all(self._state.layout.layer_groups[g].recurrent for g in pg.layer_group_ids)}
        self._state.planned_drops = {}
        self._state.caches = weakref.WeakValueDictionary()
        self._state.dropped = []
        self._state.ids = itertools.count()
        self._state.lock = threading.RLock()
        self._state.shut_down = False
        self._state.pg_layer_groups = [[lg.layer_group_id for lg in self._state.layout.layer_groups
                                  if lg.pool_group_index == pg.pool_group_index] for pg in self._state.layout.pool_groups]
        self._state.pinned = set()   # caches being resumed: their pages are not victims
        self._state.readiness = SlotReadiness([pg.num_slots for pg in self._state.layout.pool_groups], TorchStreamOps()) \
            if device.type == "cuda" else None
        self._state.tiers = [primary_tier_of(self)]
        self._state.media = [self._state.medium]
        self._state.copier = None
        #: Why the configured host tier is missing (its set-up failed; the manager runs without it), or None.
        self._state.host_tier_error = None
        kept: list[PrimaryTier | HostTier | DiskTier] = [primary]
        try:
            for tier in config.tiers[1:]:
                counts = None if colder_ratio is None else self._state.planner.slot_counts(
                    tier.quota_bytes, colder_ratio, 1)
                if isinstance(tier, HostTier):
                    try:
                        self._state.tiers.append(tier_storage.open_host_tier(config, tier, counts))
                    except HOST_TIER_SETUP_ERRORS as exc:
                        self._state.host_tier_error = f"{type(exc).__name__}: {exc}"
                        _log.warning("KVCacheManager: the host tier (%d bytes) could not be set up (%s); running "
                                     "without it", tier.quota_bytes, self._state.host_tier_error)
                        continue
                    self._state.media.append(HOST_MEDIUM)
                elif isinstance(tier, DiskTier):
                    self._state.tiers.append(DiskTierStorage(config, tier, num_slots=counts))
                    self._state.media.append(DISK_MEDIUM)
                kept.append(tier)
            if len(self._state.tiers) > 1:
                self._state.copier = CopyEngine()
        except BaseException:
            for opened in self._state.tiers[1:]:
                opened.close()
            raise
        if len(kept) != len(config.tiers):
            self._state.current = dataclasses.replace(config, tiers=tuple(kept))
        # Per tier and pool group: which slots are tree pages, and the (node, layer group) owning each.
        self._state.in_tree_t = [self._state.in_tree] + [
            [np.zeros(pg.num_slots, dtype=bool) for pg in t.layout.pool_groups] for t in self._state.tiers[1:]]
        self._state.tree_owner = [
            [{} for _ in self._state.layout.pool_groups] for _ in self._state.tiers]
        self._state.traffic = TierTrafficCounter(len(self._state.tiers))
        self._parts.lifecycle.put_created()
        self._state.page_bytes = [sum(p.slot_bytes for p in pg.pools) for pg in self._state.layout.pool_groups]
        self._state.stats = StatsCollector(config.enable_stats, len(self._state.tiers), len(self._state.layout.pool_groups))
        self._state.suspend_resume = [0, 0]
        self._state.disk_prefetch_blocks = 0
        self._state.cached_tokens_by_level = [0] * len(self._state.tiers)
        self._state.reused_blocks_by_level = {}
        self._parts.usage.sample_usage()
        self._parts.tuner.start()

    # --- published view ---------------------------------------------------------------------

    def get_aggregated_pages(self, buffers: Iterable[BufferId]) -> tuple[AggregatedPageDesc, ...]:
        """The reference design's aggregated pages of ``buffers`` (see ``CacheLayoutDesc.aggregated_pages``)."""
        return self._state.layout.aggregated_pages(buffers)

    def pin_pages(self, block_ids: Mapping[int, npt.ArrayLike]) -> PinnedPages:
        """Hold one more reference on each primary-tier page ``block_ids`` lists (layer group -> slot ids;
        -1 skipped) until the returned pin is released, so that no page a transfer still reads is freed
        or reused, even when its request lets it go (commit adopting the tree's copy, sliding windows)."""
        with self._state.lock:
            parts: dict[int, list[IntArray]] = {}
            for lg, ids in block_ids.items():
                check_layer_group(self._state.layout, lg)
                arr = np.asarray(ids).astype(np.int32).ravel()
                parts.setdefault(self._state.lg_pool_group[lg], []).append(arr[arr >= 0])
            slots = {pg: np.concatenate(p) for pg, p in parts.items()}
            done: list[int] = []
            try:
                for pg, arr in slots.items():
                    self._state.allocators[pg].incref(arr)
                    done.append(pg)
            except BaseException:   # all or nothing: the pool groups already pinned are let go again
                for pg in done:
                    self._state.allocators[pg].decref(slots[pg])
                raise
            return PinnedPages(slots, self._parts.lifecycle.unpin_pages)

    def pin_cache_pages(self, cache: KVCache) -> tuple[dict[int, IntArray], PinnedPages]:
        """``cache``'s block ids now (layer group -> slot ids) and a pin on those pages, taken together:
        another thread may free the request's pages meanwhile (its compute sliding a window, its commit),
        so ids read first and pinned later could name a page already freed."""
        with self._state.lock:
            ids = cache.block_id_map()
            return ids, self.pin_pages(ids)

    def memory_regions(self) -> list[MemoryRegion]:
        """One region per primary-tier pool, in (pool group, pool) order: what a transport registers."""
        return [MemoryRegion.of_tensor(t) for group in self._state.pools for t in group]

    def buffer_view(self, layer_id: int, role: str = "key") -> torch.Tensor:
        """A typed, zero-copy view of one (layer, role) over all slots:
        ``[num_slots, heads, tokens_per_block, head_dim]`` (HND) or ``[num_slots, tokens, heads, dim]`` (NHD)."""
        bid = BufferId(layer_id, role)
        pg, pool, eb = self._state.layout.locate(bid)
        fmt = self._state.layout.format_of(bid)
        if fmt.opaque or fmt.tokens_per_block != self._state.layout.tokens_per_block:
            what = f"opaque ({fmt.block_bytes} bytes per page)" if fmt.opaque else \
                f"paged by {fmt.tokens_per_block} of the cache's {self._state.layout.tokens_per_block} tokens"
            raise LayoutError(f"buffer_view(layer {layer_id}, {role!r}): the buffer is {what}; it has no "
                              f"[slot, head, token, dim] view (address its pages with get_page_index_converter)")
        raw = self._state.pools[pg.pool_group_index][pool.pool_index]
        rows = raw.view(pool.num_slots, pool.slot_bytes)[:, eb.offset:eb.offset + eb.size]
        typed = rows.view(torch_dtype(fmt.dtype))
        if fmt.order == "HND":
            return typed.view(pool.num_slots, fmt.num_heads, fmt.tokens_per_block, fmt.head_dim)
        return typed.view(pool.num_slots, fmt.tokens_per_block, fmt.num_heads, fmt.head_dim)

    # --- tiers: placement, eviction across tiers, onboarding ---------------------------------------

    # --- KVCache lifecycle (called by KVCache) ------------------------------------------------
    def create_kv_cache(self, reuse_scope: ReuseScope | None = None,
                        input_tokens: Sequence[TokenIdExt] | npt.ArrayLike | None = None, id: Any = None,
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
        return self._parts.lifecycle.open_cache(reuse_scope, input_tokens, id, holdback=0, extra_keys=extra_keys,
                                expected_prompt_length=expected_prompt_length, priority_callback=custom_priority_callback,
                                text_only=text_only, enable_request_stats=enable_request_stats)

    def create_kv_cache_for_prompt(self, prompt: Sequence[TokenIdExt] | npt.ArrayLike | None = None, id: Any = None, *,
                                   reuse_scope: ReuseScope | None = None, extra_keys: ExtraKeys | None = None,
                                   expected_prompt_length: int | None = None) -> KVCache:
        """kvxfer's prompt-first form of ``create_kv_cache``: the prompt's prefix is reused except its
        last token, whose logits must be computed; ``expected_prompt_length`` defaults to the whole
        prompt (at least ``len(prompt)``)."""
        return self._parts.lifecycle.open_cache(reuse_scope, prompt, id, holdback=1, extra_keys=extra_keys,
                                expected_prompt_length=expected_prompt_length)

    # --- prefix reuse ---------------------------------------------------------------------------

    # --- events and statistics -------------------------------------------------------------------
    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first."""
        with self._state.lock:
            return self._state.events.drain()

    @property
    def events_dropped(self) -> int:
        """Events dropped because the bounded queue was full."""
        return self._state.events.dropped

    # --- manager lifecycle --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release all memory; refuses while caches are open."""
        with self._state.lock:
            if self._state.shut_down:
                return
            self._refuse_open("shutdown()")
            self._parts.reuse.clear_tree(list(self._state.tree.nodes()))
            self._state.shut_down = True
            if self._state.copier is not None:
                self._state.copier.close()
            for tier in self._state.tiers[1:]:
                tier.close()
            self._state.pools = [[] for _ in self._state.pools]
            # The primary view must not keep the pools' memory alive either (allocators stay readable).
            self._state.tiers[0] = MemoryTierStorage("primary", self._state.layout, [[] for _ in self._state.pools], self._state.allocators,
                                               owns_pools=False)
            self._state.tiers[0].close()

    # --- the reference design's manager API -----------------------------------------------------
    @property
    def init_config(self) -> KVCacheManagerConfig:
        """The reference configuration the manager was created with (built from a CacheConfig when
        that was given)."""
        return self._state.init_config

    @property
    def event_manager(self) -> Any | None:
        """The event manager the manager forwards its events to (None: events are only drained)."""
        return self._state.event_manager

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block."""
        return self._state.layout.tokens_per_block

    @property
    def cache_tier_list(self) -> tuple[CacheTier, ...]:
        """The medium of each cache level in force, primary first."""
        kinds = {PrimaryTier: CacheTier.GPU_MEM, HostTier: CacheTier.HOST_MEM, DiskTier: CacheTier.DISK}
        return tuple(kinds[type(t)] for t in self._state.current.tiers)

    @property
    def allow_seq_rebasing(self) -> bool:
        """Whether a request's committed blocks may be swapped for identical tree blocks (kvxfer adopts
        the tree's copy of a block a request commits when one exists)."""
        return self._state.config.enable_prefix_reuse

    @property
    def enable_partial_match(self) -> bool:
        """Whether a prefix match may end inside a block."""
        return self._state.config.enable_partial_reuse

    @property
    def commit_min_snapshot(self) -> bool:
        """``KVCacheManagerConfig.commit_min_snapshot`` (kvxfer keeps only attention pages)."""
        return self._state.init_config.commit_min_snapshot

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether sliding-window layer groups give prefill blocks out of the window scratch slots."""
        return self._state.config.swa_scratch_reuse

    def supports_index_mode(self, mode: PageIndexMode) -> bool | None:
        """Whether every kv cache supports ``mode`` (None: it depends on the cache, see
        ``KVCache.supports_index_mode``: ``SHARED`` indices cannot address scratch blocks)."""
        if mode is PageIndexMode.SHARED and self.enable_swa_scratch_reuse:
            return None
        return mode in (PageIndexMode.SHARED, PageIndexMode.PER_LAYER)

    @property
    def num_layers(self) -> int:
        """Layers the manager keeps."""
        return sum(len(lg.layer_ids) for lg in self._state.layout.layer_groups)

    @property
    def layer_ids(self) -> Iterator[LayerId]:
        """Every layer id, ascending."""
        return iter(sorted(LayerId(i) for lg in self._state.layout.layer_groups for i in lg.layer_ids))

    def get_layer_group_id(self, layer_id: LayerId) -> LayerGroupId:
        """The layer group (life cycle) of a layer."""
        for lg in self._state.layout.layer_groups:
            if layer_id in lg.layer_ids:
                return LayerGroupId(lg.layer_group_id)
        raise LayoutError(f"get_layer_group_id: no layer {layer_id} in this manager")

    @property
    def layer_grouping(self) -> tuple[tuple[LayerId, ...], ...]:
        """The layer ids of each layer group, in layer group order."""
        return tuple(tuple(LayerId(i) for i in lg.layer_ids) for lg in self._state.layout.layer_groups)

    @property
    def all_buffer_ids(self) -> Iterator[BufferId]:
        """Every (layer, role) buffer, by layer then role order."""
        return iter(bid for bid, _ in self._state.layout.formats)

    def _span(self, layer_id: LayerId, data_role: DataRole) -> tuple[PoolDesc, int, int]:
        pg, pool, span = self._state.layout.locate(BufferId(int(layer_id), str(data_role)))
        del pg
        return pool, span.offset, span.size

    def get_mem_pool_base_address(self, layer_id: LayerId, data_role: DataRole,
                                  index_mode: PageIndexMode | None = None) -> MemAddress:
        """Where page 0 of a buffer is: the buffer inside slot 0 (``SHARED``, the default) or the
        pool's base (``PER_LAYER``, whose indices include the buffer's sub-page). ConfigError for the
        default under scratch reuse, where the mode must be chosen per cache."""
        pool, offset, _ = self._span(layer_id, data_role)
        if index_mode is None:
            if self.enable_swa_scratch_reuse:
                raise ConfigError(f"get_mem_pool_base_address(layer {layer_id}, {data_role!r}): index_mode must be "
                                  f"given when SWA scratch reuse is enabled, got None")
            index_mode = PageIndexMode.SHARED
        if index_mode is PageIndexMode.PER_LAYER:
            return MemAddress(pool.base_address)
        return MemAddress(pool.base_address + offset)

    def get_page_stride(self, layer_id: LayerId, data_role: DataRole) -> int:
        """Bytes of one page of a buffer (a block's bytes, or a part of them for a buffer paged by
        fewer tokens than the cache)."""
        return exact_div(self._span(layer_id, data_role)[2], self._expansion(layer_id, data_role))

    def _expansion(self, layer_id: LayerId, data_role: DataRole) -> int:
        return self._state.layout.expansion_of(BufferId(int(layer_id), str(data_role)))

    def get_page_index_scale(self, layer_id: LayerId, data_role: DataRole) -> int:
        """Blocks of the buffer's size in one slot of its pool (the buffers coalesced there): base page
        index * scale is the buffer's block index (times the expansion: its page index)."""
        pool, _, size = self._span(layer_id, data_role)
        return exact_div(pool.slot_bytes, size)

    def get_page_index_upper_bound(self, layer_id: LayerId, data_role: DataRole) -> int:
        """One past the largest page index of a buffer."""
        pool, _, _ = self._span(layer_id, data_role)
        return pool.num_slots * self.get_page_index_scale(layer_id, data_role) * self._expansion(layer_id, data_role)

    def get_page_index_converter(self, layer_id: LayerId, data_role: DataRole) -> PageIndexConverter:
        """Turns base page indices of the buffer's layer group into page indices of the buffer
        (remembered per layout: an engine asks for it per layer and step)."""
        layout = self._state.layout
        if self._converters_layout is not layout:
            self._converters, self._converters_layout = {}, layout
        key = (type(layer_id), layer_id, type(data_role), data_role)
        converter = self._converters.get(key)
        if converter is None:
            converter = self._converters[key] = self._make_page_index_converter(layer_id, data_role)
        return converter

    def _make_page_index_converter(self, layer_id: LayerId, data_role: DataRole) -> PageIndexConverter:
        _, offset, size = self._span(layer_id, data_role)
        bid = BufferId(int(layer_id), str(data_role))
        variant = self._state.layout.pool_groups[self._state.lg_pool_group[self.get_layer_group_id(layer_id)]] \
            .slot_desc.variant_of(int(self.get_layer_group_id(layer_id)))
        return PageIndexConverter(self.get_page_index_scale(layer_id, data_role), self._expansion(layer_id, data_role),
                                  exact_div(offset, size), layer_pages_per_block(variant, bid))

    def probe_reuse(self, reuse_scope: ReuseScope | None = None,
                    input_tokens: Sequence[TokenIdExt] | npt.ArrayLike | None = None, *,
                    extra_keys: ExtraKeys | None = None) -> int:
        """How many of ``input_tokens`` ``create_kv_cache(reuse_scope, input_tokens)`` would reuse now;
        takes nothing (no page, no LRU update, no statistics)."""
        return self._parts.reuse.probe(reuse_scope, input_tokens, extra_keys, holdback=0, what="probe_reuse")

    def probe_first_new_block_key(self, reuse_scope: ReuseScope | None = None,
                                  input_tokens: Sequence[TokenIdExt] | npt.ArrayLike | None = None) -> bytes | None:
        """The key of the first full block of ``input_tokens`` that the prefix tree lacks (None: every
        full block is there, or there is none)."""
        with self._state.lock:
            scope = check_scope(reuse_scope, "probe_first_new_block_key")
            if input_tokens is None:
                return None
            arr = self._state.encode_tokens(input_tokens, "probe_first_new_block_key")
            root = scope.root_key_for(self._state.key_algo)
            keys = block_keys(arr, self._state.layout.tokens_per_block, root, algo=self._state.key_algo, scope=scope,
                              digests=self._state.digests)
            matched = len(self._state.tree.match(root, keys).nodes)
            return keys[matched] if matched < len(keys) else None

    def clear_reusable_blocks(self) -> None:
        """Drop every block of the prefix tree; LogicError while any KV cache is open."""
        with self._state.lock:
            self._refuse_open("clear_reusable_blocks()")
            self._parts.reuse.clear_tree(list(self._state.tree.nodes()))
            self._state.events.put(AllCleared())
            self._parts.usage.sample_usage()

    def _refuse_open(self, what: str) -> None:
        self._parts.lifecycle.reap_dropped()
        open_ids = [c.id for c in self._state.caches.values() if c.state is not CacheState.CLOSED]
        if open_ids:
            raise ManagerBusyError(f"{what}: {len(open_ids)} KV cache(s) still open: {open_ids[:5]}")

    def resize(self, cache_level: CacheLevel, quota: int, best_efforts: bool = False) -> bool:
        """Give a cache level a new byte quota (see ``resize_quota``); False, changing nothing, when it
        cannot be done now (an active request, or held pages with no room). ``best_efforts`` is
        accepted for the reference's signature: kvxfer's resize is all or nothing."""
        del best_efforts
        try:
            self._parts.quotas.resize_quota(int(cache_level), quota)
        except (ManagerBusyError, TierError):
            return False
        return True

    def get_quota(self, cache_level: CacheLevel) -> int:
        """The byte quota of a cache level in force."""
        self._state.check_tier_index(int(cache_level))
        return self._state.current.tiers[int(cache_level)].quota_bytes

    def get_storage_statistics(self, cache_level: CacheLevel = GPU_LEVEL) -> list[StorageStatistics]:
        """Slot counts of each pool group at a cache level."""
        with self._state.lock:
            self._state.check_tier_index(int(cache_level))
            out = []
            for pg in range(len(self._state.layout.pool_groups)):
                acc = self._parts.usage.slot_accounting(pg, int(cache_level))
                sizes = list(self._state.tiers[int(cache_level)].layout.pool_groups[pg].slot_desc.slot_size_list)
                out.append(StorageStatistics(sizes, acc.total, acc.free, acc.evictable))
            return out

    def get_life_cycle_pool_group_indices(self, cache_level: CacheLevel = GPU_LEVEL) -> list[PoolGroupIndex]:
        """The pool group of each layer group (life cycle), in layer group order."""
        self._state.check_tier_index(int(cache_level))
        return [PoolGroupIndex(pg) for pg in self._state.lg_pool_group]

    def get_and_reset_ssm_snapshot_iteration_stats(self) -> dict[LifeCycleId, SsmSnapshotIterationStatsDelta]:
        """Snapshot counters of the recurrent life cycle since the last call, from the requests whose
        pending statistics were committed (``{}`` without recurrent layers or lookups)."""
        with self._state.lock:
            return {LifeCycleId(lg): d for lg, d in self._state.stats.take_ssm_iteration().items()}

    def record_request_suspended(self) -> None:
        """Count a request suspension in this iteration's counters."""
        with self._state.lock:
            self._state.suspend_resume[0] += 1

    def record_request_resumed(self) -> None:
        """Count a request resumption in this iteration's counters."""
        with self._state.lock:
            self._state.suspend_resume[1] += 1

    def get_and_reset_iteration_suspend_resume_stats(self) -> tuple[int, int]:
        """(suspensions, resumptions) recorded since the last call."""
        with self._state.lock:
            out = (self._state.suspend_resume[0], self._state.suspend_resume[1])
            self._state.suspend_resume = [0, 0]
            return out

    def get_and_reset_iteration_disk_prefetch_blocks(self) -> int:
        """Pages prefetched out of the disk level since the last call."""
        with self._state.lock:
            out, self._state.disk_prefetch_blocks = self._state.disk_prefetch_blocks, 0
            return out

    def get_and_reset_iteration_cached_tokens_by_level(self) -> list[int]:
        """Reused tokens of the caches created since the last call, by the level their pages were at."""
        with self._state.lock:
            out = self._state.cached_tokens_by_level
            self._state.cached_tokens_by_level = [0] * len(self._state.tiers)
            return out

    def get_and_reset_iteration_reused_blocks_by_level(self) -> dict[LifeCycleId, ReusedBlocksByLevel]:
        """Reused blocks (full and partial) per layer group and level since the last call."""
        with self._state.lock:
            out = self._state.reused_blocks_by_level
            self._state.reused_blocks_by_level = {}
            return out

    def clamp_max_seq_len_for_mem(self, batch_size: int, token_num_upper_bound: int) -> int:
        """The longest sequence (at most ``token_num_upper_bound``) of which ``batch_size`` fit in the
        primary level at once, counting of a sliding-window layer group the blocks it still needs at
        that length (its sink blocks and window), and one state slot per sequence in a recurrent one."""
        if batch_size <= 0:
            raise ConfigError(f"clamp_max_seq_len_for_mem: batch_size must be > 0, got {batch_size}")
        tpb = self._state.layout.tokens_per_block

        def fits(seq_len: int) -> bool:
            for pg, alloc in enumerate(self._state.allocators):
                need = 0
                for lg in self._state.pg_layer_groups[pg]:
                    desc = self._state.layout.layer_groups[lg]
                    blocks = div_up(seq_len, tpb)
                    if desc.recurrent:      # one state slot, whatever the length
                        blocks = 1
                    elif desc.window is not None:       # what the window still needs at seq_len, sinks kept
                        lo, sink = self._parts.reuse.window_start(lg, np.array([seq_len], dtype=np.int64))
                        blocks = blocks - max(0, int(lo[0]) - sink)
                    need += blocks
                if need * batch_size > alloc.usable:
                    return False
            return True

        upper = max(0, int(token_num_upper_bound))
        if fits(upper):
            return upper
        # A window's need is not monotonic inside a block (a block starts before the oldest leaves the
        # window); at block boundaries it is: the longest whole number of blocks that fits.
        lo, hi = 0, upper // tpb
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid * tpb):
                lo = mid
            else:
                hi = mid - 1
        return lo * tpb

    @property
    def need_adjustment(self) -> bool:
        """Whether the auto-tuner asks for a pool re-split: enough closed kv caches sampled
        (``rebalance_min_sampled_kv_caches``), the cooldown over (``rebalance_cooldown_secs``) and a pool
        group's share of the primary bytes, or of the colder levels' bytes (averaged over them), off its
        target by more than ``rebalance_ratio_threshold``."""
        return self._parts.tuner.need_adjustment

    def adjust(self) -> None:
        """Re-split every cache level that is off its target between pool groups, primary first, then
        each colder tier (every kv cache suspended or closed: ManagerBusyError otherwise). Pages survive
        unless a shrinking pool group of the coldest tier must drop tree-only ones; a primary pool group
        that grows gets new memory, so re-read base addresses (``layout``, ``get_mem_pool_base_address``)
        after it; a colder tier is rebuilt (``tier_layout``)."""
        self._parts.tuner.adjust()

    @property
    def resuming_cache_ids(self) -> frozenset[Any]:
        """Kv caches being resumed now: their primary pages are held in place (no eviction victims)."""
        return frozenset(self._state.pinned)

    @property
    def pool_tuner(self) -> PoolTuner:
        """The auto-tuner part (white-box hooks for ``_introspection``: counters, target ratio)."""
        return self._parts.tuner

    def compute_slots_for_batch(self, batch: Any, swa_scratch_reuse: Any = False) -> list[int]:
        """The fewest primary slots per pool group that run ``batch`` (a ``BatchDesc``) at once, with
        scratch blocks in shared slots as ``swa_scratch_reuse`` (a ``SwaScratchReuseConfig`` or None
        for off; default: the manager's own setting) says."""
        rewind: int | bool | None = False if swa_scratch_reuse is False else \
            None if swa_scratch_reuse is None else int(swa_scratch_reuse.max_rewind_len)
        return self._state.planner.slots_for_batch(check_batch(batch, "compute_slots_for_batch: batch"), rewind)

    # --- the parts' public API, as the manager's ----------------------------------------------------
    @property
    def lifecycle(self) -> CacheLifecycle:
        """The kv caches' life-cycle part (what each KVCache calls)."""
        return self._parts.lifecycle

    @property
    def life_cycle_registry(self) -> LifeCycleRegistry:
        """The life cycle of each layer group (attention with its window and sinks, or recurrent), in
        layer group order: the registry the prefix tree and the kv caches go by."""
        return LifeCycleRegistry(self._parts.lifecycle.life_cycles())

    @property
    def _life_cycles(self) -> LifeCycleRegistry:
        """The reference design's name of the manager's life-cycle registry (``life_cycle_registry``)."""
        return self.life_cycle_registry

    def allocator(self, pool_group: int, tier: int = 0) -> SlotAllocator:
        """The slot allocator of a pool group in a tier (0 = primary; read-only use: counts and reference counts)."""
        return self._state.allocator(pool_group, tier)

    def clear_stats_dirty(self, kv_cache_id: Hashable | None) -> None:
        """Unmark a request (committing or discarding its stats does this too)."""
        return self._parts.usage.clear_stats_dirty(kv_cache_id)

    def clear_stats_excluded(self, kv_cache_id: Hashable | None) -> None:
        """Record request ``kv_cache_id``'s statistics again."""
        return self._parts.usage.clear_stats_excluded(kv_cache_id)

    @property
    def config(self) -> CacheConfig:
        """The configuration the manager was created with (never changes; see ``current_config``)."""
        return self._state.config

    def copy_slots(self, pool_group: int, src: npt.ArrayLike, dst: npt.ArrayLike) -> None:
        """Copy whole slots ``src[i] -> dst[i]`` in every pool of a pool group (one batched copy per pool, on the pool's device)."""
        return self._state.copy_slots(pool_group, src, dst)

    @property
    def current_config(self) -> CacheConfig:
        """The configuration in force now: ``config`` with the quotas ``resize_quota`` set and without a host tier that could not be set up."""
        return self._state.current_config

    @property
    def device(self) -> torch.device:
        """The primary tier's device."""
        return self._state.device

    def get_and_reset_iteration_peak_block_stats(self, cache_level: int = 0) -> tuple[PoolGroupPeakBlockStats, ...]:
        """Per pool group of cache level ``cache_level`` (tier index, 0 = primary): the peak available / unavailable / evictable slots since the last call; they restart from the present state. With stats off, the present state."""
        return self._parts.usage.get_and_reset_iteration_peak_block_stats(cache_level)

    def get_and_reset_iteration_peak_block_stats_by_level(self) -> tuple[tuple[PoolGroupPeakBlockStats, ...], ...]:
        """``get_and_reset_iteration_peak_block_stats`` of every cache level, primary first."""
        return self._parts.usage.get_and_reset_iteration_peak_block_stats_by_level()

    def get_and_reset_iteration_stats(self) -> dict[int, KVCacheIterationStatsDelta]:
        """Per layer group that counted anything: counters committed (and copies made) since the last call; ``{}`` when nothing happened or ``enable_stats`` is off."""
        return self._parts.usage.get_and_reset_iteration_stats()

    def get_committed_stats(self) -> KVCacheStatsDelta:
        """Every request's committed counters summed since the manager started (a copy)."""
        return self._parts.usage.get_committed_stats()

    def get_dirty_stats_kv_cache_ids(self) -> set[Any]:
        """Ids of the requests with pending statistics: what a scheduler commits at the end of a step."""
        return self._parts.usage.get_dirty_stats_kv_cache_ids()

    @property
    def hash_algo(self) -> str:
        """The block-key algorithm as configured (``CacheConfig.hash_algo``; may be ``auto``)."""
        return self._state.hash_algo

    @property
    def host_tier_error(self) -> str | None:
        """Why the configured host tier is missing (its set-up failed; the manager runs without it), or None."""
        return self._state.host_tier_error

    def is_stats_excluded(self, kv_cache_id: Hashable | None) -> bool:
        """Whether request ``kv_cache_id``'s statistics are not recorded."""
        return self._parts.usage.is_stats_excluded(kv_cache_id)

    @property
    def layout(self) -> CacheLayoutDesc:
        """The published layout of the primary tier: pools, slots, buffer formats."""
        return self._state.layout

    def mark_stats_dirty(self, kv_cache_id: Hashable | None) -> None:
        """Mark a request as having pending statistics (requests mark themselves when they record)."""
        return self._parts.usage.mark_stats_dirty(kv_cache_id)

    def mark_stats_excluded(self, kv_cache_id: Hashable | None) -> None:
        """Record nothing for request ``kv_cache_id`` from now on (warm-up or dummy requests): it leaves the dirty set and what it has pending is never committed. May precede the request's creation."""
        return self._parts.usage.mark_stats_excluded(kv_cache_id)

    def num_free_slots(self, pool_group: int = 0) -> int:
        """Free slots of a pool group."""
        return self._state.num_free_slots(pool_group)

    @property
    def num_tiers(self) -> int:
        """Tiers of this manager, primary first (1 without host or disk tiers)."""
        return self._state.num_tiers

    @property
    def open_caches(self) -> list[KVCache]:
        """Caches created and not yet closed."""
        return self._state.open_caches

    @property
    def pool_group_descs(self) -> tuple[PoolGroupDesc, ...]:
        """The pool groups of the published layout."""
        return self._state.pool_group_descs

    def pool_tensor(self, pool_group: int, pool: int) -> torch.Tensor:
        """The raw byte tensor of one pool (for copy engines and tests)."""
        return self._state.pool_tensor(pool_group, pool)

    @property
    def prefix_tree(self) -> PrefixTree:
        """The prefix tree (read-only use: inspection, tests, benchmarks)."""
        return self._state.prefix_tree

    def probe_prompt_reuse(self, tokens: Sequence[TokenIdExt] | npt.ArrayLike, scope: ReuseScope | None = None,
                           extra_keys: ExtraKeys | None = None) -> int:
        """How many tokens ``create_kv_cache_for_prompt(tokens, reuse_scope=scope)`` would reuse now (never the last prompt token); takes nothing (no page, no LRU update, no statistics)."""
        return self._parts.reuse.probe_prompt_reuse(tokens, scope, extra_keys)

    def rebalance_slots(self, num_slots: Sequence[int]) -> None:
        """Set the usable slot count of every primary pool group (``num_slots[pg]``), each at most the registered ``PoolGroupDesc.num_slots``, their bytes within the current primary quota."""
        return self._parts.quotas.rebalance_slots(num_slots)

    def reset_prefix_tree(self) -> bool:
        """Drop every block of the prefix tree (one AllCleared event); False, changing nothing, while a request still shares one of its pages."""
        return self._parts.reuse.reset_prefix_tree()

    def resize_quota(self, tier: int | type[PrimaryTier | HostTier | DiskTier], quota_bytes: int) -> None:
        """Give a tier a new quota; only while no request is ACTIVE (ManagerBusyError)."""
        return self._parts.quotas.resize_quota(tier, quota_bytes)

    @property
    def digest_table(self) -> DigestTable:
        """The codes this manager keeps for multimodal digest tokens in its token arrays."""
        return self._state.digests

    @property
    def resolved_hash_algo(self) -> str:
        """The concrete block-key algorithm (``auto`` resolved to ``v1_block_key``); pass either name to ``kvxfer.cache.hashing.block_hash_for_event`` to publish a key."""
        return self._state.resolved_hash_algo

    @property
    def reuse_match_backoff(self) -> int:
        """Tokens trimmed off the tail of every prefix match (``KVCacheManagerConfig.reuse_match_backoff``)."""
        return self._state.reuse_match_backoff

    def slot_accounting(self, pool_group: int = 0, tier: int = 0) -> SlotAccounting:
        """Where the usable slots of a pool group of a tier (0 = primary) are (free, request-only, evictable, shared); raises KVCacheError when the reference counts contradict the tree."""
        return self._parts.usage.slot_accounting(pool_group, tier)

    def storage_stats(self, tier: int | type[PrimaryTier | HostTier | DiskTier] = 0) -> TierStats:
        """Capacity and occupancy (slots per pool group) of one tier."""
        return self._parts.quotas.storage_stats(tier)

    def tier_layout(self, tier: int | type[PrimaryTier | HostTier | DiskTier] = 0) -> CacheLayoutDesc:
        """The placed layout of one tier (the primary's is ``layout``): its pool groups' slot counts and
        pools. A colder tier's changes when ``adjust()`` re-splits it or ``resize_quota`` resizes it."""
        with self._state.lock:
            return self._state.tiers[self._state.tier_index(tier)].layout

    def tier_index(self, tier: int | type[PrimaryTier | HostTier | DiskTier]) -> int:
        """Index of a tier given as an index or as its config class (PrimaryTier, HostTier, DiskTier)."""
        return self._state.tier_index(tier)

    @property
    def tier_media(self) -> tuple[str, ...]:
        """Each tier's medium name in events ("GPU", "CPU", "DISK"), primary first."""
        return self._state.tier_media

    def tier_traffic(self) -> TierTraffic:
        """Pages offloaded into / onboarded from each tier, blocks dropped, bytes moved (cumulative)."""
        return self._parts.quotas.tier_traffic()

    def __repr__(self) -> str:
        pgs = ", ".join(f"pg{i}: {a.num_used}/{a.num_slots} used" for i, a in enumerate(self._state.allocators))
        return f"KVCacheManager(device={self._state.device}, {pgs})"


def check_layer_group(layout: CacheLayoutDesc, layer_group: int) -> None:
    """Raise LayoutError when ``layer_group`` is not a layer group of ``layout``."""
    if not 0 <= layer_group < len(layout.layer_groups):
        raise LayoutError(f"no layer group {layer_group} (have 0..{len(layout.layer_groups) - 1})")
