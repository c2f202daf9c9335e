"""Shared helpers of the tier and copy-engine tests: a multi-pool config and byte-level views of tiers."""

from __future__ import annotations

import os

import numpy as np
import torch

from kvxfer.cache.config import CacheConfig, DiskTier, HostTier, LayerSpec, PrimaryTier, RoleSpec
from kvxfer.cache.layout import plan_layout
from kvxfer.cache.tiers import DiskTierStorage, MemoryTierStorage, TierStorage


def multi_pool_config(disk_path: str, *, primary_slots: int = 24, host_slots: int = 16, disk_slots: int = 20,
                      device: str = "cpu") -> CacheConfig:
    """Two pool groups (full-attention layers of head_dim 64, sliding-window layers of head_dim 32), each
    with a 4 KiB-aligned key/value pool and a small unaligned fp32 "scale" pool."""
    roles = ("key", "value", RoleSpec("scale", head_dim=3, dtype="float32"))
    layers = (LayerSpec(0, 2, 64, roles=roles), LayerSpec(1, 2, 64, roles=roles),
              LayerSpec(2, 2, 32, window=48, roles=roles), LayerSpec(3, 2, 32, window=48, roles=roles))
    probe = CacheConfig(layers=layers, tokens_per_block=16, dtype="bfloat16", tiers=(PrimaryTier(1, device),))
    per_slot = plan_layout(probe, 1 << 30)
    block = sum(p.slot_bytes * len(pg.layer_group_ids) for pg in per_slot.pool_groups for p in pg.pools)
    tiers = (PrimaryTier(block * primary_slots, device), HostTier(block * host_slots),
             DiskTier(block * disk_slots, disk_path))
    return CacheConfig(layers=layers, tokens_per_block=16, dtype="bfloat16", tiers=tiers)


def flat_pool_index(tier: TierStorage, pool_group: int, pool: int) -> int:
    """Index of a pool in (pool group, pool) order."""
    return sum(len(pg.pools) for pg in tier.layout.pool_groups[:pool_group]) + pool


def slot_bytes_of(tier: TierStorage, pool_group: int, pool: int, slots: np.ndarray) -> np.ndarray:
    """The bytes of ``slots`` of one pool as a [len(slots), slot_bytes] uint8 array (a copy)."""
    desc = tier.layout.pool_groups[pool_group].pools[pool]
    if isinstance(tier, MemoryTierStorage):
        rows = tier.pool_tensor(pool_group, pool).cpu().numpy().reshape(desc.num_slots, desc.slot_bytes)
        return np.asarray(rows[np.asarray(slots)]).copy()
    assert isinstance(tier, DiskTierStorage)
    path = tier.file_paths[flat_pool_index(tier, pool_group, pool)]
    with open(path, "rb") as f:
        out = np.empty((len(slots), desc.slot_bytes), dtype=np.uint8)
        for i, s in enumerate(np.asarray(slots).tolist()):
            out[i] = np.frombuffer(os.pread(f.fileno(), desc.slot_bytes, s * desc.slot_bytes), dtype=np.uint8)
        return out


def whole_pool(tier: TierStorage, pool_group: int, pool: int) -> np.ndarray:
    """Every byte of one pool, [num_slots, slot_bytes]."""
    n = tier.layout.pool_groups[pool_group].num_slots
    return slot_bytes_of(tier, pool_group, pool, np.arange(n))


def fill_random(tier: TierStorage, seed: int) -> None:
    """Fill every pool of a tier with seeded random bytes."""
    rng = np.random.default_rng(seed)
    for pg in tier.layout.pool_groups:
        for p in pg.pools:
            data = rng.integers(0, 256, p.nbytes, dtype=np.uint8)
            if isinstance(tier, MemoryTierStorage):
                tier.pool_tensor(pg.pool_group_index, p.pool_index).copy_(torch.from_numpy(data))
            else:
                assert isinstance(tier, DiskTierStorage)
                path = tier.file_paths[flat_pool_index(tier, pg.pool_group_index, p.pool_index)]
                with open(path, "r+b") as f:
                    os.pwrite(f.fileno(), data.tobytes(), 0)
