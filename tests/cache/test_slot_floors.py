"""Reference-API managers size each layer group for one request at worst (slot floors), and
``clamp_max_seq_len_for_mem`` counts what a sliding window still needs at a length."""

from __future__ import annotations

from kvxfer.cache import (
    GPU_LEVEL,
    AttentionLayerConfig,
    BufferConfig,
    CacheConfig,
    CacheLevel,
    DataRole,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    LayerSpec,
    PrimaryTier,
)

TPB = 32
SLOT = 4096


def manager(windows: list[int | None], slots: int, sink: int = 0) -> KVCacheManager:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(i), [BufferConfig(DataRole("key"), SLOT)], w, sink if w is not None else None)
        for i, w in enumerate(windows)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(slots * SLOT)],
                                               layers=layers))


def slots_of(mgr: KVCacheManager) -> list[int]:
    return [pg.num_slots for pg in mgr.layout.pool_groups]


def test_a_window_gets_its_blocks_and_one_more_even_past_the_quota() -> None:
    mgr = manager([TPB], slots=1)
    assert slots_of(mgr) == [2]                       # 31 tokens of window: 1 block, and the one written
    assert mgr.get_quota(CacheLevel(GPU_LEVEL)) >= 2 * SLOT
    assert slots_of(manager([2 * TPB], slots=1)) == [3]
    assert slots_of(manager([2 * TPB], slots=1, sink=TPB)) == [4]   # and its sink block
    assert slots_of(manager([TPB], slots=5)) == [5]   # a quota above the floor is kept


def test_full_attention_gets_the_largest_window_floor() -> None:
    mgr = manager([TPB, None], slots=2)               # one pool group of two layer groups
    assert slots_of(mgr) == [4]
    assert slots_of(manager([None], slots=1)) == [1]  # no window: one block


def test_cache_config_managers_keep_their_quota() -> None:
    mgr = KVCacheManager(CacheConfig(layers=(LayerSpec(0, 1, 64, window=TPB),), tokens_per_block=TPB,
                                     dtype="uint8", tiers=(PrimaryTier(SLOT, "cpu"),)))
    assert slots_of(mgr) == [1]


def test_clamp_counts_the_window_at_the_length() -> None:
    mgr = manager([TPB, None], slots=2)               # 4 slots: full 3 blocks + 1 in the window at 96
    assert mgr.clamp_max_seq_len_for_mem(batch_size=1, token_num_upper_bound=96) == 96
    # 80 tokens need 3 + 2 (the window straddles blocks 1 and 2): the longest whole block count that fits
    assert mgr.clamp_max_seq_len_for_mem(batch_size=1, token_num_upper_bound=80) == 64
    assert mgr.clamp_max_seq_len_for_mem(batch_size=2, token_num_upper_bound=96) == 32
    assert mgr.clamp_max_seq_len_for_mem(batch_size=1, token_num_upper_bound=0) == 0
    assert manager([TPB], slots=1).clamp_max_seq_len_for_mem(batch_size=1, token_num_upper_bound=96) == 96
    assert manager([None], slots=1).clamp_max_seq_len_for_mem(batch_size=1, token_num_upper_bound=64) == 32
