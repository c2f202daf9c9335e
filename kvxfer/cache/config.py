"""Cache configuration: layers, block size, dtype, storage tiers and tensor-parallel placement."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvxfer.cache.common import CacheTier, DataRole, LayerId
from kvxfer.cache.dtypes import dtype_name, itemsize
from kvxfer.cache.hashing import DEFAULT_HASH_ALGO, HASH_ALGOS, HASH_V2_SHA256_PACKED
from kvxfer.cache.manager_config import (
    EXTRA_COMMIT_MIN_SNAPSHOT,
    EXTRA_POOL_RATIO,
    EXTRA_REUSE_MATCH_BACKOFF,
    EXTRA_SLOT_FLOORS,
    EXTRA_STORE_TAIL_BLOCKS,
    EXTRA_TEXT_ONLY,
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManagerConfig,
    LayerConfig,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from kvxfer.errors import ConfigError

HeadOrder = Literal["HND", "NHD"]


def _positive_int(value: Any, name: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


@dataclass(frozen=True)
class RoleSpec:
    """A buffer role of a layer: "key", "value", or e.g. a quantisation-scale role of its own size.

    ``head_dim``/``dtype`` of None mean "the layer's head_dim" / "the cache's dtype".
    ``tokens_per_block``: the role's own page size when it is paged by fewer tokens than the cache
    (a divisor of the cache's; a block's slot then holds several of its pages). ``block_bytes``: an
    opaque role of that many bytes per page with no (head, token) structure (the reference design's
    buffers whose size is not a multiple of their tokens per block): pools and slots hold it, but the
    extractor, ``buffer_view`` and ``write_kv``/``read_kv`` refuse it.
    """

    name: str
    head_dim: int | None = None
    dtype: str | None = None
    tokens_per_block: int | None = None
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"RoleSpec.name must be a non-empty string, got {self.name!r}")
        if self.head_dim is not None:
            _positive_int(self.head_dim, f"RoleSpec({self.name}).head_dim")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype, f"RoleSpec({self.name}).dtype"))
        if self.tokens_per_block is not None:
            _positive_int(self.tokens_per_block, f"RoleSpec({self.name}).tokens_per_block")
        if self.block_bytes is not None:
            _positive_int(self.block_bytes, f"RoleSpec({self.name}).block_bytes")


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV shape; ``num_kv_heads`` is the model's total (before TP split).

    ``window`` is the sliding-window length in tokens (None = full attention); ``sink_tokens`` are
    leading tokens a sliding-window layer always keeps.
    """

    layer_id: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None
    sink_tokens: int = 0
    roles: tuple[str | RoleSpec, ...] = ("key", "value")
    #: A recurrent (SSM) layer: its roles are one request's state (a block's worth of bytes: heads x
    #: head_dim x tokens_per_block), held in one slot per request instead of pages per block.
    recurrent: bool = False

    def __post_init__(self) -> None:
        _positive_int(self.layer_id, "LayerSpec.layer_id", allow_zero=True)
        if not isinstance(self.recurrent, bool):
            raise ConfigError(f"LayerSpec({self.layer_id}).recurrent must be a bool, got {self.recurrent!r}")
        if self.recurrent and self.window is not None:
            raise ConfigError(f"LayerSpec({self.layer_id}): a recurrent layer has no window, got {self.window}")
        _positive_int(self.num_kv_heads, f"LayerSpec({self.layer_id}).num_kv_heads")
        _positive_int(self.head_dim, f"LayerSpec({self.layer_id}).head_dim")
        if self.window is not None:
            _positive_int(self.window, f"LayerSpec({self.layer_id}).window")
        _positive_int(self.sink_tokens, f"LayerSpec({self.layer_id}).sink_tokens", allow_zero=True)
        if self.sink_tokens and self.window is None:
            raise ConfigError(f"LayerSpec({self.layer_id}).sink_tokens={self.sink_tokens} needs a window")
        roles = tuple(r if isinstance(r, RoleSpec) else RoleSpec(r) for r in self.roles)
        if not roles:
            raise ConfigError(f"LayerSpec({self.layer_id}).roles must not be empty")
        names = [r.name for r in roles]
        if len(set(names)) != len(names):
            raise ConfigError(f"LayerSpec({self.layer_id}).roles has duplicates: {names}")
        object.__setattr__(self, "roles", roles)

    @property
    def role_specs(self) -> tuple[RoleSpec, ...]:
        """The roles as RoleSpec objects (strings are normalised at construction)."""
        return tuple(r for r in self.roles if isinstance(r, RoleSpec))


@dataclass(frozen=True)
class PrimaryTier:
    """The tier models read and write: a CUDA device ("cuda:N") or "cpu" where there is no GPU."""

    quota_bytes: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        _positive_int(self.quota_bytes, "PrimaryTier.quota_bytes")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"PrimaryTier.device: invalid device {self.device!r}") from exc
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"PrimaryTier.device must be 'cpu' or 'cuda:N', got {self.device!r}")
        if dev.type == "cuda" and dev.index is None:
            object.__setattr__(self, "device", "cuda:0")


@dataclass(frozen=True)
class HostTier:
    """Host memory below the primary tier; pinned where CUDA exists (``pinned=None``: automatic)."""

    quota_bytes: int
    pinned: bool | None = None

    def __post_init__(self) -> None:
        _positive_int(self.quota_bytes, "HostTier.quota_bytes")


@dataclass(frozen=True)
class DiskTier:
    """The coldest tier: one preallocated file per pool under ``path``."""

    quota_bytes: int
    path: str

    def __post_init__(self) -> None:
        _positive_int(self.quota_bytes, "DiskTier.quota_bytes")
        if not isinstance(self.path, str | os.PathLike) or not str(self.path):
            raise ConfigError(f"DiskTier.path must be a directory path, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))


Tier = PrimaryTier | HostTier | DiskTier


@dataclass(frozen=True)
class CacheConfig:
    """Everything the cache manager needs to lay out and manage paged KV memory."""

    layers: tuple[LayerSpec, ...]
    tokens_per_block: int
    dtype: str
    tiers: tuple[Tier, ...]
    head_order: HeadOrder = "HND"
    tp_rank: int = 0
    tp_size: int = 1
    coalesce: bool = True
    enable_prefix_reuse: bool = True
    enable_partial_reuse: bool = True
    enable_stats: bool = True
    event_queue_capacity: int = 4096
    resume_max_utilization: float = 1.0
    hash_algo: str = DEFAULT_HASH_ALGO
    swa_scratch_reuse: bool = False
    extra: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise ConfigError("CacheConfig.layers must not be empty")
        for layer in layers:
            if not isinstance(layer, LayerSpec):
                raise ConfigError(f"CacheConfig.layers must hold LayerSpec, got {layer!r}")
        ids = [layer.layer_id for layer in layers]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"CacheConfig.layers has duplicate layer ids: {sorted(ids)}")
        object.__setattr__(self, "layers", tuple(sorted(layers, key=lambda s: s.layer_id)))
        _positive_int(self.tokens_per_block, "CacheConfig.tokens_per_block")
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "CacheConfig.dtype"))
        if self.head_order not in ("HND", "NHD"):
            raise ConfigError(f"CacheConfig.head_order must be 'HND' or 'NHD', got {self.head_order!r}")
        _positive_int(self.tp_size, "CacheConfig.tp_size")
        _positive_int(self.tp_rank, "CacheConfig.tp_rank", allow_zero=True)
        if self.tp_rank >= self.tp_size:
            raise ConfigError(f"CacheConfig.tp_rank={self.tp_rank} must be < tp_size={self.tp_size}")
        for layer in layers:
            h = layer.num_kv_heads
            if h % self.tp_size and self.tp_size % h:
                raise ConfigError(
                    f"LayerSpec({layer.layer_id}).num_kv_heads={h} neither divides nor is divisible by "
                    f"tp_size={self.tp_size}")
        tiers = tuple(self.tiers)
        if not tiers or not isinstance(tiers[0], PrimaryTier):
            raise ConfigError(f"CacheConfig.tiers must start with a PrimaryTier, got {tiers!r}")
        order = {PrimaryTier: 0, HostTier: 1, DiskTier: 2}
        kinds = [order.get(type(t), -1) for t in tiers]
        if -1 in kinds or kinds != sorted(set(kinds)):
            raise ConfigError(
                f"CacheConfig.tiers must be Primary[, Host][, Disk] in that order, each once, got "
                f"{[type(t).__name__ for t in tiers]}")
        object.__setattr__(self, "tiers", tiers)
        _positive_int(self.event_queue_capacity, "CacheConfig.event_queue_capacity")
        if not 0.0 < float(self.resume_max_utilization) <= 1.0:
            raise ConfigError(
                f"CacheConfig.resume_max_utilization must be in (0, 1], got {self.resume_max_utilization}")
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(f"CacheConfig.hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}")
        if not isinstance(self.swa_scratch_reuse, bool):
            raise ConfigError(f"CacheConfig.swa_scratch_reuse must be a bool, got {self.swa_scratch_reuse!r}")
        for layer in layers:
            for role in layer.role_specs:
                if role.tokens_per_block is not None and self.tokens_per_block % role.tokens_per_block:
                    raise ConfigError(f"LayerSpec({layer.layer_id}) role {role.name!r}: tokens_per_block "
                                      f"{role.tokens_per_block} does not divide the cache's {self.tokens_per_block}")
                if role.block_bytes is not None and (layer.num_kv_heads != 1 or self.tp_size != 1):
                    raise ConfigError(f"LayerSpec({layer.layer_id}) role {role.name!r}: an opaque role (block_bytes="
                                      f"{role.block_bytes}) has no heads to split: num_kv_heads must be 1 and "
                                      f"tp_size 1, got {layer.num_kv_heads} and {self.tp_size}")

    # --- derived --------------------------------------------------------------------------------
    @property
    def primary(self) -> PrimaryTier:
        """The primary tier's configuration."""
        tier = self.tiers[0]
        assert isinstance(tier, PrimaryTier)
        return tier

    def tier(self, kind: type[Tier]) -> Tier | None:
        """The configuration of the tier of that class, or None when the cache has no such tier."""
        for tier in self.tiers:
            if isinstance(tier, kind):
                return tier
        return None

    def local_heads(self, layer: LayerSpec) -> tuple[int, int]:
        """(head_start, num_heads) of ``layer`` held by this tensor-parallel rank."""
        total = layer.num_kv_heads
        if total >= self.tp_size:
            per = total // self.tp_size
            return self.tp_rank * per, per
        # Fewer KV heads than ranks: each head is replicated on tp_size // total ranks.
        return self.tp_rank * total // self.tp_size, 1

    def bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank over all layers and roles."""
        total = 0
        for layer in self.layers:
            _, heads = self.local_heads(layer)
            for role in layer.role_specs:
                total += heads * (role.head_dim or layer.head_dim) * itemsize(role.dtype or self.dtype)
        return total

    def to_manager_config(self) -> KVCacheManagerConfig:
        """The reference configuration of this cache: each role of each layer a buffer of its bytes per
        block on this rank, each tier a cache level (``KVCacheManager`` accepts either form)."""
        return manager_config_of(self)

    @classmethod
    def for_model(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        dtype: str | torch.dtype,
        num_blocks: int,
        device: str = "cpu",
        *,
        windows: Sequence[int | None] | None = None,
        sink_tokens: int = 0,
        roles: Sequence[str | RoleSpec] = ("key", "value"),
        host_blocks: int = 0,
        disk_blocks: int = 0,
        disk_path: str | None = None,
        hash_algo: str = DEFAULT_HASH_ALGO,
        **kw: Any,
    ) -> CacheConfig:
        """A uniform model's config sized so that every layer group gets ``num_blocks`` slots.

        ``windows`` gives each layer's sliding window (None = full attention), cycled over the layers;
        ``hash_algo`` picks the block-key algorithm (see ``kvxfer.cache.hashing``).
        """
        _positive_int(num_layers, "num_layers")
        _positive_int(num_blocks, "num_blocks")
        win = list(windows) if windows else [None]
        layers = tuple(
            LayerSpec(i, num_kv_heads, head_dim, window=win[i % len(win)],
                      sink_tokens=sink_tokens if win[i % len(win)] is not None else 0, roles=tuple(roles))
            for i in range(num_layers))
        kw["hash_algo"] = hash_algo
        probe = cls(layers=layers, tokens_per_block=tokens_per_block, dtype=dtype_name(dtype),
                    tiers=(PrimaryTier(1, device),), **kw)
        block_bytes = probe.bytes_per_token() * tokens_per_block
        tiers: list[Tier] = [PrimaryTier(block_bytes * num_blocks, device)]
        if host_blocks:
            tiers.append(HostTier(block_bytes * host_blocks))
        if disk_blocks:
            if disk_path is None:
                raise ConfigError("for_model: disk_blocks needs disk_path")
            tiers.append(DiskTier(block_bytes * disk_blocks, disk_path))
        return cls(layers=layers, tokens_per_block=tokens_per_block, dtype=probe.dtype, tiers=tuple(tiers), **kw)


# --- the bridge --------------------------------------------------------------------------------------
def manager_config_of(config: CacheConfig) -> KVCacheManagerConfig:
    """The reference configuration ``config`` describes: each role of each layer becomes a buffer of
    its bytes per block on this tensor-parallel rank, each tier a cache level of its quota."""
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
        buffers = []
        for role in layer.role_specs:
            own = role.tokens_per_block or config.tokens_per_block
            size = role.block_bytes or heads * (role.head_dim or layer.head_dim) * itemsize(role.dtype or config.dtype) * own
            buffers.append(BufferConfig(DataRole(role.name), size,
                                        own if own != config.tokens_per_block else None))
        if layer.recurrent:
            layers.append(SsmLayerConfig(LayerId(layer.layer_id), buffers))
        else:
            layers.append(AttentionLayerConfig(LayerId(layer.layer_id), buffers, layer.window,
                                               layer.sink_tokens if layer.window is not None else None))
    extra = dict(config.extra)
    recurrent = any(layer.recurrent for layer in config.layers)
    return KVCacheManagerConfig(
        tokens_per_block=config.tokens_per_block, cache_tiers=tiers, layers=layers,
        max_util_for_resume=float(config.resume_max_utilization),
        enable_partial_reuse=config.enable_partial_reuse,
        reuse_match_backoff=int(extra.get(EXTRA_REUSE_MATCH_BACKOFF, 0)),
        swa_scratch_reuse=SwaScratchReuseConfig() if config.swa_scratch_reuse else None,
        commit_min_snapshot=bool(extra.get(EXTRA_COMMIT_MIN_SNAPSHOT, False)) or recurrent,
        enable_stats=config.enable_stats, text_only=bool(extra.get(EXTRA_TEXT_ONLY, False)))


def _check_layers(layers: Sequence[object], tokens_per_block: int) -> list[AttentionLayerConfig | SsmLayerConfig]:
    out: list[AttentionLayerConfig | SsmLayerConfig] = []
    for layer in layers:
        if not isinstance(layer, AttentionLayerConfig | SsmLayerConfig):
            raise ConfigError(f"KVCacheManagerConfig.layers must hold AttentionLayerConfig or SsmLayerConfig, "
                              f"got {layer!r}")
        kind = type(layer).__name__
        if not layer.buffers:
            raise ConfigError(f"{kind}({layer.layer_id}).buffers must not be empty")
        for buf in layer.buffers:
            if not isinstance(buf, BufferConfig):
                raise ConfigError(f"{kind}({layer.layer_id}).buffers must hold BufferConfig, got {buf!r}")
            where = f"BufferConfig(layer {layer.layer_id}, {buf.role!r})"
            if isinstance(buf.size, bool) or not isinstance(buf.size, int) or buf.size <= 0:
                raise ConfigError(f"{where}.size must be a positive int (bytes per page), got {buf.size!r}")
            own = buf.tokens_per_block_override
            if own is not None and (isinstance(own, bool) or not isinstance(own, int) or own <= 0
                                    or tokens_per_block % own):
                raise ConfigError(f"{where}.tokens_per_block_override must be a positive divisor of the manager's "
                                  f"{tokens_per_block} tokens per block, got {own!r}")
        out.append(layer)
    return out


def cache_config_of(config: KVCacheManagerConfig) -> CacheConfig:
    """The byte-typed ``CacheConfig`` of a reference configuration: each buffer a uint8 role of its
    bytes per token, one head per layer, the first level the primary tier (CUDA device 0 where there
    is one, else host memory)."""
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
            own = own_tpb if own_tpb != tpb else None
            if buf.size % own_tpb:      # no per-token rows: an opaque page of buf.size bytes
                roles.append(RoleSpec(str(buf.role), dtype="uint8", tokens_per_block=own, block_bytes=buf.size))
            else:
                roles.append(RoleSpec(str(buf.role), head_dim=buf.size // own_tpb, dtype="uint8", tokens_per_block=own))
        if isinstance(layer, SsmLayerConfig):
            specs.append(LayerSpec(int(layer.layer_id), 1, roles[0].head_dim or 1, roles=tuple(roles),
                                   recurrent=True))
            continue
        window = layer.sliding_window_size
        specs.append(LayerSpec(int(layer.layer_id), 1, roles[0].head_dim or 1, window=window,
                               sink_tokens=(layer.num_sink_tokens or 0) if window is not None else 0,
                               roles=tuple(roles)))
    if not 0.0 < float(config.max_util_for_resume) <= 1.0:
        raise ConfigError(f"KVCacheManagerConfig.max_util_for_resume must be in (0, 1], got "
                          f"{config.max_util_for_resume}")
    if config.swa_scratch_reuse is not None:
        rewind = config.swa_scratch_reuse.max_rewind_len
        if isinstance(rewind, bool) or not isinstance(rewind, int) or rewind < 0:
            raise ConfigError(f"SwaScratchReuseConfig.max_rewind_len must be an int >= 0, got {rewind!r}")
    backoff = config.reuse_match_backoff
    if isinstance(backoff, bool) or not isinstance(backoff, int) or backoff < 0:
        raise ConfigError(f"KVCacheManagerConfig.reuse_match_backoff must be an int >= 0, got {backoff!r}")
    extra = ((EXTRA_REUSE_MATCH_BACKOFF, backoff), (EXTRA_COMMIT_MIN_SNAPSHOT, bool(config.commit_min_snapshot)),
             (EXTRA_TEXT_ONLY, bool(config.text_only)), (EXTRA_STORE_TAIL_BLOCKS, True),
             (EXTRA_SLOT_FLOORS, True), (EXTRA_POOL_RATIO, True))
    return CacheConfig(layers=tuple(specs), tokens_per_block=tpb, dtype="uint8", tiers=tuple(tiers),
                       hash_algo=HASH_V2_SHA256_PACKED,
                       enable_partial_reuse=bool(config.enable_partial_reuse), enable_stats=bool(config.enable_stats),
                       resume_max_utilization=float(config.max_util_for_resume),
                       swa_scratch_reuse=config.swa_scratch_reuse is not None, extra=extra)
