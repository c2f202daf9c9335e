"""Cache statistics: per-request pending deltas, per-iteration counters with a hit rate, peak slot
usage per pool group, and the slot accounting every pool group must balance.

Block counts are block *positions* of a request (one position spans every layer group).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvxfer.errors import KVCacheError


@dataclass
class RequestStats:
    """Counters of one request since the last ``commit_pending_stats``.

    allocated = blocks placed in the request (new + reused); new = fresh blocks from resize;
    reused_full / reused_partial = prompt blocks taken from the prefix tree; missed = prompt blocks
    that had to be computed.
    """

    allocated_blocks: int = 0
    new_blocks: int = 0
    reused_full_blocks: int = 0
    reused_partial_blocks: int = 0
    missed_blocks: int = 0

    def add(self, other: RequestStats) -> None:
        """Add ``other``'s counters to these."""
        for f in fields(RequestStats):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def is_zero(self) -> bool:
        """Whether nothing was counted."""
        return all(getattr(self, f.name) == 0 for f in fields(RequestStats))


@dataclass(frozen=True)
class IterationStats:
    """Counters merged from every request's pending deltas by one ``commit_pending_stats``."""

    requests: int = 0
    allocated_blocks: int = 0
    new_blocks: int = 0
    reused_full_blocks: int = 0
    reused_partial_blocks: int = 0
    missed_blocks: int = 0

    @property
    def reused_blocks(self) -> int:
        """Prompt blocks reused, fully or partially."""
        return self.reused_full_blocks + self.reused_partial_blocks

    @property
    def hit_rate(self) -> float:
        """reused / (reused + missed) prompt blocks; 0.0 when no prompt block was looked up."""
        looked_up = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / looked_up if looked_up else 0.0


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
class PoolGroupPeaks:
    """Highest available / evictable / used slot counts of a pool group since the last read."""

    pool_group: int
    max_available: int
    max_evictable: int
    max_used: int


class StatsCollector:
    """Merges request deltas into iteration counters and tracks peak usage; inert when disabled."""

    def __init__(self, enabled: bool, num_pool_groups: int) -> None:
        self.enabled = enabled
        self._num_pool_groups = num_pool_groups
        self._closed_pending: list[RequestStats] = []
        self._total = RequestStats()
        self._total_requests = 0
        self._peaks = [[0, 0, 0] for _ in range(num_pool_groups)]

    def retire(self, pending: RequestStats) -> None:
        """Keep a closed request's pending deltas for the next merge."""
        if self.enabled and not pending.is_zero():
            self._closed_pending.append(pending)

    def merge(self, pending: list[RequestStats]) -> IterationStats:
        """Sum the open requests' deltas ``pending`` (reset afterwards) and the retired ones."""
        if not self.enabled:
            return IterationStats()
        merged = RequestStats()
        requests = 0
        for stats in [*pending, *self._closed_pending]:
            if stats.is_zero():
                continue
            merged.add(stats)
            requests += 1
        for stats in pending:
            for f in fields(RequestStats):
                setattr(stats, f.name, 0)
        self._closed_pending.clear()
        self._total.add(merged)
        self._total_requests += requests
        return IterationStats(requests, merged.allocated_blocks, merged.new_blocks, merged.reused_full_blocks,
                              merged.reused_partial_blocks, merged.missed_blocks)

    @property
    def total(self) -> IterationStats:
        """Everything merged so far."""
        t = self._total
        return IterationStats(self._total_requests, t.allocated_blocks, t.new_blocks, t.reused_full_blocks,
                              t.reused_partial_blocks, t.missed_blocks)

    def sample(self, accounting: SlotAccounting) -> None:
        """Fold one pool group's current accounting into its peaks."""
        if not self.enabled:
            return
        peak = self._peaks[accounting.pool_group]
        peak[0] = max(peak[0], accounting.available)
        peak[1] = max(peak[1], accounting.evictable)
        peak[2] = max(peak[2], accounting.used)

    def read_peaks(self, current: list[SlotAccounting]) -> tuple[PoolGroupPeaks, ...]:
        """The peaks since the last read; they restart from the ``current`` accounting."""
        out = tuple(PoolGroupPeaks(pg, *self._peaks[pg]) for pg in range(self._num_pool_groups))
        self._peaks = [[0, 0, 0] for _ in range(self._num_pool_groups)]
        for acc in current:
            self.sample(acc)
        return out
