"""The manager's statistics API (the reference design's): slot accounting, peaks per cache level,
per-request pending counters committed or discarded, dirty and excluded request ids."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import numpy as np

from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.stats import (
    AllocationSegment,
    KVCacheIterationStatsDelta,
    KVCacheStatsDelta,
    PoolGroupPeakBlockStats,
    SlotAccounting,
)
from kvxfer.errors import KVCacheError


class UsageStats:
    """Slot accounting and the statistics API."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts``, through which this part reaches the others."""
        self.state = state
        self.parts = parts

    def slot_accounting(self, pool_group: int = 0, tier: int = 0) -> SlotAccounting:
        """Where the usable slots of a pool group of a tier (0 = primary) are (free, request-only,
        evictable, shared); raises KVCacheError when the reference counts contradict the tree."""
        with self.state.lock:
            self.state.check_tier_index(tier)
            alloc = self.state.alloc_of(tier, pool_group)
            rc = alloc.refcount[:alloc.usable]
            tree = self.state.in_tree_t[tier][pool_group][:alloc.usable]
            where = f"pool group {pool_group}" + (f" of the {self.state.tiers[tier].name} tier" if tier else "")
            beyond = np.flatnonzero(alloc.refcount[alloc.usable:])
            if beyond.size:
                raise KVCacheError(f"{where}: slot {alloc.usable + int(beyond[0])} is in use beyond the "
                                   f"{alloc.usable} usable slots")
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

    def quick_accounting(self, tier: int, pool_group: int) -> SlotAccounting:
        """``slot_accounting`` without its cross-checks: O(1) counts plus one pass over the tree mask."""
        alloc = self.state.alloc_of(tier, pool_group)
        tree = self.state.in_tree_t[tier][pool_group]
        tree_pages = int(np.count_nonzero(tree))
        evictable = int(np.count_nonzero(alloc.refcount[tree] == 1)) if tree_pages else 0
        return SlotAccounting(pool_group, alloc.usable, alloc.num_free, alloc.num_used - tree_pages, evictable,
                              tree_pages - evictable)

    def sample_usage(self) -> None:
        """Feed the peak tracker of every cache level after an allocation change."""
        if not self.state.stats.enabled:
            return
        for tier in range(len(self.state.tiers)):
            for pg in range(len(self.state.allocators)):
                self.state.stats.sample(tier, self.quick_accounting(tier, pg))

    def commit_stats(self, cache: KVCache) -> KVCacheStatsDelta:
        """Merge a request's pending counters into the committed and iteration stats; returns them."""
        with self.state.lock:
            return self.state.stats.commit(cache.id, cache.record.pending)

    def discard_stats(self, cache: KVCache) -> None:
        """Forget a request's pending counters."""
        with self.state.lock:
            self.state.stats.discard(cache.id, cache.record.pending)

    def mark_pending(self, cache: KVCache) -> None:
        """Mark a request dirty when it has pending counters to commit."""
        if not cache.record.pending.empty:
            self.state.stats.dirty.add(cache.id)

    def get_committed_stats(self) -> KVCacheStatsDelta:
        """Every request's committed counters summed since the manager started (a copy)."""
        with self.state.lock:
            return self.state.stats.committed.copy()

    def get_and_reset_iteration_stats(self) -> dict[int, KVCacheIterationStatsDelta]:
        """Per layer group that counted anything: counters committed (and copies made) since the last
        call; ``{}`` when nothing happened or ``enable_stats`` is off."""
        with self.state.lock:
            return self.state.stats.take_iteration()

    def get_and_reset_iteration_peak_block_stats(self, cache_level: int = 0) -> tuple[PoolGroupPeakBlockStats, ...]:
        """Per pool group of cache level ``cache_level`` (tier index, 0 = primary): the peak available /
        unavailable / evictable slots since the last call; they restart from the present state. With
        stats off, the present state."""
        with self.state.lock:
            self.state.check_tier_index(cache_level)
            current = [self.quick_accounting(cache_level, pg) for pg in range(len(self.state.allocators))]
            return self.state.stats.take_peaks(cache_level, current)

    def get_and_reset_iteration_peak_block_stats_by_level(self) -> tuple[tuple[PoolGroupPeakBlockStats, ...], ...]:
        """``get_and_reset_iteration_peak_block_stats`` of every cache level, primary first."""
        with self.state.lock:
            return tuple(self.get_and_reset_iteration_peak_block_stats(t) for t in range(len(self.state.tiers)))

    def mark_stats_dirty(self, kv_cache_id: Hashable | None) -> None:
        """Mark a request as having pending statistics (requests mark themselves when they record)."""
        if kv_cache_id is not None:
            with self.state.lock:
                self.state.stats.dirty.add(kv_cache_id)

    def clear_stats_dirty(self, kv_cache_id: Hashable | None) -> None:
        """Unmark a request (committing or discarding its stats does this too)."""
        if kv_cache_id is not None:
            with self.state.lock:
                self.state.stats.dirty.discard(kv_cache_id)

    def get_dirty_stats_kv_cache_ids(self) -> set[Any]:
        """Ids of the requests with pending statistics: what a scheduler commits at the end of a step."""
        with self.state.lock:
            return set(self.state.stats.dirty)

    def mark_stats_excluded(self, kv_cache_id: Hashable | None) -> None:
        """Record nothing for request ``kv_cache_id`` from now on (warm-up or dummy requests): it leaves
        the dirty set and what it has pending is never committed. May precede the request's creation."""
        if kv_cache_id is not None:
            with self.state.lock:
                self.state.stats.excluded.add(kv_cache_id)
                self.state.stats.dirty.discard(kv_cache_id)

    def clear_stats_excluded(self, kv_cache_id: Hashable | None) -> None:
        """Record request ``kv_cache_id``'s statistics again."""
        if kv_cache_id is not None:
            with self.state.lock:
                self.state.stats.excluded.discard(kv_cache_id)

    def is_stats_excluded(self, kv_cache_id: Hashable | None) -> bool:
        """Whether request ``kv_cache_id``'s statistics are not recorded."""
        with self.state.lock:
            return kv_cache_id is not None and kv_cache_id in self.state.stats.excluded

    def count_allocation(self, cache: KVCache, old_n: int, new_n: int, spans: list[tuple[int, int]]) -> None:
        """Pending counters of a resize from ``old_n`` to ``new_n`` blocks: request counters per block
        position, iteration counters per layer group (pages actually allocated; scratch positions are
        missed but get no page). Inside the prompt a fresh block is missed, past it a generation one."""
        if not self.state.stats.records(cache.id):
            return
        prompt = cache.expected_prompt_length
        prompt_blocks = None if prompt is None else math.ceil(prompt / self.state.layout.tokens_per_block)
        cache.record.pending.add_allocation(AllocationSegment(old_n, new_n, prompt_blocks, tuple(spans)))
        self.mark_pending(cache)

    def uncount_allocation(self, cache: KVCache, new_n: int, old_n: int) -> None:
        """A shrink from ``old_n`` to ``new_n`` blocks takes back what uncommitted allocations of those
        blocks counted (the reference's reverted allocations report nothing)."""
        if cache.record.pending.segments:
            cache.record.pending.take_back(new_n, old_n)
