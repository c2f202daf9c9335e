"""CacheLifecycle: the manager's part that opens, resumes, resizes, commits and closes kv caches
(docs/architecture.md, the cache manager's parts)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.common import (
    AttnLifeCycle,
    HalfOpenRange,
    LifeCycleId,
    PlannedDropHandle,
    SsmLifeCycle,
    overlap,
)
from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.events import Created, layer_group_subset
from kvxfer.cache.hashing import (
    ExtraKeys,
    ReuseScope,
    TokenIdExt,
    check_extra_keys,
)
from kvxfer.cache.kv_cache import CacheState, KVCache, PriorityCallback
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.prefix_reuse import check_scope
from kvxfer.cache.radix_tree import BlockNode, check_priority
from kvxfer.cache.scratch import scratch_range, scratch_share, scratch_slots_needed
from kvxfer.cache.stats import (
    KVCacheStatsDelta,
    ReusedBlocksByLevel,
)
from kvxfer.cache.tiers import DiskTierStorage
from kvxfer.errors import (
    CacheStateError,
    ConfigError,
    ManagerBusyError,
    OutOfSlotsError,
    ScratchInUseError,
)

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]
TokenArray = npt.NDArray[np.int64]

_log = logging.getLogger(__name__)


class CacheLifecycle:
    """The kv caches' life cycle: creation, resume/suspend, resize, commit, close, planned drops and
    prefetch, on the shared state and the other parts (what a KVCache calls)."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
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
            self.parts.tuner.on_create(cache)
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
        delta: KVCacheStatsDelta = self.parts.usage.commit_stats(cache)
        return delta

    def discard_stats(self, cache: KVCache) -> None:
        """Forget a request's pending statistics."""
        self.parts.usage.discard_stats(cache)

    def set_priority(self, cache: KVCache, priority: int) -> None:
        """Set the eviction priority of a request's tree blocks."""
        self.parts.reuse.set_priority(cache, priority)


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
