"""The reference design's manager configuration (TensorRT-LLM KVCacheManagerV2): layers as raw
per-block buffers, cache tiers as byte quotas, batch shapes the pools must fit.

``KVCacheManager`` takes a ``KVCacheManagerConfig``; kvxfer's ``CacheConfig`` (heads, head size,
dtype, tensor-parallel split) builds one with ``CacheConfig.to_manager_config()``
(``kvxfer.cache.config`` holds both translations).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvxfer.cache.common import CacheTier, DataRole, LayerId
from kvxfer.errors import ConfigContractError, ConfigError

#: ``max_util_for_resume`` when not given: a resume may fill the primary tier.
DEFAULT_MAX_UTIL_FOR_RESUME = 1.0
#: Keys of ``CacheConfig.extra`` that carry reference-only settings through the bridge.
EXTRA_REUSE_MATCH_BACKOFF = "reuse_match_backoff"
EXTRA_COMMIT_MIN_SNAPSHOT = "commit_min_snapshot"
EXTRA_TEXT_ONLY = "text_only"
#: ``CacheConfig.extra`` flag: a closing request enters its partial last block into the prefix tree
#: (set for ``KVCacheManagerConfig`` managers, as the reference does; off for ``CacheConfig`` ones).
EXTRA_STORE_TAIL_BLOCKS = "store_tail_blocks"
#: ``CacheConfig.extra`` flag: every layer group gets at least the slots one request needs at worst
#: (a sliding window: its sink blocks, the window and one more; full attention: the largest of those),
#: the primary quota raised where it holds fewer (``KVCacheManagerConfig`` managers, as the reference).
EXTRA_SLOT_FLOORS = "slot_floors"
#: ``CacheConfig.extra`` flag: the primary slots are split between pool groups by a target ratio
#: (``kvxfer.cache.pool_ratio``; ``KVCacheManagerConfig`` managers) instead of equally per layer group.
EXTRA_POOL_RATIO = "pool_ratio"

#: Auto-tuner defaults (``KVCacheManagerConfig.rebalance_*``; ``kvxfer.cache.pool_tuner``).
DEFAULT_REBALANCE_MIN_SAMPLED_KV_CACHES = 2000
DEFAULT_REBALANCE_COOLDOWN_SECS = 120.0
DEFAULT_REBALANCE_TARGET_RATIO_UPDATE_INTERVAL = 100
DEFAULT_REBALANCE_RATIO_THRESHOLD = 1.25
DEFAULT_REBALANCE_MOVING_AVERAGE_DECAY = 0.9999


@runtime_checkable
class CacheTierConfig(Protocol):
    """A cache level: its byte quota and medium."""

    quota: int

    @property
    def tier(self) -> CacheTier:
        """The medium of the level."""
        ...

    def assert_valid(self) -> None:
        """ConfigError unless the level's settings are valid."""
        ...


def _check_quota(quota: object, where: str) -> None:
    if isinstance(quota, bool) or not isinstance(quota, int) or quota <= 0:
        raise ConfigError(f"{where}.quota must be an int > 0, got {quota!r}")


@dataclass(slots=True)
class GpuCacheTierConfig:
    """The primary level in device memory (host memory where the machine has no CUDA device)."""

    quota: int

    @property
    def tier(self) -> CacheTier:
        """``CacheTier.GPU_MEM``."""
        return CacheTier.GPU_MEM

    def assert_valid(self) -> None:
        """ConfigError unless the quota is a positive int."""
        _check_quota(self.quota, "GpuCacheTierConfig")


@dataclass(slots=True)
class HostCacheTierConfig:
    """A level in host memory (pinned where CUDA exists)."""

    quota: int

    @property
    def tier(self) -> CacheTier:
        """``CacheTier.HOST_MEM``."""
        return CacheTier.HOST_MEM

    def assert_valid(self) -> None:
        """ConfigError unless the quota is a positive int."""
        _check_quota(self.quota, "HostCacheTierConfig")


@dataclass(slots=True)
class DiskCacheTierConfig:
    """A level of preallocated files under ``path``."""

    quota: int
    path: str

    @property
    def tier(self) -> CacheTier:
        """``CacheTier.DISK``."""
        return CacheTier.DISK

    def assert_valid(self) -> None:
        """ConfigError unless the quota is a positive int and the path a non-empty string."""
        _check_quota(self.quota, "DiskCacheTierConfig")
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"DiskCacheTierConfig.path must be a non-empty string, got {self.path!r}")


@dataclass(slots=True)
class BufferConfig:
    """One buffer of a layer: ``size`` bytes per block of ``tokens_per_block_override`` tokens
    (default: the manager's ``tokens_per_block``)."""

    role: DataRole
    size: int
    tokens_per_block_override: int | None = None


@dataclass(slots=True)
class AttentionLayerConfig:
    """An attention layer: its buffers, sliding window (None: full attention) and sink tokens."""

    layer_id: LayerId
    buffers: list[BufferConfig]
    sliding_window_size: int | None = None
    num_sink_tokens: int | None = None

    @property
    def window_size(self) -> int | None:
        """The sliding window in tokens (None: full attention)."""
        return self.sliding_window_size


@dataclass(slots=True)
class SsmLayerConfig:
    """A state-space (recurrent, Mamba-style) layer: each buffer is ``size`` bytes of state per request
    (one slot, whatever the request's length) instead of pages per block. Prefix reuse restores the
    state from snapshots the manager takes at commits (``KVCacheManagerConfig.commit_min_snapshot``
    must be on)."""

    layer_id: LayerId
    buffers: list[BufferConfig]

    def __post_init__(self) -> None:
        roles = [b.role for b in self.buffers]
        if len(set(roles)) != len(roles):
            raise ConfigContractError(f"SsmLayerConfig({self.layer_id}).buffers: duplicate buffer role in {roles}")
        for buf in self.buffers:
            if buf.tokens_per_block_override is not None:
                raise ConfigContractError(f"SsmLayerConfig({self.layer_id}).buffers[{buf.role!r}]: "
                                          f"tokens_per_block_override must be None (a state is not paged by tokens)")


LayerConfig = AttentionLayerConfig | SsmLayerConfig


@dataclass(slots=True)
class KVCacheDesc:
    """One request of a batch shape: its capacity and written history, in tokens."""

    capacity: int
    history_length: int


@dataclass(slots=True)
class BatchDesc:
    """A batch shape the pools should be able to run (``system_prompt_length`` tokens shared)."""

    kv_caches: list[KVCacheDesc]
    system_prompt_length: int = 0


@dataclass(slots=True)
class SwaScratchReuseConfig:
    """Sliding-window scratch slots: blocks out of the window at the new capacity get scratch slots
    instead of pages (``max_rewind_len`` tokens may be rolled back)."""

    max_rewind_len: int = 0


@dataclass(slots=True)
class KVCacheManagerConfig:
    """Everything ``KVCacheManager`` needs, in the reference design's terms."""

    tokens_per_block: int
    cache_tiers: list[CacheTierConfig]
    layers: list[LayerConfig]
    max_util_for_resume: float = DEFAULT_MAX_UTIL_FOR_RESUME
    enable_partial_reuse: bool = True
    #: Tokens trimmed off the tail of every prefix match.
    reuse_match_backoff: int = 0
    constraints: list[BatchDesc] = field(default_factory=list)
    typical_step: BatchDesc | None = None
    initial_pool_ratio: list[float] | None = None
    swa_scratch_reuse: SwaScratchReuseConfig | None = None
    commit_min_snapshot: bool = False
    enable_stats: bool = True
    text_only: bool = False
    #: Closed kv caches the auto-tuner must have sampled before it asks for a pool re-split.
    rebalance_min_sampled_kv_caches: int = DEFAULT_REBALANCE_MIN_SAMPLED_KV_CACHES
    #: Seconds between two re-splits.
    rebalance_cooldown_secs: float = DEFAULT_REBALANCE_COOLDOWN_SECS
    #: Newly sampled kv caches between two recomputations of the target ratio.
    rebalance_target_ratio_update_interval: int = DEFAULT_REBALANCE_TARGET_RATIO_UPDATE_INTERVAL
    #: How far (a factor, > 1) a pool group's share may drift from its target before a re-split.
    rebalance_ratio_threshold: float = DEFAULT_REBALANCE_RATIO_THRESHOLD
    #: Decay of the moving averages of request lengths the target ratio is computed from, in (0, 1).
    rebalance_moving_average_decay: float = DEFAULT_REBALANCE_MOVING_AVERAGE_DECAY

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether sliding-window groups use scratch slots."""
        return self.swa_scratch_reuse is not None

    def __post_init__(self) -> None:
        if any(isinstance(layer, SsmLayerConfig) for layer in self.layers) and not self.commit_min_snapshot:
            raise ConfigContractError("KVCacheManagerConfig: commit_min_snapshot must be True when SSM layers "
                                      "(SsmLayerConfig) are present: a recurrent state is only reusable where a "
                                      "commit ended")
        _check_rebalance(self)


def _check_rebalance(config: KVCacheManagerConfig) -> None:
    """ConfigContractError (a ConfigError and an AssertionError, as the reference asserts) naming the
    first invalid ``rebalance_*`` field and its value."""
    def bad(name: str, rule: str) -> ConfigContractError:
        return ConfigContractError(f"KVCacheManagerConfig.{name} must be {rule}, got {getattr(config, name)!r}")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_real(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    if not is_int(config.rebalance_min_sampled_kv_caches) or config.rebalance_min_sampled_kv_caches < 0:
        raise bad("rebalance_min_sampled_kv_caches", "an int >= 0")
    if not is_real(config.rebalance_cooldown_secs) or config.rebalance_cooldown_secs < 0:
        raise bad("rebalance_cooldown_secs", "a finite number >= 0")
    if not is_int(config.rebalance_target_ratio_update_interval) or config.rebalance_target_ratio_update_interval <= 0:
        raise bad("rebalance_target_ratio_update_interval", "an int > 0")
    if not is_real(config.rebalance_ratio_threshold) or not config.rebalance_ratio_threshold > 1.0:
        raise bad("rebalance_ratio_threshold", "a finite number > 1")
    if not is_real(config.rebalance_moving_average_decay) or not 0.0 < config.rebalance_moving_average_decay < 1.0:
        raise bad("rebalance_moving_average_decay", "a number in (0, 1)")


def copy_config(config: KVCacheManagerConfig) -> KVCacheManagerConfig:
    """A deep copy (the manager keeps its own, so callers may reuse and mutate theirs)."""
    return dataclasses.replace(
        config, cache_tiers=[dataclasses.replace(t) for t in config.cache_tiers],  # type: ignore[type-var]
        layers=[dataclasses.replace(layer, buffers=[dataclasses.replace(b) for b in layer.buffers])
                for layer in config.layers],
        constraints=[dataclasses.replace(b, kv_caches=[dataclasses.replace(k) for k in b.kv_caches])
                     for b in config.constraints])
