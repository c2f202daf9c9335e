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
from kvxfer.cache.events import AllCleared, KVEvent, KVEventPublisher, Removed, Stored, Updated
from kvxfer.cache.hashing import HASH_V2_BLAKE3, HASH_V2_BLAKE3_64, ReuseScope, block_keys
from kvxfer.cache.kv_access import LayerKV, read_kv, write_kv
from kvxfer.cache.kv_cache import CacheState, KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.memory import MemoryRegion
from kvxfer.cache.stats import IterationStats, PoolGroupPeaks, RequestStats, SlotAccounting, TierTraffic
from kvxfer.cache.tiers import TierStats

__all__ = [
    "HASH_V2_BLAKE3",
    "HASH_V2_BLAKE3_64",
    "LAYOUT_VERSION",
    "AllCleared",
    "BufferFormat",
    "BufferId",
    "CacheConfig",
    "CacheLayoutDesc",
    "CacheState",
    "CoalescedBuffer",
    "DiskTier",
    "ExpandedBuffer",
    "HostTier",
    "IterationStats",
    "KVCache",
    "KVCacheManager",
    "KVEvent",
    "KVEventPublisher",
    "LayerGroupDesc",
    "LayerKV",
    "LayerSpec",
    "MemoryRegion",
    "PoolDesc",
    "PoolGroupDesc",
    "PoolGroupPeaks",
    "PrimaryTier",
    "Removed",
    "RequestStats",
    "ReuseScope",
    "RoleSpec",
    "SlotAccounting",
    "SlotDesc",
    "Stored",
    "TierStats",
    "TierTraffic",
    "Updated",
    "block_keys",
    "read_kv",
    "write_kv",
]
