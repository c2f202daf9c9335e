"""Pool sizing by ratio: each pool group's primary slots come from a target ratio (initial_pool_ratio,
typical_step, constraints or a default request) with constraints and one worst-case request as floors,
and the batches named as constraints really run."""

from __future__ import annotations

import pytest

from kvxfer.cache import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerId,
    SsmLayerConfig,
    SwaScratchReuseConfig,
    _introspection,
)
from kvxfer.cache.pool_ratio import LifeCycleShape, PoolRatioPlanner, gpu_granularity
from kvxfer.errors import ConfigError

TPB = 32
WINDOW = 128
SWA_SLOT = 3 * 256 * 1024       # bytes per block of the windowed layer (not a power of two)
FULL_SLOT = 5 * 256 * 1024      # bytes per block of the full-attention layer
MIB = 1 << 20


def two_groups(quota: int = 128 * MIB, **kw: object) -> KVCacheManagerConfig:
    """A windowed layer (sink: one block) and a full-attention one of different slot sizes: two pool groups."""
    return KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(quota)],
        layers=[AttentionLayerConfig(LayerId(0), [BufferConfig(DataRole("key"), SWA_SLOT)],
                                     sliding_window_size=WINDOW, num_sink_tokens=TPB),
                AttentionLayerConfig(LayerId(1), [BufferConfig(DataRole("key"), FULL_SLOT)])], **kw)  # type: ignore[arg-type]


def totals(mgr: KVCacheManager) -> list[int]:
    return [s.total for s in _introspection.storage_statistics(mgr)]


def test_slots_for_a_batch_skip_stale_window_blocks_and_count_the_system_prompt_once() -> None:
    mgr = KVCacheManager(two_groups())
    # 4 requests of 16 blocks, 256 tokens written: the window keeps the sink block and blocks 4.. (5 stale)
    batch = BatchDesc([KVCacheDesc(capacity=512, history_length=256)] * 4)
    assert mgr.compute_slots_for_batch(batch) == [4 * (16 - 3), 4 * 16]
    # a 128-token system prompt (4 full blocks) is shared: counted once where some request still needs it
    shared = BatchDesc([KVCacheDesc(capacity=512, history_length=128)] * 4, system_prompt_length=128)
    assert mgr.compute_slots_for_batch(shared) == [4 + 4 * 12, 4 + 4 * 12]
    mgr.shutdown()


def test_a_recurrent_group_reserves_one_slot_per_request_even_a_zero_capacity_one() -> None:
    cfg = KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(64 * MIB)], commit_min_snapshot=True,
        layers=[SsmLayerConfig(LayerId(0), [BufferConfig(DataRole("state"), 64 * 1024)]),
                AttentionLayerConfig(LayerId(1), [BufferConfig(DataRole("key"), 8 * 1024)])])
    mgr = KVCacheManager(cfg)
    ssm = _introspection.ssm_life_cycle_id(mgr)
    assert ssm is not None
    ssm_pg = _introspection.pool_group_index(mgr, ssm)
    slots = _introspection.compute_slots_for_batch(
        mgr, BatchDesc([KVCacheDesc(64, 63), KVCacheDesc(0, 0)]), TPB)
    assert slots[ssm_pg] == 2 and slots[1 - ssm_pg] == 2
    with pytest.raises(ConfigError, match="tokens_per_block 16"):
        _introspection.compute_slots_for_batch(mgr, BatchDesc([]), 16)
    mgr.shutdown()


def test_constraints_floor_each_pool_group_and_their_batch_runs() -> None:
    constraint = BatchDesc([KVCacheDesc(capacity=512, history_length=0)] * 4)
    need = [4 * 16, 4 * 16]           # nothing written yet: every block of both groups
    grain = 2 * MIB
    tight = sum(-(-n * size // grain) * grain for n, size in zip(need, (SWA_SLOT, FULL_SLOT), strict=True))
    typical = BatchDesc([KVCacheDesc(capacity=4096, history_length=4000)])   # would starve the windowed group
    mgr = KVCacheManager(two_groups(quota=tight, typical_step=typical, constraints=[constraint]))
    assert all(t >= n for t, n in zip(totals(mgr), need, strict=True))
    unconstrained = KVCacheManager(two_groups(quota=tight, typical_step=typical))
    assert totals(unconstrained)[0] < need[0]
    unconstrained.shutdown()
    resume_all(mgr, 4, 512)


def test_typical_step_sets_the_ratio_from_the_bytes_it_needs() -> None:
    long = KVCacheManager(two_groups(typical_step=BatchDesc([KVCacheDesc(4096, 4000)] * 32)))
    ratio = _introspection.current_gpu_ratio(long)
    assert sum(ratio) == pytest.approx(1.0) and ratio[0] < 0.15        # the window keeps 8 of 128 blocks
    short = KVCacheManager(two_groups(typical_step=BatchDesc([KVCacheDesc(64, 32)] * 64)))
    ratio = _introspection.current_gpu_ratio(short)
    assert ratio[0] / ratio[1] == pytest.approx(SWA_SLOT / FULL_SLOT, rel=0.1)   # no stale block: slot sizes
    assert totals(short)[0] == pytest.approx(totals(short)[1], abs=2)
    long.shutdown()
    short.shutdown()


def test_initial_pool_ratio_is_per_layer_group_and_checked() -> None:
    mgr = KVCacheManager(two_groups(initial_pool_ratio=[0.25, 0.75]))
    assert _introspection.current_gpu_ratio(mgr) == pytest.approx([0.25, 0.75], abs=0.02)
    mgr.shutdown()
    shared = two_groups(initial_pool_ratio=[0.25, 0.75])
    shared.layers[1].buffers[0].size = SWA_SLOT              # same slot size: one pool group for both
    mgr = KVCacheManager(shared)
    assert _introspection.current_gpu_ratio(mgr) == [1.0]
    mgr.shutdown()
    for bad, what in (([0.5], "length 1"), ([0.0, 1.0], "positive, got \\[0.0, 1.0\\]"),
                      ([0.4, 0.5], "sum to 1.0, got 0.9")):
        with pytest.raises(ConfigError, match=f"initial_pool_ratio.*{what}"):
            KVCacheManager(two_groups(initial_pool_ratio=bad))


def test_a_bad_batch_is_refused_naming_where_it_is() -> None:
    with pytest.raises(ConfigError, match=r"constraints\[0\]\.kv_caches\[1\]: history_length 9 exceeds capacity 8"):
        KVCacheManager(two_groups(constraints=[BatchDesc([KVCacheDesc(8, 0), KVCacheDesc(8, 9)])]))
    with pytest.raises(ConfigError, match=r"typical_step\.kv_caches\[0\]\.capacity must be an int >= 0, got -1"):
        KVCacheManager(two_groups(typical_step=BatchDesc([KVCacheDesc(-1, 0)])))


def test_a_quota_below_the_constraints_is_raised_to_hold_them() -> None:
    constraint = BatchDesc([KVCacheDesc(capacity=1024, history_length=0)] * 8)
    mgr = KVCacheManager(two_groups(quota=8 * MIB, constraints=[constraint]))
    assert totals(mgr) == [8 * 32, 8 * 32]
    assert mgr.get_quota(0) >= 8 * 32 * (SWA_SLOT + FULL_SLOT)
    mgr.shutdown()


def test_a_small_quota_is_planned_in_bytes_not_rounded_up_to_grains() -> None:
    cfg = two_groups(quota=4 * MIB)
    cfg.layers[0].buffers[0].size = 4096
    cfg.layers[1].buffers[0].size = 8192
    mgr = KVCacheManager(cfg)
    used = sum(t * size for t, size in zip(totals(mgr), (4096, 8192), strict=True))
    assert 4 * MIB - 8192 < used <= 4 * MIB
    mgr.shutdown()


def test_planner_slot_counts_follow_the_ratio_above_the_floors() -> None:
    shapes = [LifeCycleShape(None, 0, False, 0, 1), LifeCycleShape(None, 0, False, 1, 1)]
    planner = PoolRatioPlanner(shapes, [[MIB], [MIB]], TPB, [BatchDesc([KVCacheDesc(10 * TPB, 0)])])
    assert planner.min_slots == (10, 10)
    grain = gpu_granularity(100 * MIB)
    assert grain == 2 * MIB and gpu_granularity(8 << 30) == 16 * MIB
    assert planner.slot_counts(100 * MIB, [0.5, 0.5], grain) == [50, 50]
    assert planner.slot_counts(100 * MIB, [0.95, 0.05], grain) == [90, 10]     # the floor holds the small one
    assert planner.constrain([0.95, 0.05], 100 * MIB, grain) == pytest.approx([0.9, 0.1])


def scratch_groups(scratch: bool, **kw: object) -> KVCacheManagerConfig:
    """Four windowed layers of one size (a 256 KiB slot, one layer takes a quarter of it) and a
    full-attention layer of 128 KiB: two pool groups; ``scratch``: sliding-window scratch reuse on (no rewind)."""
    windowed = [AttentionLayerConfig(LayerId(i), [BufferConfig(DataRole("key"), 64 * 1024)],
                                     sliding_window_size=WINDOW, num_sink_tokens=0) for i in range(4)]
    return KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(256 * MIB)],
        layers=[*windowed, AttentionLayerConfig(LayerId(4), [BufferConfig(DataRole("key"), 128 * 1024)])],
        swa_scratch_reuse=SwaScratchReuseConfig(max_rewind_len=0) if scratch else None, **kw)  # type: ignore[arg-type]


def test_scratch_blocks_of_a_prefill_step_count_as_the_shared_slots_that_hold_them() -> None:
    # a 1024-token prefill (32 blocks): blocks 0..27 leave the 128-token window by the step's end and
    # are scratch; four layers share a slot, so they take ceil(28 / 4) = 7 slots, plus 4 own blocks
    step = BatchDesc([KVCacheDesc(capacity=1024, history_length=0)] * 2)
    mgr = KVCacheManager(scratch_groups(True))
    assert mgr.compute_slots_for_batch(step) == [2 * (4 + 7), 2 * 32]
    assert _introspection.compute_slots_for_batch(mgr, step, TPB, None) == [2 * 32, 2 * 32]
    off = KVCacheManager(scratch_groups(False))
    assert off.compute_slots_for_batch(step) == [2 * 32, 2 * 32]
    assert _introspection.compute_slots_for_batch(off, step, TPB, SwaScratchReuseConfig(max_rewind_len=0)) == \
        [2 * (4 + 7), 2 * 32]
    # a decode step (history past the window) has no scratch blocks: the same count either way
    decode = BatchDesc([KVCacheDesc(capacity=1025, history_length=1024)])
    assert mgr.compute_slots_for_batch(decode) == off.compute_slots_for_batch(decode)
    mgr.shutdown()
    off.shutdown()


def test_a_prefill_typical_step_with_scratch_reuse_gives_the_windowed_group_a_smaller_share() -> None:
    step = BatchDesc([KVCacheDesc(capacity=1024, history_length=0)] * 8)
    with_scratch = KVCacheManager(scratch_groups(True, typical_step=step))
    without = KVCacheManager(scratch_groups(False, typical_step=step))
    yes, no = _introspection.current_gpu_ratio(with_scratch), _introspection.current_gpu_ratio(without)
    assert no[0] == pytest.approx(2 / 3, abs=0.01)          # 32 blocks each, twice the bytes per slot
    assert yes[0] == pytest.approx(11 * 2 / (11 * 2 + 32), abs=0.01)   # 11 slots for 32 blocks
    assert yes[1] > no[1]
    with_scratch.shutdown()
    without.shutdown()


def test_a_constraint_batch_resumes_whole_below_the_resume_gate() -> None:
    # 32 one-block requests, quota for exactly 32 slots per group: the floors take 32 / 0.95 -> 34 slots,
    # so the 32nd resume still sees a group below 95 % used
    step = BatchDesc([KVCacheDesc(capacity=1, history_length=0)] * 32)
    mgr = KVCacheManager(two_groups(32 * (SWA_SLOT + FULL_SLOT), constraints=[step], max_util_for_resume=0.95))
    assert min(totals(mgr)) >= 34
    resume_all(mgr, 32, 1)


def resume_all(mgr: KVCacheManager, count: int, capacity: int) -> None:
    """``count`` requests of ``capacity`` tokens all resume at once (asserted), then close; the manager shuts down."""
    caches = []
    for _ in range(count):
        kv = mgr.create_kv_cache()
        assert kv.resume() and kv.resize(capacity)
        caches.append(kv)
    for kv in caches:
        kv.close()
    mgr.shutdown()
