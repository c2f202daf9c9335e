"""KVCacheManager: a facade over the manager's state and parts (see ``ManagerParts``) that hands out
KVCaches, publishes the layout and speaks the reference design's API; and ``CacheLifecycle``, the part
that opens, resumes, resizes, commits and closes kv caches."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache import tiers as tier_storage
from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.common import (
    GPU_LEVEL,
    AttnLifeCycle,
    CacheLevel,
    CacheTier,
    DataRole,
    HalfOpenRange,
    LayerGroupId,
    LayerId,
    LifeCycleId,
    LifeCycleRegistry,
    MemAddress,
    PageIndexConverter,
    PageIndexMode,
    PlannedDropHandle,
    PoolGroupIndex,
    SsmLifeCycle,
    div_up,
    exact_div,
    overlap,
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
from kvxfer.cache.events import AllCleared, Created, EventQueue, KVEvent, layer_group_subset
from kvxfer.cache.eviction import EvictionController
from kvxfer.cache.hashing import (
    DigestTable,
    ExtraKeys,
    ReuseScope,
    TokenIdExt,
    block_keys,
    check_extra_keys,
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
from kvxfer.cache.radix_tree import BlockNode, PrefixTree, check_priority
from kvxfer.cache.recurrent import RecurrentStates
from kvxfer.cache.scratch import layer_pages_per_block, scratch_range, scratch_share, scratch_slots_needed
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
    CacheStateError,
    ConfigError,
    LayoutError,
    ManagerBusyError,
    OutOfSlotsError,
    ScratchInUseError,
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


class CacheLifecycle:
    """The kv caches' life cycle: creation, resume/suspend, resize, commit, close, planned drops and
    prefetch, on the shared state and the other parts (what a KVCache calls)."""

    def __init__(self, state: ManagerState, parts: ManagerParts) -> None:
        """``parts``: the manager's parts, through which this part reaches the others."""
        self.state = state
        self.parts = parts
        self._scratch_shares: dict[int, Fraction] = {}
        self._scratch_counts: dict[tuple[int, int], int] = {}   # (layer group, blocks) -> slots
        self.windows: list[tuple[int, int, int]] = []           # see release_out_of_window
        self.windows_of: Any = None                               # the layout ``windows`` was read from

    def unpin_pages(self, slots: Mapping[int, IntArray]) -> None:
        """Let go of the references ``pin_pages`` took (the release of a PinnedPages)."""
        with self.state.lock:
            for pg, arr in slots.items():
                self.state.allocators[pg].decref(arr)
            self.parts.usage.sample_usage()

    def release(self, layer_group: int, ids: IntArray, tiers: TierArray, stream: Any = None) -> None:
        """Drop one reference on each page ``ids[i]`` (>= 0) of tier ``tiers[i]``; the primary ones
        are stamped with ``stream`` (the releasing request's) first."""
        self.parts.streams.stamp(layer_group, ids, tiers, stream)
        pg = self.state.lg_pool_group[layer_group]
        live = ids >= 0
        for tier in np.unique(tiers[live]).tolist():
            self.state.alloc_of(tier, pg).decref(ids[live & (tiers == tier)])

    def open_cache(self, reuse_scope: ReuseScope | None, tokens: Sequence[TokenIdExt] | npt.ArrayLike | None, id: Any,
                    holdback: int, extra_keys: ExtraKeys | None = None, expected_prompt_length: int | None = None,
                    priority_callback: PriorityCallback | None = None, text_only: bool | None = None,
                    enable_request_stats: bool = False) -> KVCache:
        """Create a suspended kv cache, locking the pages of its reusable prefix (``create_kv_cache``)."""
        with self.state.lock:
            self.reap_dropped()
            if self.state.shut_down:
                raise ManagerBusyError("create_kv_cache: the manager has been shut down")
            cache_id = id if id is not None else f"kv-{next(self.state.ids)}"
            try:
                hash(cache_id)
            except TypeError as exc:
                raise ConfigError(f"create_kv_cache: id must be hashable, got {cache_id!r}") from exc
            if cache_id in self.state.caches:
                raise CacheStateError(f"create_kv_cache: a cache with id {cache_id!r} is already open")
            what = f"create_kv_cache({cache_id})"
            scope = check_scope(reuse_scope, what)
            extras = check_extra_keys(extra_keys, what)
            arr = None if tokens is None else self.state.encode_tokens(tokens, what)
            prompt_length = _check_prompt_length(expected_prompt_length, arr, what)
            cache = KVCache(self.parts.manager, cache_id, arr, scope, extras, expected_prompt_length=prompt_length,
                            swa_scratch_reuse=self.state.config.swa_scratch_reuse)
            cache.priority_callback = priority_callback
            cache.text_only = bool(self.state.init_config.text_only if text_only is None else text_only)
            cache.enable_request_stats = bool(enable_request_stats)
            cache.reused_tokens_by_level = [0] * len(self.state.tiers)
            cache.record.root_key = scope.root_key_for(self.state.key_algo)
            cache.record.last_used = self.state.tree.tick()
            if arr is not None and self.state.config.enable_prefix_reuse:
                cache.record.prompt_keys = self.parts.reuse.keys(cache, arr, cache.record.root_key)
                plan = self.parts.reuse.plan_matching(cache.record.root_key, cache.record.prompt_keys, arr, extras, holdback)
                self.parts.reuse.lock_reuse(cache, arr, plan)
                self.parts.reuse.count_reuse(cache, plan)
                self.count_reused_levels(cache, plan)
                self.parts.recurrent.count_lookup(cache, int(arr.size), plan.num_tokens)
            self.state.caches[cache_id] = cache
            self.parts.usage.sample_usage()
            return cache

    def put_created(self) -> None:
        """Created events: each layer group's slots per tier (one event when all layer groups agree)."""
        counts = [tuple(t.layout.pool_groups[pg].num_slots for t in self.state.tiers) for pg in self.state.lg_pool_group]
        if all(c == counts[0] for c in counts):
            self.state.events.put(Created(tuple(self.state.media), counts[0]))
            return
        for lg, c in enumerate(counts):
            self.state.events.put(Created(tuple(self.state.media), c, layer_group_subset([i == lg for i in range(len(counts))])))

    def resume(self, cache: KVCache, stream: Any = None) -> bool:
        """Onboard the cache's offloaded pages and copy its partially reused block; False, changing
        nothing, when the primary tier cannot take them. ``stream`` waits for every page's last user."""
        with self.state.lock:
            self.reap_dropped()
            if self.parts.quotas.over_resume_limit():
                return False
            offloaded = self.parts.quotas.offloaded_pages(cache)
            needs = self.parts.quotas.cow_needs(cache)
            for pg, n in self.parts.recurrent.resume_needs(cache).items():
                needs[pg] = needs.get(pg, 0) + n
            for pg, by_tier in offloaded.items():
                needs[pg] = needs.get(pg, 0) + sum(src.size for src in by_tier.values())
            scratch = self.scratch_needs(cache, self.scratch_ranges(cache, cache.record.history, cache.record.capacity))
            for pg, n in scratch.items():
                if n > 0:
                    needs[pg] = needs.get(pg, 0) + n
            self.state.pinned.add(cache.id)   # its primary pages stay put while room is made
            try:
                if not all(self.parts.quotas.can_take(pg, n, pg in offloaded) for pg, n in needs.items()):
                    return False
                for pg, n in needs.items():
                    if not self.parts.quotas.onboard(cache, pg, n):
                        return False
                if not self.parts.reuse.copy_on_write(cache, stream):
                    return False
                if not self.parts.recurrent.activate(cache, stream):
                    return False
                if any(n > 0 for n in scratch.values()):     # a suspended step's scratch slots come back
                    try:
                        self.parts.eviction.reserve({pg: n for pg, n in scratch.items() if n > 0})
                    except OutOfSlotsError:
                        return False
                    self.sync_scratch(cache, stream)
            finally:
                self.state.pinned.discard(cache.id)
            self.parts.streams.wait_ready(cache, stream)
            cache.record.last_used = self.state.tree.tick()
            self.parts.usage.sample_usage()
            return True

    def suspend(self, cache: KVCache) -> None:
        """Stamp the cache's pages with its stream and give back its scratch slots (its pages become held)."""
        with self.state.lock:
            for g, (blocks, tiers) in enumerate(zip(cache.record.blocks, cache.record.tiers, strict=True)):
                self.parts.streams.stamp(g, blocks, tiers, cache.record.stream)
            self.release_scratch(cache)
            cache.record.last_used = self.state.tree.tick()

    def scratch_ranges(self, cache: KVCache, history: int, capacity: int,
                       enabled: bool | None = None) -> list[HalfOpenRange[int]]:
        """The scratch range of every layer group for the step ``[history, capacity)`` (see
        ``kvxfer.cache.scratch``); empty ones while the cache's scratch reuse is off (``enabled``
        overrides the cache's setting)."""
        on = cache.record.swa_scratch_reuse if enabled is None else enabled
        scratch_cfg = self.state.init_config.swa_scratch_reuse
        groups = self.state.layout.layer_groups
        if not on or scratch_cfg is None:
            return [HalfOpenRange(0, 0)] * len(groups)
        tpb = self.state.layout.tokens_per_block
        return [HalfOpenRange(0, 0) if lg.recurrent else
                scratch_range(lg.window, lg.sink_tokens, history, capacity, tpb, scratch_cfg.max_rewind_len)
                for lg in groups]

    def stale_span(self, layer_group: int, old_n: int, new_n: int, history: int | None) -> tuple[int, int]:
        """Blocks ``[begin, end)`` among the new ones ``[old_n, new_n)`` of a sliding-window group that
        are already out of the window at ``history`` written tokens: they get no page (as if released)."""
        lg = self.state.layout.layer_groups[layer_group]
        if history is None or lg.window is None or lg.recurrent:
            return 0, 0
        lo, sink = self.parts.reuse.window_start(layer_group, np.array([history], dtype=np.int64))
        begin, end = max(old_n, sink), min(int(lo[0]), new_n)
        return (begin, end) if end > begin else (0, 0)

    def scratch_slot_count(self, layer_group: int, blocks: HalfOpenRange[int]) -> int:
        """Scratch slots that hold the blocks ``blocks`` of a layer group (remembered per block count:
        every step of every request asks, and the Fraction product costs ~9 us)."""
        key = (layer_group, len(blocks))
        count = self._scratch_counts.get(key)
        if count is None:
            share = self._scratch_shares.get(layer_group)
            if share is None:
                pg = self.state.layout.pool_groups[self.state.lg_pool_group[layer_group]]
                share = self._scratch_shares[layer_group] = scratch_share(pg.slot_desc.variant_of(layer_group))
            count = self._scratch_counts[key] = scratch_slots_needed(key[1], share)
        return count

    def scratch_needs(self, cache: KVCache, ranges: Sequence[HalfOpenRange[int]]) -> dict[int, int]:
        """Slots per pool group the cache's scratch slots grow by (negative: shrink by) for ``ranges``."""
        needs: dict[int, int] = {}
        for g, rng in enumerate(ranges):
            pg = self.state.lg_pool_group[g]
            needs[pg] = needs.get(pg, 0) + self.scratch_slot_count(g, rng) - int(cache.record.scratch[g].size)
        return needs

    def resize(self, cache: KVCache, capacity: int, history: int | None = None, *, skip_stale: bool = False) -> None:
        """Grow or shrink the cache's blocks to hold ``capacity`` tokens, and its scratch slots to what
        the step ``[history, capacity)`` needs (OutOfSlotsError, nothing changed, when out of slots).
        New blocks in a scratch range get no page; with ``skip_stale`` (a caller-given history) neither do
        new blocks already out of a sliding window at ``history``."""
        with self.state.lock:
            tpb = self.state.layout.tokens_per_block
            new_n = math.ceil(capacity / tpb)
            old_n = cache.num_blocks
            ranges = self.scratch_ranges(cache, cache.record.history if history is None else history, capacity)
            if new_n == old_n and self.scratch_fits(cache, ranges):
                return      # most steps: no block and no scratch slot changes hands
            n_lg = len(cache.record.blocks)
            recurrent = set(self.state.recurrent_groups)    # one state slot each: no pages per block
            grown = HalfOpenRange(old_n, new_n)
            spans = [overlap(r, grown) if r and new_n > old_n else HalfOpenRange(0, 0) for r in ranges]
            # where no scratch slot stands in, blocks stale at a given history get no page at all
            stale = [self.stale_span(g, old_n, new_n, history if skip_stale else None)
                     if new_n > old_n and not spans[g] else (0, 0) for g in range(n_lg)]
            held_before = [int(slots.size) for slots in cache.record.scratch]
            needs = self.scratch_needs(cache, ranges)
            if new_n > old_n:
                for g, span in enumerate(spans):
                    if g not in recurrent:
                        pg = self.state.lg_pool_group[g]
                        needs[pg] = needs.get(pg, 0) + (new_n - old_n) - len(span) - (stale[g][1] - stale[g][0])
            # excess scratch slots go back first: they may serve as the new blocks' pages
            self.parts.eviction.reserve({pg: n for pg, n in needs.items() if n > 0})
            for g, rng in enumerate(ranges):
                if self.scratch_slot_count(g, rng) < cache.record.scratch[g].size:
                    self.set_scratch(cache, g, rng)
            if new_n > old_n:
                for g, span in enumerate(spans):
                    if g in recurrent:
                        continue
                    alloc = self.state.allocators[self.state.lg_pool_group[g]]
                    fresh = np.full(new_n - old_n, -1, dtype=np.int32)
                    real = np.ones(new_n - old_n, dtype=bool)
                    if span:
                        real[span.beg - old_n:span.end - old_n] = False
                    if stale[g] != (0, 0):
                        real[stale[g][0] - old_n:stale[g][1] - old_n] = False
                    fresh[real] = alloc.alloc(int(np.count_nonzero(real)))
                    cache.record.blocks[g] = np.concatenate([cache.record.blocks[g], fresh])
                    cache.record.tiers[g] = np.concatenate([cache.record.tiers[g], np.zeros(new_n - old_n, dtype=np.int8)])
                    self.parts.streams.wait_slots(g, fresh, cache.record.stream)
                # a recurrent layer group counts no page per block (as a block range of scratch positions)
                self.parts.usage.count_allocation(cache, old_n, new_n, [
                    (old_n, new_n) if g in recurrent else (span.beg, span.end) if span else stale[g]
                    for g, span in enumerate(spans)])
                if cache.priority_callback is not None:
                    self.prioritize_blocks(cache, old_n, new_n)
            elif new_n < old_n:
                self.parts.usage.uncount_allocation(cache, new_n, old_n)
                for g in range(n_lg):
                    if g in recurrent:
                        continue
                    self.release(g, cache.record.blocks[g][new_n:], cache.record.tiers[g][new_n:], cache.record.stream)
                    cache.record.blocks[g] = cache.record.blocks[g][:new_n].copy()
                    cache.record.tiers[g] = cache.record.tiers[g][:new_n].copy()
            for g, rng in enumerate(ranges):
                self.set_scratch(cache, g, rng)
            if new_n == old_n and held_before == [int(slots.size) for slots in cache.record.scratch]:
                return      # no slot changed hands: the usage peaks cannot have moved
            self.parts.usage.sample_usage()

    def scratch_fits(self, cache: KVCache, ranges: Sequence[HalfOpenRange[int]]) -> bool:
        """Whether the cache holds exactly the scratch slots ``ranges`` need; if so, records the ranges
        they stand in for (what ``set_scratch`` does when no slot changes hands)."""
        scratch = cache.record.scratch
        spans: list[tuple[int, int]] = []
        for g, rng in enumerate(ranges):
            beg, end = rng
            want = self.scratch_slot_count(g, rng) if beg < end else 0
            if want != scratch[g].size:
                return False
            spans.append((beg, end) if want else (0, 0))
        cache.record.scratch_range[:] = spans
        return True

    def set_scratch(self, cache: KVCache, layer_group: int, blocks: HalfOpenRange[int], stream: Any = None) -> None:
        """Hold exactly the scratch slots the blocks ``blocks`` of a layer group need (keeping those
        held) and record the range they stand in for; slots to take were reserved by the caller. New
        slots are waited for on ``stream`` (default: the cache's)."""
        held = cache.record.scratch[layer_group]
        want = self.scratch_slot_count(layer_group, blocks) if blocks else 0
        if want > held.size:
            more = self.state.allocators[self.state.lg_pool_group[layer_group]].alloc(want - held.size)
            self.parts.streams.wait_slots(layer_group, more, cache.record.stream if stream is None else stream)
            held = np.concatenate([held, more])
        elif want < held.size:
            surplus = held[want:]
            self.release(layer_group, surplus, np.zeros(surplus.size, dtype=np.int8), cache.record.stream)
            held = held[:want].copy()
        cache.record.scratch[layer_group] = held
        cache.record.scratch_range[layer_group] = (blocks.beg, blocks.end) if want else (0, 0)

    def sync_scratch(self, cache: KVCache, stream: Any = None) -> None:
        """Fit the cache's scratch slots to its current step ``[history_length, capacity)`` (after the
        history grew, or at resume); slots to take were reserved by the caller."""
        with self.state.lock:
            for g, rng in enumerate(self.scratch_ranges(cache, cache.record.history, cache.record.capacity)):
                self.set_scratch(cache, g, rng, stream)

    def release_scratch(self, cache: KVCache) -> None:
        """Give back every scratch slot of the cache."""
        for g in range(len(cache.record.scratch)):
            if cache.record.scratch[g].size:
                self.set_scratch(cache, g, HalfOpenRange(0, 0))

    def set_scratch_reuse(self, cache: KVCache, enable: bool) -> None:
        """Turn sliding-window scratch slots on or off for the cache: refused (ScratchInUseError) while
        its current step ``[history_length, capacity)`` would use scratch blocks, either way, and
        (ConfigError) turning it on when the manager's configuration has it off."""
        with self.state.lock:
            if enable == cache.record.swa_scratch_reuse:
                return
            if enable and self.state.init_config.swa_scratch_reuse is None:
                raise ConfigError(f"KVCache {cache.id}: cannot enable SWA scratch reuse for a request when it is "
                                  f"disabled in the manager's configuration (swa_scratch_reuse=None)")
            if any(self.scratch_ranges(cache, cache.record.history, cache.record.capacity, enabled=True)):
                verb = "enable" if enable else "disable"
                raise ScratchInUseError(f"KVCache {cache.id}: cannot {verb} SWA scratch reuse while scratch blocks "
                                        f"are needed by the step [{cache.record.history}, {cache.record.capacity})")
            if not enable:
                self.release_scratch(cache)

    def switch_stream(self, cache: KVCache, stream: Any) -> None:
        """An active cache moving to ``stream``: the new stream waits for the work queued on the old."""
        if cache.state is CacheState.ACTIVE:
            self.parts.streams.hand_over(cache.record.stream, stream)

    def encode_tokens(self, tokens: Any, what: str) -> TokenArray:
        """``tokens`` (ids, or 32-byte multimodal digests under ``v2_sha256_packed`` keys) as the manager's
        int64 token array."""
        return self.state.encode_tokens(tokens, what)

    def decode_tokens(self, tokens: TokenArray) -> list[int | bytes]:
        """The ids and digests an int64 token array of this manager stands for."""
        return self.state.digests.decode(tokens)

    def check_commit(self, cache: KVCache, num_new: int) -> None:
        """Refuse a commit the recurrent layer groups cannot snapshot (see ``RecurrentStates.check_commit``)."""
        self.parts.recurrent.check_commit(cache, num_new)

    def on_commit(self, cache: KVCache, priority: int | None = None, is_end: bool = False) -> None:
        """After a commit: publish the newly full blocks to other streams and enter them into the prefix
        tree. With recurrent layers a commit ending inside a block enters that partial block too, with a
        snapshot of the state there (the state slot itself when ``is_end``: no commit follows)."""
        with self.state.lock:
            done, full = cache.record.published_blocks, cache.num_committed_tokens // self.state.layout.tokens_per_block
            if full > done:   # pages others may now reuse: ready once this request's writes are
                for g, (blocks, tiers) in enumerate(zip(cache.record.blocks, cache.record.tiers, strict=True)):
                    self.parts.streams.stamp(g, blocks[done:full], tiers[done:full], cache.record.stream)
                cache.record.published_blocks = full
            if self.state.config.enable_prefix_reuse:
                self.parts.reuse.insert_committed(cache, priority)
                if priority is None and cache.priority_callback is not None and full > done:
                    self.apply_priority_callback(cache, done, full)
                if self.state.recurrent_groups and self.state.stores_tail_blocks \
                        and cache.num_committed_tokens % self.state.layout.tokens_per_block:
                    self.enter_partial(cache, share_state=is_end)
            self.parts.usage.sample_usage()

    def life_cycles(self) -> list[AttnLifeCycle | SsmLifeCycle]:
        """The life cycle of each layer group (attention, or the recurrent one), in layer group order."""
        tpb = self.state.layout.tokens_per_block
        return [SsmLifeCycle() if lg.recurrent else AttnLifeCycle.make(lg.window, lg.sink_tokens, tpb)
                for lg in self.state.layout.layer_groups]

    def prioritize_blocks(self, cache: KVCache, start: int, stop: int) -> None:
        """Ask the cache's ``custom_priority_callback(ordinal, life cycle)`` for the eviction priority of
        blocks ``[start, stop)`` as they are allocated (the highest over its life cycles); their tree
        blocks get it when committed."""
        callback = cache.priority_callback
        assert callback is not None
        cycles = self.life_cycles()
        for ordinal in range(start, stop):
            if ordinal not in cache.record.block_priority:
                cache.record.block_priority[ordinal] = check_priority(
                    max(int(callback(ordinal, lc)) for lc in cycles), f"KVCache {cache.id}.custom_priority_callback")

    def apply_priority_callback(self, cache: KVCache, start: int, stop: int) -> None:
        """Give the tree blocks of the cache's newly committed blocks ``[start, stop)`` the priority
        ``custom_priority_callback`` gave them (asked now for a block that has none yet)."""
        self.prioritize_blocks(cache, start, stop)
        for ordinal in range(start, min(stop, len(cache.record.tree_nodes))):
            node = cache.record.tree_nodes[ordinal]
            if node is not None:
                self.parts.reuse.set_node_priority(node, cache.record.block_priority[ordinal])

    def release_out_of_window(self, cache: KVCache) -> None:
        """Free sliding-window pages no future token can attend to (their ids become -1)."""
        layout = self.state.layout
        tpb = layout.tokens_per_block
        if self.windows_of is not layout:       # (layer group, window, sink blocks) of the windowed groups
            self.windows = [(lg.layer_group_id, lg.window, math.ceil(lg.sink_tokens / tpb))
                            for lg in layout.layer_groups if lg.window is not None]
            self.windows_of = layout
        history = cache.record.history
        for lg_id, window, sink_blocks in self.windows:
            first_needed = max(0, history - window + 1) // tpb
            if first_needed <= sink_blocks:
                continue
            blocks = cache.record.blocks[lg_id]
            stale = blocks[sink_blocks:first_needed]
            if stale.max(initial=-1) >= 0:      # some page still held there
                with self.state.lock:
                    released = stale.copy()
                    released_tiers = cache.record.tiers[lg_id][sink_blocks:first_needed].copy()
                    self.release(lg_id, released, released_tiers, cache.record.stream)
                    blocks[sink_blocks:first_needed] = -1
                    if self.state.drops_stale_window_pages:
                        self.parts.reuse.drop_window_pages(cache, lg_id, sink_blocks, released, released_tiers)
        for scratch in cache.record.scratch:
            if scratch.size:
                self.sync_scratch(cache)
                break

    def drop(self, cache: KVCache) -> None:
        """Queue an unclosed cache its owner dropped (called from ``KVCache.__del__``, at any point of
        any thread: nothing is closed here, the manager's next entry point closes it)."""
        self.state.dropped.append(cache)

    def reap_dropped(self) -> None:
        """Close the caches their owners dropped unclosed."""
        with self.state.lock:
            while self.state.dropped:
                self.state.dropped.pop().close()

    def close(self, cache: KVCache) -> None:
        """Release every page and scratch slot of the cache and commit its pending statistics (the
        auto-tuner samples its length first)."""
        with self.state.lock:
            self.parts.tuner.on_close(cache)
            self.store_tail(cache)
            for g, (blocks, tiers) in enumerate(zip(cache.record.blocks, cache.record.tiers, strict=True)):
                self.release(g, blocks, tiers, cache.record.stream)
            self.release_scratch(cache)
            self.state.caches.pop(cache.id, None)
            self.parts.reuse.touch_blocks(cache, 0, len(cache.record.tree_nodes))
            if cache.record.partial_src is not None:
                self.state.tree.touch(cache.record.partial_src)
                cache.record.partial_src = None
            self.state.stats.commit(cache.id, cache.record.pending)
            self.parts.usage.sample_usage()

    def store_tail(self, cache: KVCache) -> None:
        """Enter the cache's partial last committed block into the prefix tree (a reference-API
        manager's request ending its commits: ``stop_committing``, ``commit(is_end=True)``, close); its
        page is published to other streams once the request's writes are done. With recurrent layers
        the commit that ended inside the block entered it already (with the state snapshot there)."""
        with self.state.lock:
            if self.state.config.enable_prefix_reuse and self.state.stores_tail_blocks \
                    and not self.state.recurrent_groups:
                self.enter_partial(cache, share_state=False)

    def enter_partial(self, cache: KVCache, *, share_state: bool) -> None:
        """Enter the cache's partial last committed block into the prefix tree and publish the pages it
        gave to other streams once the request's writes are done."""
        if self.parts.reuse.enter_tail(cache, share_state=share_state) is None:
            return
        b = cache.num_committed_tokens // self.state.layout.tokens_per_block
        for g, (blocks, tiers) in enumerate(zip(cache.record.blocks, cache.record.tiers, strict=True)):
            rows = slice(0, 1) if g in self.state.recurrent_groups else slice(b, b + 1)
            self.parts.streams.stamp(g, blocks[rows], tiers[rows], cache.record.stream)

    def count_reused_levels(self, cache: KVCache, plan: Any) -> None:
        """Record where the reused pages of a new cache were: per block, the coldest level among its
        layer groups' pages (what resuming has to fetch from)."""
        if plan.num_tokens == 0:
            return
        tpb = self.state.layout.tokens_per_block
        full = len(plan.nodes)
        levels = len(self.state.tiers)
        for b in range(plan.pages.shape[0]):
            live = plan.pages[b] >= 0
            level = int(plan.tiers[b][live].max()) if live.any() else 0
            tokens = min(tpb, plan.num_tokens - b * tpb)
            cache.reused_tokens_by_level[level] += tokens
            self.state.cached_tokens_by_level[level] += tokens
            for lg in np.flatnonzero(live).tolist():
                rec = self.state.reused_blocks_by_level.setdefault(
                    LifeCycleId(lg), ReusedBlocksByLevel([0] * levels, [0] * levels))
                (rec.full if b < full else rec.partial)[int(plan.tiers[b][lg])] += 1

    def plan_drop(self, cache: KVCache) -> PlannedDropHandle | None:
        """A handle dropping, later, what the tree keeps only to continue exactly where the cache ends
        (None: it has no block there). With sliding-window layer groups that is their pages of the
        window (and sinks) before the end, as the reference drops a conversation's endpoint: older
        full-attention blocks stay reusable, and so do other conversations' windows. Without one, the
        cache's chain leaves the tree from its end back while only the tree holds it."""
        nodes = [n for n in cache.record.tree_nodes if n is not None]
        if not nodes and cache.record.tail_node is None:
            return None
        if self.state.has_windows or self.state.recurrent_groups:
            if self.parts.reuse.endpoint_cut_short(cache):
                return None     # the endpoint no longer matches exactly (a page holds fewer tokens)
            with self.state.lock:
                pairs = self.parts.reuse.window_nodes(cache)
                for node, lg in pairs:      # a page several open plans name goes with the last of them
                    key = (id(node), lg)
                    self.state.planned_drops[key] = self.state.planned_drops.get(key, 0) + 1
            return PlannedDropHandle(lambda: self.drop_pages(pairs))
        return PlannedDropHandle(lambda: self.drop_chain(nodes))

    def committed_page_in_tree(self, cache: KVCache, ordinal: int, layer_group: int) -> bool | None:
        """Whether the cache's page of block ``ordinal`` in ``layer_group`` is a prefix-tree block's page
        now (None: no page there, or the block holds no committed token). A committed page stops being
        one when a wider page replaces it in its block, or its block leaves the tree: the request then
        holds it as a private page, tied to no block."""
        with self.state.lock:
            blocks, tiers = cache.record.blocks[layer_group], cache.record.tiers[layer_group]
            if layer_group in self.state.recurrent_groups or not 0 <= ordinal < blocks.size \
                    or blocks[ordinal] < 0 or ordinal * self.state.layout.tokens_per_block >= cache.num_committed_tokens:
                return None
            pg = self.state.lg_pool_group[layer_group]
            owner = self.state.tree_owner[int(tiers[ordinal])][pg].get(int(blocks[ordinal]))
            return owner is not None and not owner[0].removed

    def planned_drop_count(self, node: BlockNode, layer_group: int) -> int:
        """Open planned drops naming ``node``'s page of ``layer_group``."""
        return self.state.planned_drops.get((id(node), layer_group), 0)

    def drop_pages(self, pairs: list[tuple[BlockNode, int]]) -> None:
        """Run a planned drop of sliding-window pages and recurrent snapshots (see ``plan_drop``): the
        pages no other open plan names."""
        with self.state.lock:
            last: list[tuple[BlockNode, int]] = []
            for node, lg in pairs:
                key = (id(node), lg)
                left = self.state.planned_drops.get(key, 1) - 1
                if left > 0:
                    self.state.planned_drops[key] = left
                    continue
                self.state.planned_drops.pop(key, None)
                last.append((node, lg))
            self.parts.reuse.drop_node_pages(last)
            self.parts.usage.sample_usage()

    def drop_chain(self, nodes: list[BlockNode]) -> None:
        """Take a chain's blocks out of the tree from its end back, while each is a leaf that only the
        tree holds (a block another chain continues, or a request shares, stays)."""
        with self.state.lock:
            victims: list[BlockNode] = []
            flat_pages: list[int] = []
            flat_tiers: list[int] = []
            for node in reversed(nodes):
                if node.removed or not node.is_leaf or not self.parts.eviction.tree_only(node):
                    break
                self.state.tree.remove(node)
                victims.append(node)
                flat_pages.extend(node.pages.tolist())
                flat_tiers.extend(int(t) for t in node.tiers.tolist())
            self.parts.eviction.evict_all(victims, flat_pages, flat_tiers)
            self.parts.usage.sample_usage()

    def prefetch(self, cache: KVCache, target: int) -> bool:
        """Move a cache's pages in levels colder than ``target`` up to ``target``; False when that level
        has no room for them (pages already moved stay)."""
        with self.state.lock:
            self.state.check_tier_index(target)
            if target == 0:
                return cache.state is CacheState.ACTIVE or self.resume(cache, cache.record.stream)
            for pg, by_tier in self.parts.quotas.offloaded_pages(cache).items():
                colder = {t: src for t, src in by_tier.items() if t > target}
                n = sum(src.size for src in colder.values())
                if not n:
                    continue
                alloc = self.state.alloc_of(target, pg)
                if alloc.num_free < n:
                    self.parts.eviction.make_room_in(target, pg, n - alloc.num_free)
                colder = {t: src for t, src in self.parts.quotas.offloaded_pages(cache).get(pg, {}).items() if t > target}
                n = sum(src.size for src in colder.values())
                if alloc.num_free < n:
                    return False
                jobs = [(t, src, target, alloc.alloc(src.size)) for t, src in sorted(colder.items())]
                self.parts.movement.copy_pages(pg, jobs)
                for t, src, _, dst in jobs:
                    self.parts.movement.relocate(pg, t, src, target, dst)
                    if isinstance(self.state.tiers[t], DiskTierStorage):
                        self.state.disk_prefetch_blocks += int(src.size)
            return True

    # --- what a KVCache calls besides its life cycle ---------------------------------------------------
    @property
    def layout(self) -> CacheLayoutDesc:
        """The manager's published layout."""
        return self.state.layout

    def check_stream(self, stream: Any, what: str) -> Any:
        """``stream`` validated for the primary device (see ``StreamOrdering.check_stream``)."""
        return self.parts.streams.check_stream(stream, what)

    def commit_stats(self, cache: KVCache) -> KVCacheStatsDelta:
        """Commit a request's pending statistics."""
        return self.parts.usage.commit_stats(cache)

    def discard_stats(self, cache: KVCache) -> None:
        """Forget a request's pending statistics."""
        self.parts.usage.discard_stats(cache)

    def set_priority(self, cache: KVCache, priority: int) -> None:
        """Set the eviction priority of a request's tree blocks."""
        self.parts.reuse.set_priority(cache, priority)


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
        if dict(config.extra).get(EXTRA_POOL_RATIO):
            granularity = self._state.planner.granularity(primary.quota_bytes)
            plan = plan_layout(config, num_slots=self._state.planner.slot_counts(
                primary.quota_bytes, self._state.planner.initial_ratio(init_cfg, granularity), granularity))
        planned = sum(pool.nbytes for pg in plan.pool_groups for pool in pg.pools)
        if planned > primary.quota_bytes:     # slot floors raised the primary level past its quota
            self._state.current = dataclasses.replace(
                config, tiers=(dataclasses.replace(primary, quota_bytes=planned), *config.tiers[1:]))
        device = torch.device(primary.device)
        self._state.device = device
        self._state.pools = [
            [allocate_pool(pool.nbytes, primary.device) for pool in pg.pools] for pg in plan.pool_groups]
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
                if isinstance(tier, HostTier):
                    try:
                        self._state.tiers.append(tier_storage.open_host_tier(config, tier))
                    except HOST_TIER_SETUP_ERRORS as exc:
                        self._state.host_tier_error = f"{type(exc).__name__}: {exc}"
                        _log.warning("KVCacheManager: the host tier (%d bytes) could not be set up (%s); running "
                                     "without it", tier.quota_bytes, self._state.host_tier_error)
                        continue
                    self._state.media.append(HOST_MEDIUM)
                elif isinstance(tier, DiskTier):
                    self._state.tiers.append(DiskTierStorage(config, tier))
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
        group's share of the primary bytes off its target by more than ``rebalance_ratio_threshold``."""
        return self._parts.tuner.need_adjustment

    def adjust(self) -> None:
        """Re-split the primary slots between pool groups by the tuner's target ratio (every kv cache
        suspended or closed: ManagerBusyError otherwise). Pages survive; a pool group that grows gets
        new memory, so re-read base addresses (``layout``, ``get_mem_pool_base_address``) after it."""
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
