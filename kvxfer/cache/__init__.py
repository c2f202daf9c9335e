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
from kvxfer.cache.hashing import (
    DEFAULT_HASH_ALGO,
    HASH_ALGOS,
    HASH_V2_BLAKE3,
    HASH_V2_BLAKE3_64,
    ReuseScope,
    block_hash_for_event,
    block_keys,
    cache_salt_id,
)
from kvxfer.cache.kv_access import LayerKV, read_kv, write_kv
from kvxfer.cache.kv_cache import CacheState, KVCache, ScratchDesc
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.memory import MemoryRegion
from kvxfer.cache.stats import (
    KVCacheIterationStatsDelta,
    KVCacheStatsDelta,
    PoolGroupPeakBlockStats,
    SlotAccounting,
    TierTraffic,
)
from kvxfer.cache.tiers import TierStats

__all__ = [
    "DEFAULT_HASH_ALGO",
    "HASH_ALGOS",
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
    "KVCache",
    "KVCacheIterationStatsDelta",
    "KVCacheManager",
    "KVCacheStatsDelta",
    "KVEvent",
    "KVEventPublisher",
    "LayerGroupDesc",
    "LayerKV",
    "LayerSpec",
    "MemoryRegion",
    "PoolDesc",
    "PoolGroupDesc",
    "PoolGroupPeakBlockStats",
    "PrimaryTier",
    "Removed",
    "ReuseScope",
    "RoleSpec",
    "ScratchDesc",
    "SlotAccounting",
    "SlotDesc",
    "SlotDescVariant",
    "Stored",
    "TierStats",
    "TierTraffic",
    "Updated",
    "WireContext",
    "block_hash_for_event",
    "block_keys",
    "cache_salt_id",
    "read_kv",
    "write_kv",
]

# --- TensorRT-LLM v2 event manager and key helpers (kvxfer.cache.event_manager, kvxfer.cache.hashing) ---
from kvxfer.cache.event_manager import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheEventManager,
    KVCacheEventSerializer,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
)
from kvxfer.cache.hashing import (
    MmItemContext,
    gen_multimodal_cache_key_tokens,
    sequence_to_blockchain_keys,
)

__all__ += [
    "KVCacheCreatedData",
    "KVCacheEvent",
    "KVCacheEventDiff",
    "KVCacheEventManager",
    "KVCacheEventSerializer",
    "KVCacheRemovedData",
    "KVCacheStoredBlockData",
    "KVCacheStoredData",
    "KVCacheUpdatedData",
    "MmItemContext",
    "UniqueToken",
    "gen_multimodal_cache_key_tokens",
    "sequence_to_blockchain_keys",
]
