"""Cache statistics in the reference design's shapes: per-request pending deltas committed or
discarded by the request (``KVCacheStatsDelta``), per-iteration counters per layer group
(``KVCacheIterationStatsDelta``), peak block counts per pool group and cache level
(``PoolGroupPeakBlockStats``), and the slot accounting every pool group must balance.

Block counts are per layer group block positions (a position of a sliding-window group that needs
no page still counts where noted in docs/cache.md).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from kvxfer.errors import KVCacheError

DeltaT = TypeVar("DeltaT", bound="StatsDelta")


class StatsDelta:
    """Field-wise arithmetic shared by the delta records (every field an int counter)."""

    __slots__ = ()

    def add(self, other: Any) -> None:
        """Add ``other``'s counters to these."""
        for f in fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def subtract(self, other: Any) -> None:
        """Subtract ``other``'s counters from these."""
        for f in fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, getattr(self, f.name) - getattr(other, f.name))

    def clear(self) -> None:
        """Reset every counter to 0."""
        for f in fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, 0)

    def copy(self: DeltaT) -> DeltaT:
        """An independent copy."""
        return type(self)(**{f.name: getattr(self, f.name) for f in fields(self)})  # type: ignore[arg-type]

    @property
    def empty(self) -> bool:
        """Whether every counter is 0."""
        return all(getattr(self, f.name) == 0 for f in fields(self))  # type: ignore[arg-type]


@dataclass(slots=True)
class KVCacheStatsDelta(StatsDelta):
    """Block counters of a request (or, summed, of the manager).

    alloc_total = blocks placed in the request (new + reused); alloc_new = fresh blocks a resize
    allocated; reused = prompt blocks taken from the prefix tree (fully or partially); missed =
    fresh blocks inside the prompt (their KV had to be computed).
    """

    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0


@dataclass(slots=True)
class KVCacheIterationStatsDelta(StatsDelta):
    """One layer group's counters since the last ``get_and_reset_iteration_stats``.

    The allocation, reuse, miss and generation counters come from requests' committed pending
    stats; the copy counters (onboard: to a warmer tier, offload: to a colder tier, intra-device:
    copy-on-write of a partially reused block and primary slot rebalancing) and the dropped counters
    (pages dropped from a tier below the primary) are recorded as they happen.
    """

    iter_alloc_total_blocks: int = 0
    iter_alloc_new_blocks: int = 0
    iter_reused_blocks: int = 0
    iter_full_reused_blocks: int = 0
    iter_partial_reused_blocks: int = 0
    iter_missed_blocks: int = 0
    iter_gen_alloc_blocks: int = 0
    iter_onboard_blocks: int = 0
    iter_onboard_bytes: int = 0
    iter_offload_blocks: int = 0
    iter_offload_bytes: int = 0
    iter_intra_device_copy_blocks: int = 0
    iter_intra_device_copy_bytes: int = 0
    iter_host_dropped_blocks: int = 0
    iter_host_dropped_bytes: int = 0

    @property
    def iter_cache_hit_rate(self) -> float:
        """reused / (reused + missed) blocks; 0.0 when nothing was looked up."""
        total = self.iter_reused_blocks + self.iter_missed_blocks
        return self.iter_reused_blocks / total if total else 0.0


@dataclass(slots=True)
class SsmSnapshotIterationStatsDelta(StatsDelta):
    """One recurrent (SSM) life cycle's snapshot lookups since the last reset: per prefix lookup of a
    new request, a hit (a snapshot restored some tokens; aligned when they end on a block boundary) or
    a miss, and the lookup's tokens reused and not reused."""

    iter_snapshot_lookups: int = 0
    iter_snapshot_hits: int = 0
    iter_snapshot_misses: int = 0
    iter_reused_tokens: int = 0
    iter_unreused_tokens: int = 0
    iter_aligned_snapshot_hits: int = 0
    iter_unaligned_snapshot_hits: int = 0

    @property
    def iter_snapshot_hit_rate(self) -> float:
        """hits / lookups; 0.0 without lookups."""
        return self.iter_snapshot_hits / self.iter_snapshot_lookups if self.iter_snapshot_lookups else 0.0


@dataclass(slots=True)
class ReusedBlocksByLevel:
    """Reused blocks split by the cache level their pages were on: ``full[i]`` / ``partial[i]`` for
    level ``i`` (the configured tiers in order)."""

    full: list[int]
    partial: list[int]


@dataclass(frozen=True, slots=True)
class StorageStatistics:
    """Slot counts of one pool group at one cache level."""

    slot_sizes: list[int]
    total: int
    free: int
    evictable: int

    @property
    def available(self) -> int:
        """Slots an allocation can get: free now or after eviction."""
        return self.free + self.evictable

    @property
    def unavailable(self) -> int:
        """Slots held by requests."""
        return self.total - self.available


@dataclass(frozen=True, slots=True)
class PoolGroupPeakBlockStats:
    """Highest available (free or evictable), unavailable and evictable slot counts of one pool group
    of one cache level since the last read (each maximum taken on its own)."""

    available: int
    unavailable: int
    evictable: int


@dataclass(frozen=True)
class AllocationSegment:
    """Blocks ``[begin, end)`` one resize allocated: what its counters depend on, so that a shrink
    before the commit can take back the part it undoes. ``prompt_blocks`` is None when the prompt
    length is unknown; ``scratch[lg]`` is the (begin, end) range of scratch positions (no page)."""

    begin: int
    end: int
    prompt_blocks: int | None
    scratch: tuple[tuple[int, int], ...]

    def delta(self, lo: int, hi: int) -> tuple[KVCacheStatsDelta, list[KVCacheIterationStatsDelta]]:
        """The request delta and per-layer-group iteration deltas of positions ``[lo, hi)`` of this
        segment: each position is one new block, missed inside the prompt, generation past it; a layer
        group counts a page (and a generation page) for it unless it is a scratch position there."""
        lo, hi = max(lo, self.begin), min(hi, self.end)
        n = max(0, hi - lo)
        prompt = 0 if self.prompt_blocks is None else self.prompt_blocks
        missed = max(0, min(hi, prompt) - lo) if n else 0
        gen = 0 if self.prompt_blocks is None or not n else max(0, hi - max(lo, prompt))
        request = KVCacheStatsDelta(alloc_total_blocks=n, alloc_new_blocks=n, missed_blocks=missed)
        per_lg = []
        gen_lo = hi - gen
        for begin, end in self.scratch:
            pages = n - max(0, min(hi, end) - max(lo, begin))
            gen_pages = gen - max(0, min(hi, end) - max(gen_lo, begin))
            per_lg.append(KVCacheIterationStatsDelta(iter_alloc_total_blocks=pages, iter_alloc_new_blocks=pages,
                                                     iter_missed_blocks=missed, iter_gen_alloc_blocks=gen_pages))
        return request, per_lg


@dataclass
class PendingStats:
    """A request's counters not yet committed: its own delta, one iteration delta per layer group, and
    the allocations they include (a shrink before the commit takes its share back)."""

    request: KVCacheStatsDelta = field(default_factory=KVCacheStatsDelta)
    iteration: dict[int, KVCacheIterationStatsDelta] = field(default_factory=dict)
    segments: list[AllocationSegment] = field(default_factory=list)
    #: Snapshot lookups per recurrent layer group.
    ssm: dict[int, SsmSnapshotIterationStatsDelta] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """Whether nothing is pending."""
        return self.request.empty and all(d.empty for d in self.iteration.values()) \
            and all(d.empty for d in self.ssm.values())

    def layer_group(self, layer_group_id: int) -> KVCacheIterationStatsDelta:
        """The pending iteration delta of one layer group (created empty on first use)."""
        return self.iteration.setdefault(layer_group_id, KVCacheIterationStatsDelta())

    def clear(self) -> None:
        """Forget everything pending."""
        self.request.clear()
        self.iteration.clear()
        self.segments.clear()
        self.ssm.clear()

    def add_allocation(self, segment: AllocationSegment) -> None:
        """Count a resize's new blocks."""
        request, per_lg = segment.delta(segment.begin, segment.end)
        self.request.add(request)
        for lg, delta in enumerate(per_lg):
            self.layer_group(lg).add(delta)
        self.segments.append(segment)

    def take_back(self, begin: int, end: int) -> None:
        """Subtract what the pending allocations counted for blocks ``[begin, end)`` (they are being
        freed before the commit, so they never happened as far as the statistics go)."""
        kept = []
        for seg in self.segments:
            request, per_lg = seg.delta(begin, end)
            self.request.subtract(request)
            for lg, delta in enumerate(per_lg):
                self.layer_group(lg).subtract(delta)
            if seg.begin < begin:
                kept.append(AllocationSegment(seg.begin, min(seg.end, begin), seg.prompt_blocks, seg.scratch))
            elif seg.end > end:
                kept.append(AllocationSegment(end, seg.end, seg.prompt_blocks, seg.scratch))
        self.segments = kept


@dataclass(frozen=True)
class SlotAccounting:
    """Where a pool group's slots are: free + request_only + evictable + shared == total.

    request_only: held by requests, not in the prefix tree; evictable: held by the tree only;
    shared: held by the tree and at least one request.
    """

    pool_group: int
    total: int
    free: int
    request_only: int
    evictable: int
    shared: int

    def __post_init__(self) -> None:
        if self.free + self.request_only + self.evictable + self.shared != self.total:
            raise KVCacheError(f"pool group {self.pool_group}: slot accounting does not balance: free "
                               f"{self.free} + request-only {self.request_only} + evictable {self.evictable}"
                               f" + shared {self.shared} != total {self.total}")

    @property
    def available(self) -> int:
        """Slots an allocation can get: free now or after eviction."""
        return self.free + self.evictable

    @property
    def used(self) -> int:
        """Slots held by at least one request."""
        return self.request_only + self.shared


@dataclass(frozen=True)
class TierTraffic:
    """Pages moved between tiers since the manager started: pages offloaded into each tier, pages
    onboarded from each tier (both indexed by tier, 0 = primary), tree blocks dropped, bytes copied."""

    offloaded_pages: tuple[int, ...]
    onboarded_pages: tuple[int, ...]
    dropped_blocks: int
    bytes_moved: int


class TierTrafficCounter:
    """Accumulates TierTraffic (always on: a few integer additions per batch)."""

    def __init__(self, num_tiers: int) -> None:
        self._offloaded = [0] * num_tiers
        self._onboarded = [0] * num_tiers
        self._dropped = 0
        self._bytes = 0

    def moved(self, src_tier: int, dst_tier: int, pages: int, nbytes: int) -> None:
        """Count ``pages`` (``nbytes`` in all) moved from ``src_tier`` to ``dst_tier``."""
        if dst_tier > src_tier:
            self._offloaded[dst_tier] += pages
        elif dst_tier < src_tier:
            self._onboarded[src_tier] += pages
        self._bytes += nbytes

    def dropped(self, blocks: int = 1) -> None:
        """Count tree blocks dropped."""
        self._dropped += blocks

    def snapshot(self) -> TierTraffic:
        """The counters so far."""
        return TierTraffic(tuple(self._offloaded), tuple(self._onboarded), self._dropped, self._bytes)


class StatsCollector:
    """Committed totals, per-iteration counters per layer group, peaks per cache level and pool group,
    and the dirty / excluded request ids; inert (records nothing) when disabled."""

    def __init__(self, enabled: bool, num_levels: int, num_pool_groups: int) -> None:
        self.enabled = enabled
        self.committed = KVCacheStatsDelta()
        self.iteration: dict[int, KVCacheIterationStatsDelta] = {}
        self.ssm_iteration: dict[int, SsmSnapshotIterationStatsDelta] = {}
        self.dirty: set[Hashable] = set()
        self.excluded: set[Hashable] = set()
        self._peaks: list[list[list[int] | None]] = [[None] * num_pool_groups for _ in range(num_levels)]

    def records(self, cache_id: Hashable) -> bool:
        """Whether counters of request ``cache_id`` are recorded (stats on, the id not excluded)."""
        return self.enabled and cache_id not in self.excluded

    def commit(self, cache_id: Hashable, pending: PendingStats) -> KVCacheStatsDelta:
        """Merge a request's pending counters into the totals and the iteration; returns its delta
        (empty, and nothing merged, for an excluded request)."""
        if cache_id in self.excluded:
            pending.clear()
        out = pending.request.copy()
        if self.enabled:
            self.committed.add(pending.request)
            for lg, delta in pending.iteration.items():
                self.iteration.setdefault(lg, KVCacheIterationStatsDelta()).add(delta)
            for lg, snap in pending.ssm.items():
                self.ssm_iteration.setdefault(lg, SsmSnapshotIterationStatsDelta()).add(snap)
        pending.clear()
        self.dirty.discard(cache_id)
        return out

    def discard(self, cache_id: Hashable, pending: PendingStats) -> None:
        """Drop a request's pending counters."""
        pending.clear()
        self.dirty.discard(cache_id)

    def take_ssm_iteration(self) -> dict[int, SsmSnapshotIterationStatsDelta]:
        """The snapshot counters of the recurrent layer groups since the last call (``{}`` when none
        were committed); they restart empty."""
        out = {lg: d for lg, d in self.ssm_iteration.items() if not d.empty}
        self.ssm_iteration = {}
        return out

    def traffic(self, layer_group: int) -> KVCacheIterationStatsDelta | None:
        """The current iteration's delta of a layer group for copy counters (None when disabled)."""
        if not self.enabled:
            return None
        return self.iteration.setdefault(layer_group, KVCacheIterationStatsDelta())

    def take_iteration(self) -> dict[int, KVCacheIterationStatsDelta]:
        """The iteration's counters of the layer groups that counted anything (``{}`` when nothing
        happened or stats are disabled, as in the reference); they restart empty."""
        if not self.enabled:
            return {}
        out = {lg: d for lg, d in sorted(self.iteration.items()) if not d.empty}
        self.iteration = {}
        return out

    def sample(self, level: int, accounting: SlotAccounting) -> None:
        """Fold one pool group's current accounting of cache level ``level`` into its peaks."""
        if not self.enabled:
            return
        values = [accounting.available, accounting.total - accounting.available, accounting.evictable]
        peak = self._peaks[level][accounting.pool_group]
        self._peaks[level][accounting.pool_group] = values if peak is None else [
            max(a, b) for a, b in zip(peak, values, strict=True)]

    def take_peaks(self, level: int, current: list[SlotAccounting]) -> tuple[PoolGroupPeakBlockStats, ...]:
        """The peaks of a cache level since the last read, restarting from ``current`` (the present
        accounting, one per pool group). Never a made-up 0: a pool group never sampled, or any pool
        group with stats disabled, reports the present accounting."""
        out = []
        for acc in current:
            peak = self._peaks[level][acc.pool_group] if self.enabled else None
            now = [acc.available, acc.total - acc.available, acc.evictable]
            vals = now if peak is None else [max(a, b) for a, b in zip(peak, now, strict=True)]
            out.append(PoolGroupPeakBlockStats(*vals))
            if self.enabled:
                self._peaks[level][acc.pool_group] = now
        return tuple(out)
