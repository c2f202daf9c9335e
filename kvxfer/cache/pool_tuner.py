"""The pool auto-tuner: watches the requests the manager serves and re-splits every cache level (the
primary and the colder host and disk tiers) between pool groups when a level's split drifts from what
those requests need.

Each closing kv cache (unless its statistics are excluded: warm-up and padding requests reserve the
model's whole context and would skew the averages) feeds moving averages of its squared capacity and
history length (squared: long requests also live long, and are sampled only once); each created kv cache
feeds the moving average of its reused prefix. Every ``rebalance_target_ratio_update_interval`` samples
the primary target becomes the bytes an average request needs per pool group, with the floors applied,
and the target of the colder levels the bytes an average reused prefix takes (what those tiers keep for
later requests). ``need_adjustment`` is true once enough requests were sampled, the cooldown has passed
and some pool group's share is off its target by more than ``rebalance_ratio_threshold``, on the
primary or on the colder levels (their shares averaged); ``adjust()`` then re-splits each level that is
off target, warmest first (all kv caches suspended).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager_config import (
    DEFAULT_REBALANCE_COOLDOWN_SECS,
    DEFAULT_REBALANCE_MIN_SAMPLED_KV_CACHES,
    DEFAULT_REBALANCE_MOVING_AVERAGE_DECAY,
    DEFAULT_REBALANCE_RATIO_THRESHOLD,
    DEFAULT_REBALANCE_TARGET_RATIO_UPDATE_INTERVAL,
)
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.pool_ratio import normalized
from kvxfer.errors import ConfigError


class MovingAverage:
    """An exponentially weighted average whose early values are not biased towards zero: the weight
    of the past decays by ``decay`` per update and the average is normalised by the total weight."""

    def __init__(self, decay: float) -> None:
        self.decay = float(decay)
        self.value = 0.0
        self.weight = 0.0
        self.num_updates = 0

    def update(self, value: float) -> float:
        """Fold ``value`` in; returns the new average."""
        self.weight = 1.0 + self.decay * self.weight
        self.value += (float(value) - self.value) / self.weight
        self.num_updates += 1
        return self.value


class PoolTuner:
    """The auto-tuner part of the manager: samples, the targets of every cache level, gates and re-splits."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts`` (the re-split goes through its tier-quota part)."""
        self.state = state
        self.parts = parts
        self.min_sampled = DEFAULT_REBALANCE_MIN_SAMPLED_KV_CACHES
        self.cooldown_secs = DEFAULT_REBALANCE_COOLDOWN_SECS
        self.update_interval = DEFAULT_REBALANCE_TARGET_RATIO_UPDATE_INTERVAL
        self.ratio_threshold = DEFAULT_REBALANCE_RATIO_THRESHOLD
        decay = DEFAULT_REBALANCE_MOVING_AVERAGE_DECAY
        self.avg_reused_length = MovingAverage(decay)
        self.avg_sqr_capacity = MovingAverage(decay)
        self.avg_sqr_history_length = MovingAverage(decay)
        self.target_gpu_ratio: list[float] = []
        #: Target of the colder levels (host, disk): one ratio for all of them, as their shares are averaged.
        self.target_other_ratio: list[float] = []
        self.num_sampled = 0
        self.last_update_num_sampled = 0
        self.last_adjustment_time = time.monotonic()

    def start(self) -> None:
        """Read the gates from the manager's configuration and take the current split as the target
        (called once the pools exist)."""
        cfg = self.state.init_config
        self.min_sampled = int(cfg.rebalance_min_sampled_kv_caches)
        self.cooldown_secs = float(cfg.rebalance_cooldown_secs)
        self.update_interval = int(cfg.rebalance_target_ratio_update_interval)
        self.ratio_threshold = float(cfg.rebalance_ratio_threshold)
        decay = float(cfg.rebalance_moving_average_decay)
        self.avg_reused_length = MovingAverage(decay)
        self.avg_sqr_capacity = MovingAverage(decay)
        self.avg_sqr_history_length = MovingAverage(decay)
        self.target_gpu_ratio = self.current_gpu_ratio()
        self.target_other_ratio = self.current_other_ratio()
        self.last_adjustment_time = time.monotonic()

    # --- observation ---------------------------------------------------------------------------------
    def level_ratio(self, tier: int) -> list[float]:
        """Each pool group's share of the bytes of cache level ``tier`` (usable slots times slot bytes)."""
        allocs = [self.state.alloc_of(tier, pg) for pg in range(len(self.state.allocators))]
        sizes = [a.usable * b for a, b in zip(allocs, self.state.page_bytes, strict=True)]
        total = sum(sizes)
        return [s / total if total else 0.0 for s in sizes]

    def current_gpu_ratio(self) -> list[float]:
        """Each primary pool group's share of the primary bytes in use."""
        return self.level_ratio(0)

    def current_other_ratio(self) -> list[float]:
        """Each pool group's share of the colder levels' bytes, averaged over those levels (the primary's
        shares when there is no colder level)."""
        levels = range(1, len(self.state.tiers))
        if not levels:
            return self.current_gpu_ratio()
        ratios = [self.level_ratio(t) for t in levels]
        return [sum(r[pg] for r in ratios) / len(ratios) for pg in range(len(self.state.allocators))]

    def on_create(self, cache: KVCache) -> None:
        """Sample a new kv cache's reused prefix (its history length at creation), whatever its fate."""
        self.avg_reused_length.update(float(cache.history_length))

    def on_close(self, cache: KVCache) -> None:
        """Sample a closing kv cache (not one whose statistics are excluded, nor one that never held a
        token) and recompute the target when enough new samples came in."""
        if cache.capacity <= 0 or self.parts.usage.is_stats_excluded(cache.id):
            return
        self.avg_sqr_capacity.update(float(cache.capacity) ** 2)
        self.avg_sqr_history_length.update(float(cache.history_length) ** 2)
        self.num_sampled += 1
        self.update_target()

    def update_target(self) -> None:
        """Recompute the targets from the averages (every ``update_interval`` samples): the primary's
        from the average request (floors applied), the colder levels' from the average reused prefix."""
        if self.num_sampled - self.last_update_num_sampled < self.update_interval:
            return
        self.last_update_num_sampled = self.num_sampled
        capacity = round(math.sqrt(self.avg_sqr_capacity.value))
        history = round(math.sqrt(self.avg_sqr_history_length.value))
        reused = round(self.avg_reused_length.value)
        planner = self.state.planner
        if capacity > 0:
            quota = self.state.current.primary.quota_bytes
            ratio = planner.ratio_from_length(history, capacity)
            self.target_gpu_ratio = planner.constrain(ratio, quota, planner.granularity(quota))
        if reused > 0:
            self.target_other_ratio = planner.ratio_from_length(reused, reused)

    # --- the gates -----------------------------------------------------------------------------------
    def target_of(self, tier: int) -> list[float]:
        """The target ratio of cache level ``tier``: the primary's, or the one all colder levels share."""
        return self.target_gpu_ratio if tier == 0 else self.target_other_ratio

    def level_off_target(self, tier: int) -> bool:
        """Whether some pool group's share of level ``tier`` (of the colder levels together, for a colder
        one) differs from its target by more than the threshold factor."""
        current = self.current_gpu_ratio() if tier == 0 else self.current_other_ratio()
        t = self.ratio_threshold
        for want, have in zip(self.target_of(tier), current, strict=True):
            if have <= 0 or want <= 0:
                if have != want:
                    return True
                continue
            if not 1.0 / t < want / have < t:
                return True
        return False

    def off_target(self) -> bool:
        """Whether the primary level or the colder levels are off their target."""
        return self.level_off_target(0) or self.level_off_target(len(self.state.tiers) - 1)

    def cooldown_elapsed(self) -> bool:
        """Whether ``cooldown_secs`` passed since the last re-split. A last-adjustment time at or
        before the clock's origin (0.0) means no re-split happened yet: ``time.monotonic()`` counts from
        an unspecified point (boot time on Linux), so on a machine up for less than the cooldown the
        plain difference would keep the gate closed however long ago the "adjustment" was."""
        if self.last_adjustment_time <= 0.0:
            return True
        return time.monotonic() - self.last_adjustment_time >= self.cooldown_secs

    @property
    def need_adjustment(self) -> bool:
        """Enough samples, past the cooldown, and off target."""
        with self.state.lock:
            if self.num_sampled < self.min_sampled:
                return False
            if not self.cooldown_elapsed():
                return False
            return self.off_target()

    def adjust(self) -> None:
        """Re-split each cache level that is off its target, warmest first (ManagerBusyError while a kv
        cache is active; a colder level is checked again after the one above it moved). Primary: pages
        above a shrinking pool group's new count are evicted or moved below it, a growing pool group's
        memory is reallocated (its base addresses change). A colder level keeps its quota and is rebuilt
        with the new counts: a shrinking pool group's surplus moves one tier down (or is dropped from the
        coldest tier), every live page is copied over. The cooldown restarts."""
        with self.state.lock:
            self.state.check_no_active("adjust")
            for tier in range(len(self.state.tiers)):
                if self.level_off_target(tier):
                    self.adjust_level(tier)
            self.last_adjustment_time = time.monotonic()

    def level_counts(self, tier: int) -> list[int]:
        """Slots per pool group that split level ``tier``'s quota by its target ratio, floors kept.
        The primary is cut into its grains; colder levels are byte-exact, as kvxfer plans them."""
        planner = self.state.planner
        quota = self.state.current.tiers[tier].quota_bytes
        grain = planner.granularity(quota) if tier == 0 else 1
        return planner.slot_counts(quota, self.target_of(tier), grain)

    def adjust_level(self, tier: int) -> None:
        """Re-split level ``tier`` by its target ratio."""
        if tier == 0:
            self.parts.quotas.resize_primary_slots(self.level_counts(0))
        else:
            self.parts.quotas.resplit_colder_tier(tier, self.level_counts(tier))

    # --- white-box hooks (``_introspection``) ---------------------------------------------------------
    def set_num_sampled(self, value: int) -> None:
        """Set the sampled-kv-cache counter the first gate reads."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"set_num_sampled_kv_caches: value must be an int >= 0, got {value!r}")
        with self.state.lock:
            self.num_sampled = value

    def set_last_adjustment_time(self, value: float) -> None:
        """Set the ``time.monotonic()`` of the last re-split the cooldown counts from."""
        with self.state.lock:
            self.last_adjustment_time = float(value)

    def set_target_ratio(self, ratios: Sequence[float], *, colder: bool = False) -> None:
        """Override the target ratio of the primary (or, ``colder``, of the colder levels): one positive
        share per pool group."""
        values = [float(r) for r in ratios]
        what = "set_target_ratio_list_other" if colder else "set_target_ratio_list_gpu"
        if len(values) != len(self.state.allocators) or any(not v > 0 for v in values):
            raise ConfigError(f"{what}: need {len(self.state.allocators)} positive shares, got {values}")
        with self.state.lock:
            if colder:
                self.target_other_ratio = normalized(values)
            else:
                self.target_gpu_ratio = normalized(values)
