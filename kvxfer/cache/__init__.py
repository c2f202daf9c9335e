"""Paged KV-cache manager over real memory, and the layout descriptors it publishes."""

from kvxfer.cache.config import CacheConfig, DiskTier, HostTier, LayerSpec, PrimaryTier, RoleSpec
from kvxfer.cache.descriptors import (
    LAYOUT_VERSION,
    AggregatedPageDesc,
    BufferFormat,
    BufferId,
    BufferSpan,
    CacheLayoutDesc,
    CoalescedBuffer,
    ExpandedBuffer,
    LayerGroupDesc,
    PoolDesc,
    PoolGroupDesc,
    SlotDesc,
    SlotDescVariant,
)
from kvxfer.cache.event_publisher import KVEventPublisher
from kvxfer.cache.event_wire import WireContext
from kvxfer.cache.events import AllCleared, Created, EventsDropped, KVEvent, Removed, Stored, Updated
from kvxfer.cache.hashing import HASH_V2_BLAKE3, HASH_V2_BLAKE3_64, ReuseScope, block_keys
from kvxfer.cache.kv_cache import CacheState, KVCache
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.memory import MemoryRegion
from kvxfer.cache.stats import IterationStats, PoolGroupPeaks, RequestStats, SlotAccounting, TierTraffic
from kvxfer.cache.tiers import TierStats

__all__ = [
    "HASH_V2_BLAKE3",
    "HASH_V2_BLAKE3_64",
    "LAYOUT_VERSION",
    "AggregatedPageDesc",
    "AllCleared",
    "BufferFormat",
    "BufferId",
    "BufferSpan",
    "CacheConfig",
    "CacheLayoutDesc",
    "CacheState",
    "CoalescedBuffer",
    "Created",
    "DiskTier",
    "EventsDropped",
    "ExpandedBuffer",
    "HostTier",
    "IterationStats",
    "KVCache",
    "KVCacheManager",
    "KVEvent",
    "KVEventPublisher",
    "LayerGroupDesc",
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
    "SlotDescVariant",
    "Stored",
    "TierStats",
    "TierTraffic",
    "Updated",
    "WireContext",
    "block_keys",
]
