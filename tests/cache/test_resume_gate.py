"""The resume gate: a kv cache is not resumed while some primary pool group is already used above
``max_util_for_resume`` (slots neither free nor evictable), even when the cache itself needs no slot
to resume; the running caches keep that headroom to grow."""

from __future__ import annotations

from kvxfer.cache import (
    GPU_LEVEL,
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerId,
    _introspection,
)

TPB = 32
BIG = 64 * 1024         # bytes per block of the windowed layer
SMALL = 4 * 1024        # bytes per block of the full-attention layer


def two_groups(max_util: float) -> KVCacheManager:
    """A one-block window of big blocks and a full-attention layer of small ones: two pool groups
    (ten slots each), the windowed one filling up first."""
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(10 * (BIG + SMALL))], max_util_for_resume=max_util,
        layers=[AttentionLayerConfig(LayerId(0), [BufferConfig(DataRole("key"), BIG)], sliding_window_size=TPB,
                                     num_sink_tokens=0),
                AttentionLayerConfig(LayerId(1), [BufferConfig(DataRole("key"), SMALL)])],
        initial_pool_ratio=[BIG / (BIG + SMALL), SMALL / (BIG + SMALL)]))


def test_a_resume_needing_nothing_is_refused_while_one_pool_group_is_over_the_limit() -> None:
    mgr = two_groups(0.5)
    assert [s.total for s in _introspection.storage_statistics(mgr, GPU_LEVEL)] == [10, 10]
    running = []
    while max(_introspection.storage_utilization(mgr, GPU_LEVEL)) <= 0.5:
        kv = mgr.create_kv_cache()
        assert kv.resume()
        assert kv.resize(2 * TPB)           # two blocks of each group: 2 of 10 slots more each
        running.append(kv)
    assert _introspection.storage_utilization(mgr, GPU_LEVEL) == [0.6, 0.6]
    fresh = mgr.create_kv_cache()           # no page to onboard: it needs no slot to resume
    assert not fresh.resume()
    running.pop().close()                   # back to 0.4: at or under the limit
    assert fresh.resume()
    for kv in [*running, fresh]:
        kv.close()
    mgr.shutdown()


def test_the_gate_reads_the_most_used_pool_group() -> None:
    mgr = two_groups(0.5)
    running = []
    for _ in range(3):
        kv = mgr.create_kv_cache()
        assert kv.resume() and kv.resize(2 * TPB)
        running.append(kv)
    for kv in running:                      # the window moved on: each keeps 1 windowed block, 3 full ones
        assert kv.resize(3 * TPB, 3 * TPB - 1)
    util = _introspection.storage_utilization(mgr, GPU_LEVEL)
    assert util[1] > 0.5 >= util[0]
    refused = mgr.create_kv_cache()
    assert not refused.resume()
    for kv in [*running, refused]:
        kv.close()
    mgr.shutdown()
