"""Paged KV-cache manager over real memory, and the layout descriptors it publishes."""

from kvxfer.cache.config import CacheConfig, DiskTier, HostTier, LayerSpec, PrimaryTier, RoleSpec
from kvxfer.cache.descriptors import (
    LAYOUT_VERSION,
    BufferFormat,
    BufferId,
    CacheLayoutDesc,
    CoalescedBuffer,
    ExpandedBuffer,
    LayerGroupDesc,
    PoolDesc,
    PoolGroupDesc,
    SlotDesc,
)
from kvxfer.cache.kv_cache import CacheState, KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.memory import MemoryRegion

__all__ = [
    "LAYOUT_VERSION",
    "BufferFormat",
    "BufferId",
    "CacheConfig",
    "CacheLayoutDesc",
    "CacheState",
    "CoalescedBuffer",
    "DiskTier",
    "ExpandedBuffer",
    "HostTier",
    "KVCache",
    "KVCacheManager",
    "LayerGroupDesc",
    "LayerSpec",
    "MemoryRegion",
    "PoolDesc",
    "PoolGroupDesc",
    "PrimaryTier",
    "RoleSpec",
    "SlotDesc",
]
