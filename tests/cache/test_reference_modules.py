"""The reference design's private module names (``_block_radix_tree``, ``_copy_engine``, ``_storage._core``,
``_storage_manager``, ``_life_cycle_registry``) over kvxfer's own parts."""

from __future__ import annotations

import hashlib

import pytest

from kvxfer.cache import (
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    ReuseScope,
    sequence_to_blockchain_keys,
)
from kvxfer.cache._block_radix_tree import Block, BlockRadixTree, Hasher
from kvxfer.cache._copy_engine import CopyTask, batched_copy
from kvxfer.cache._life_cycle_registry import LifeCycleRegistry
from kvxfer.cache._storage._core import SlotAllocator
from kvxfer.cache._storage_manager import StorageManager
from kvxfer.cache._utils import CachedCudaEvent
from kvxfer.cache.common import CacheLevel, CacheTier, CudaStream, MemAddress, PoolGroupIndex, SlotId
from kvxfer.cache.hashing import TokenIdExt
from kvxfer.errors import BlockIdError, ConfigError, OutOfSlotsError

DIGEST = hashlib.sha256(b"item").digest()


def manager(window: int | None = None) -> KVCacheManager:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(0), [BufferConfig(DataRole("key"), 256)]),
        AttentionLayerConfig(LayerId(1), [BufferConfig(DataRole("key"), 256)], sliding_window_size=window)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=4, cache_tiers=[GpuCacheTierConfig(64 << 10)],
                                               layers=layers))


def test_hasher_chains_like_the_reference_keys() -> None:
    tokens: list[TokenIdExt] = [1, 2, DIGEST, 3]
    (_, root), (_, key) = list(sequence_to_blockchain_keys(4, ReuseScope(), tokens))
    assert Hasher(root).update(tokens).digest == key
    assert Hasher(root).update(tokens[:2]).update(tokens[2:]).digest == key
    assert Hasher(b"x").digest == hashlib.sha256(b"x").digest()


def test_slot_allocator_issues_recycles_and_shrinks() -> None:
    alloc = SlotAllocator(6)
    slots = alloc.allocate_multiple(4)
    assert slots == [0, 1, 2, 3] and alloc.num_occupied_slots == 4 and alloc.num_free_slots == 2
    alloc.release(slots[1])
    assert alloc.allocate() == 1 and alloc.num_active_slots == 4
    with pytest.raises(BlockIdError, match="which is free"):
        alloc.release(SlotId(5))
    alloc.prepare_for_shrink(3)
    assert alloc.shrink_in_progress and alloc.num_slots == 6
    assert not alloc.finish_shrink()          # slot 3 is still held
    alloc.release(SlotId(3))
    assert alloc.finish_shrink() and not alloc.shrink_in_progress
    assert (alloc.num_slots, alloc.num_active_slots, alloc.num_free_slots) == (3, 3, 0)
    with pytest.raises(OutOfSlotsError):
        alloc.allocate()
    with pytest.raises(ConfigError, match="new capacity"):
        alloc.prepare_for_shrink(4)


def test_block_radix_tree_matches_per_scope() -> None:
    tree = BlockRadixTree(LifeCycleRegistry([]), tokens_per_block=2)
    scope = ReuseScope(lora_id=1)
    first = Block([5, DIGEST], tree.add_or_get_existing(scope))
    second = Block([7, 8], first)
    assert tree.add_or_get_existing(scope) is first.prev
    keys = [k for c, k in sequence_to_blockchain_keys(2, scope, [5, DIGEST, 7, 8]) if c]
    assert [first.key, second.key] == keys and second.ordinal == 1
    full = tree.match(scope, [5, DIGEST, 7, 8])
    assert full.blocks == [first, second] and full.num_tokens == 4
    partial = tree.match(scope, [5, DIGEST, 7, 9], enable_partial_match=True)
    assert partial.blocks == [first, second] and partial.num_tokens == 3
    assert tree.match(ReuseScope(lora_id=2), [5, DIGEST]).num_tokens == 0
    with pytest.raises(ConfigError, match="holds 2 tokens"):
        Block([1], first)


def test_life_cycle_registry_and_storage_manager_read_a_manager() -> None:
    mgr = manager(window=8)
    registry = LifeCycleRegistry.of(mgr)
    cycles = list(registry.attention_life_cycles())
    assert registry.size == len(cycles) == len(mgr.layer_grouping) and registry.ssm_life_cycle_id is None
    assert sorted(lc.window_size or 0 for _, lc in cycles) == [0, 8]
    storage = StorageManager(mgr)
    pg = PoolGroupIndex(0)
    free = storage.get_num_free_slots(pg)
    assert storage.num_cache_levels == mgr.num_tiers and free == mgr.num_free_slots(0) > 0
    slots = storage.new_slots_for_pool_group(pg, 2)
    assert storage.get_num_free_slots(pg) == free - 2 and storage.num_slots(pg) >= free
    storage.cache_level(CacheLevel(0)).pool_group(pg).release(slots)
    assert storage.get_num_free_slots(pg) == free


def test_copy_engine_names_and_null_event() -> None:
    assert CopyTask(MemAddress(1), MemAddress(2)) == (1, 2)
    with pytest.raises(ConfigError, match="dst_tier must be GPU_MEM or HOST_MEM"):
        batched_copy(CacheTier.DISK, CacheTier.GPU_MEM, 16, [], CudaStream(0))
    with pytest.raises(ConfigError, match="num_bytes"):
        batched_copy(CacheTier.HOST_MEM, CacheTier.HOST_MEM, 0, [], CudaStream(0))
    null = CachedCudaEvent.NULL
    assert null.is_closed() and null.query_complete()
    null.synchronize()
    null.wait_in_stream(CudaStream(0))
