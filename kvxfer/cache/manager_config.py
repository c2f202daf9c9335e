"""The reference design's manager configuration (TensorRT-LLM KVCacheManagerV2): layers as raw
per-block buffers, cache tiers as byte quotas, batch shapes the pools must fit.

``KVCacheManager`` takes a ``KVCacheManagerConfig``; kvxfer's ``CacheConfig`` (heads, head size,
dtype, tensor-parallel split) builds one with ``CacheConfig.to_manager_config()``. The two
translations here are that bridge: ``manager_config_of`` (CacheConfig -> reference) and
``cache_config_of`` (reference -> the byte-typed CacheConfig the layout planner consumes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from kvxfer.cache.common import CacheTier, DataRole, LayerId
from kvxfer.cache.dtypes import itemsize
from kvxfer.errors import ConfigError

if TYPE_CHECKING:
    from kvxfer.cache.config import CacheConfig

#: ``max_util_for_resume`` when not given: a resume may fill the primary tier.
DEFAULT_MAX_UTIL_FOR_RESUME = 1.0
#: Keys of ``CacheConfig.extra`` that carry reference-only settings through the bridge.
EXTRA_REUSE_MATCH_BACKOFF = "reuse_match_backoff"
EXTRA_COMMIT_MIN_SNAPSHOT = "commit_min_snapshot"
EXTRA_TEXT_ONLY = "text_only"


@runtime_checkable
class CacheTierConfig(Protocol):
    """A cache level: its byte quota and medium."""

    quota: int

    @property
    def tier(self) -> CacheTier: ...

    def assert_valid(self) -> None: ...


def _check_quota(quota: object, where: str) -> None:
    if isinstance(quota, bool) or not isinstance(quota, int) or quota <= 0:
        raise ConfigError(f"{where}.quota must be an int > 0, got {quota!r}")


@dataclass(slots=True)
class GpuCacheTierConfig:
    """The primary level in device memory (host memory where the machine has no CUDA device)."""

    quota: int

    @property
    def tier(self) -> CacheTier:
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
    """A state-space (recurrent) layer: one state per request instead of pages per block."""

    layer_id: LayerId
    buffers: list[BufferConfig]


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

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether sliding-window groups use scratch slots."""
        return self.swa_scratch_reuse is not None


# --- the bridge --------------------------------------------------------------------------------------
def manager_config_of(config: CacheConfig) -> KVCacheManagerConfig:
    """The reference configuration ``config`` describes: each role of each layer becomes a buffer of
    its bytes per block on this tensor-parallel rank, each tier a cache level of its quota."""
    from kvxfer.cache.config import DiskTier, HostTier, PrimaryTier

    tiers: list[CacheTierConfig] = []
    for tier in config.tiers:
        if isinstance(tier, PrimaryTier):
            tiers.append(GpuCacheTierConfig(tier.quota_bytes))
        elif isinstance(tier, HostTier):
            tiers.append(HostCacheTierConfig(tier.quota_bytes))
        elif isinstance(tier, DiskTier):
            tiers.append(DiskCacheTierConfig(tier.quota_bytes, tier.path))
    layers: list[LayerConfig] = []
    for layer in config.layers:
        _, heads = config.local_heads(layer)
        buffers = [BufferConfig(DataRole(role.name),
                                heads * (role.head_dim or layer.head_dim) * itemsize(role.dtype or config.dtype)
                                * config.tokens_per_block)
                   for role in layer.role_specs]
        layers.append(AttentionLayerConfig(LayerId(layer.layer_id), buffers, layer.window,
                                           layer.sink_tokens if layer.window is not None else None))
    extra = dict(config.extra)
    return KVCacheManagerConfig(
        tokens_per_block=config.tokens_per_block, cache_tiers=tiers, layers=layers,
        max_util_for_resume=float(config.resume_max_utilization),
        enable_partial_reuse=config.enable_partial_reuse,
        reuse_match_backoff=int(extra.get(EXTRA_REUSE_MATCH_BACKOFF, 0)),
        swa_scratch_reuse=SwaScratchReuseConfig() if config.swa_scratch_reuse else None,
        commit_min_snapshot=bool(extra.get(EXTRA_COMMIT_MIN_SNAPSHOT, False)),
        enable_stats=config.enable_stats, text_only=bool(extra.get(EXTRA_TEXT_ONLY, False)))


def _check_layers(layers: Sequence[object], tokens_per_block: int) -> list[AttentionLayerConfig]:
    out: list[AttentionLayerConfig] = []
    for layer in layers:
        if isinstance(layer, SsmLayerConfig):
            raise ConfigError(f"KVCacheManagerConfig.layers: layer {layer.layer_id} is an SsmLayerConfig; "
                              f"kvxfer's manager keeps paged attention KV only (no recurrent state)")
        if not isinstance(layer, AttentionLayerConfig):
            raise ConfigError(f"KVCacheManagerConfig.layers must hold AttentionLayerConfig, got {layer!r}")
        if not layer.buffers:
            raise ConfigError(f"AttentionLayerConfig({layer.layer_id}).buffers must not be empty")
        for buf in layer.buffers:
            if not isinstance(buf, BufferConfig):
                raise ConfigError(f"AttentionLayerConfig({layer.layer_id}).buffers must hold BufferConfig, "
                                  f"got {buf!r}")
            tpb = buf.tokens_per_block_override or tokens_per_block
            if isinstance(buf.size, bool) or not isinstance(buf.size, int) or buf.size <= 0 or buf.size % tpb:
                raise ConfigError(f"BufferConfig(layer {layer.layer_id}, {buf.role!r}).size must be a positive "
                                  f"multiple of its {tpb} tokens per block, got {buf.size!r}")
        out.append(layer)
    return out


def cache_config_of(config: KVCacheManagerConfig) -> CacheConfig:
    """The byte-typed ``CacheConfig`` of a reference configuration: each buffer a uint8 role of its
    bytes per token, one head per layer, the first level the primary tier (CUDA device 0 where there
    is one, else host memory)."""
    from kvxfer.cache.config import CacheConfig, DiskTier, HostTier, LayerSpec, PrimaryTier, RoleSpec, Tier

    if not isinstance(config, KVCacheManagerConfig):
        raise ConfigError(f"KVCacheManager: config must be a KVCacheManagerConfig or CacheConfig, got {config!r}")
    tpb = config.tokens_per_block
    if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb <= 0:
        raise ConfigError(f"KVCacheManagerConfig.tokens_per_block must be an int > 0, got {tpb!r}")
    if not config.cache_tiers:
        raise ConfigError("KVCacheManagerConfig.cache_tiers must not be empty")
    tiers: list[Tier] = []
    for i, level in enumerate(config.cache_tiers):
        level.assert_valid()
        kind = level.tier
        if i == 0 and kind is not CacheTier.GPU_MEM:
            raise ConfigError(f"KVCacheManagerConfig.cache_tiers[0] must be a GpuCacheTierConfig, got {level!r}")
        if kind is CacheTier.GPU_MEM:
            if i:
                raise ConfigError(f"KVCacheManagerConfig.cache_tiers[{i}]: only the first level may be GPU memory")
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
            tiers.append(PrimaryTier(level.quota, device))
        elif kind is CacheTier.HOST_MEM:
            tiers.append(HostTier(level.quota))
        else:
            assert isinstance(level, DiskCacheTierConfig)
            tiers.append(DiskTier(level.quota, level.path))
    layers = _check_layers(config.layers, tpb)
    specs = []
    for layer in layers:
        roles = []
        for buf in layer.buffers:
            own_tpb = buf.tokens_per_block_override or tpb
            roles.append(RoleSpec(str(buf.role), head_dim=buf.size // own_tpb, dtype="uint8"))
            if own_tpb != tpb:
                raise ConfigError(f"BufferConfig(layer {layer.layer_id}, {buf.role!r}).tokens_per_block_override="
                                  f"{own_tpb}: kvxfer's pools page every buffer by the manager's {tpb} tokens")
        window = layer.sliding_window_size
        specs.append(LayerSpec(int(layer.layer_id), 1, roles[0].head_dim or 1, window=window,
                               sink_tokens=(layer.num_sink_tokens or 0) if window is not None else 0,
                               roles=tuple(roles)))
    if not 0.0 < float(config.max_util_for_resume) <= 1.0:
        raise ConfigError(f"KVCacheManagerConfig.max_util_for_resume must be in (0, 1], got "
                          f"{config.max_util_for_resume}")
    backoff = config.reuse_match_backoff
    if isinstance(backoff, bool) or not isinstance(backoff, int) or backoff < 0:
        raise ConfigError(f"KVCacheManagerConfig.reuse_match_backoff must be an int >= 0, got {backoff!r}")
    extra = ((EXTRA_REUSE_MATCH_BACKOFF, backoff), (EXTRA_COMMIT_MIN_SNAPSHOT, bool(config.commit_min_snapshot)),
             (EXTRA_TEXT_ONLY, bool(config.text_only)))
    return CacheConfig(layers=tuple(specs), tokens_per_block=tpb, dtype="uint8", tiers=tuple(tiers),
                       enable_partial_reuse=bool(config.enable_partial_reuse), enable_stats=bool(config.enable_stats),
                       resume_max_utilization=float(config.max_util_for_resume),
                       swa_scratch_reuse=config.swa_scratch_reuse is not None, extra=extra)


def copy_config(config: KVCacheManagerConfig) -> KVCacheManagerConfig:
    """A deep copy (the manager keeps its own, so callers may reuse and mutate theirs)."""
    return dataclasses.replace(
        config, cache_tiers=[dataclasses.replace(t) for t in config.cache_tiers],  # type: ignore[type-var]
        layers=[dataclasses.replace(layer, buffers=[dataclasses.replace(b) for b in layer.buffers])
                for layer in config.layers],
        constraints=[dataclasses.replace(b, kv_caches=[dataclasses.replace(k) for k in b.kv_caches])
                     for b in config.constraints])
