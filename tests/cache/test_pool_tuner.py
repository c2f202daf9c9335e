"""The pool auto-tuner: rebalance_* settings are checked, need_adjustment opens only past every gate,
stats-excluded requests feed nothing, and adjust() moves slots between pool groups with the KV bytes of
the prefix tree intact."""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import pytest
import torch

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
    _introspection,
)
from kvxfer.cache.pool_tuner import MovingAverage
from kvxfer.errors import ConfigError, ManagerBusyError

TPB = 32
KEY = DataRole("key")


def config(**kw: Any) -> KVCacheManagerConfig:
    """A windowed layer of 16 KiB blocks and a full-attention one of 4 KiB blocks: two pool groups,
    planned for one 160-token request (equal byte shares)."""
    return KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(64 << 20)],
        layers=[AttentionLayerConfig(LayerId(0), [BufferConfig(KEY, 16384)], sliding_window_size=128,
                                     num_sink_tokens=0),
                AttentionLayerConfig(LayerId(1), [BufferConfig(KEY, 4096)])],
        typical_step=BatchDesc([KVCacheDesc(capacity=160, history_length=0)]), **kw)


def totals(mgr: KVCacheManager) -> list[int]:
    return [s.total for s in _introspection.storage_statistics(mgr)]


def close_one(mgr: KVCacheManager, capacity: int, cache_id: Any, *, dummy: bool = False) -> None:
    kv = mgr.create_kv_cache(None, list(range(TPB)), id=cache_id)
    if dummy:
        mgr.mark_stats_excluded(cache_id)
    assert kv.resume() and kv.resize(capacity, capacity - 1)
    kv.close()


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("rebalance_min_sampled_kv_caches", -1, "an int >= 0"),
    ("rebalance_cooldown_secs", -1.0, "a finite number >= 0"),
    ("rebalance_cooldown_secs", math.inf, "a finite number >= 0"),
    ("rebalance_target_ratio_update_interval", 0, "an int > 0"),
    ("rebalance_ratio_threshold", 1.0, "a finite number > 1"),
    ("rebalance_ratio_threshold", math.nan, "a finite number > 1"),
    ("rebalance_moving_average_decay", 0.0, r"a number in \(0, 1\)"),
    ("rebalance_moving_average_decay", 1.0, r"a number in \(0, 1\)"),
])
def test_bad_rebalance_settings_are_refused_naming_field_and_value(field: str, value: float, rule: str) -> None:
    with pytest.raises(ConfigError, match=f"KVCacheManagerConfig.{field} must be {rule}, got {value!r}") as info:
        config(**{field: value})
    assert isinstance(info.value, AssertionError)       # the reference asserts these


def test_need_adjustment_waits_for_samples_cooldown_and_drift() -> None:
    mgr = KVCacheManager(config(rebalance_min_sampled_kv_caches=10, rebalance_cooldown_secs=60.0,
                                rebalance_ratio_threshold=1.5))
    current = _introspection.current_gpu_ratio(mgr)
    assert current == pytest.approx([0.5, 0.5], abs=0.01)
    _introspection.set_target_ratio_list_gpu(mgr, [0.8, 0.2])          # 1.6x off: past the 1.5x threshold
    _introspection.set_last_adjustment_time(mgr, 0.0)
    _introspection.set_num_sampled_kv_caches(mgr, 9)
    assert not mgr.need_adjustment                                     # too few samples
    _introspection.set_num_sampled_kv_caches(mgr, 10)
    assert mgr.need_adjustment
    _introspection.set_last_adjustment_time(mgr, time.monotonic())
    assert not mgr.need_adjustment                                     # inside the cooldown
    _introspection.set_last_adjustment_time(mgr, 0.0)
    _introspection.set_target_ratio_list_gpu(mgr, [0.6, 0.4])          # 1.2x off: within the threshold
    assert not mgr.need_adjustment
    with pytest.raises(ConfigError, match="need 2 positive shares"):
        _introspection.set_target_ratio_list_gpu(mgr, [1.0])
    mgr.shutdown()


def test_only_counted_requests_move_the_target_and_only_every_interval() -> None:
    mgr = KVCacheManager(config(rebalance_min_sampled_kv_caches=0, rebalance_cooldown_secs=0.0,
                                rebalance_target_ratio_update_interval=2))
    assert not mgr.need_adjustment                       # the target starts as the current split
    long = 64 * TPB                                      # the window keeps 4 of 64 blocks: full attention wins
    close_one(mgr, long, "dummy", dummy=True)
    close_one(mgr, long, "d2", dummy=True)
    assert mgr.pool_tuner.num_sampled == 0 and not mgr.need_adjustment
    close_one(mgr, long, "real-1")
    assert mgr.pool_tuner.num_sampled == 1 and not mgr.need_adjustment    # not yet an update
    close_one(mgr, long, "real-2")
    assert mgr.need_adjustment
    target = mgr.pool_tuner.target_gpu_ratio
    assert target[0] < 0.3 < 0.7 < target[1]
    mgr.shutdown()


def test_adjust_moves_slots_and_keeps_the_tree_pages_bytes() -> None:
    mgr = KVCacheManager(config())
    prompt = list(range(1000, 1000 + 4 * TPB))
    kv = mgr.create_kv_cache(None, prompt)
    assert kv.resume() and kv.resize(len(prompt))
    written = {}
    for lg, layer in enumerate((0, 1)):
        view = mgr.buffer_view(layer, "key")
        for b, slot in enumerate(kv.page_locations(lg)[0].tolist()):
            value = torch.full_like(view[slot], (7 * lg + 13 * b + 1) % 251)
            view[slot] = value
            written[(lg, b)] = value
    kv.commit(prompt)
    kv.close()
    before = totals(mgr)
    _introspection.force_rebalance_precondition(mgr, skew=2.0)
    assert mgr.need_adjustment
    base_before = mgr.get_mem_pool_base_address(LayerId(0), KEY)
    mgr.adjust()
    after = totals(mgr)
    assert after[0] > before[0] and after[1] < before[1]
    ratio = _introspection.current_gpu_ratio(mgr)
    assert ratio[0] / ratio[1] == pytest.approx(2.0, rel=0.1)     # whole 2 MiB grains per pool
    assert not mgr.need_adjustment                       # the cooldown restarted
    assert mgr.get_mem_pool_base_address(LayerId(0), KEY) != base_before    # the grown group moved
    again = mgr.create_kv_cache(None, [*prompt, 1])
    assert again.resume() and again.num_committed_tokens == len(prompt)
    for lg, layer in enumerate((0, 1)):
        view = mgr.buffer_view(layer, "key")
        for b, slot in enumerate(again.page_locations(lg)[0].tolist()):
            assert slot >= 0 and torch.equal(view[slot], written[(lg, b)])
    assert again.resize(len(prompt) + TPB)               # the grown group hands out its new slots
    again.close()
    mgr.shutdown()


def test_adjust_is_refused_while_a_cache_is_active() -> None:
    mgr = KVCacheManager(config())
    kv = mgr.create_kv_cache()
    assert kv.resume()
    _introspection.force_rebalance_precondition(mgr)
    with pytest.raises(ManagerBusyError, match="adjust"):
        mgr.adjust()
    kv.close()
    mgr.adjust()
    mgr.shutdown()


def test_force_rebalance_needs_two_pool_groups() -> None:
    cfg = config()
    cfg.layers[1].buffers[0].size = 16384                # one slot size: one pool group
    mgr = KVCacheManager(cfg)
    with pytest.raises(ConfigError, match="at least 2 pool groups, got 1"):
        _introspection.force_rebalance_precondition(mgr)
    mgr.shutdown()


def test_moving_average_is_not_biased_towards_zero() -> None:
    avg = MovingAverage(0.5)
    assert avg.update(10.0) == 10.0
    assert avg.update(4.0) == pytest.approx((4.0 + 0.5 * 10.0) / 1.5)


def test_cooldown_opens_for_a_long_past_adjustment_on_a_recently_booted_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """time.monotonic() counts from boot: on a machine up for 500 s a last adjustment at 0.0 is still
    "long past", and the gate opens whatever the cooldown; one at the current time keeps it closed."""
    mgr = KVCacheManager(config(rebalance_min_sampled_kv_caches=0, rebalance_cooldown_secs=10_000.0,
                                rebalance_ratio_threshold=1.5))
    monkeypatch.setattr(time, "monotonic", lambda: 500.0)
    _introspection.set_target_ratio_list_gpu(mgr, [0.8, 0.2])
    _introspection.set_num_sampled_kv_caches(mgr, 1)
    _introspection.set_last_adjustment_time(mgr, time.monotonic())
    assert not mgr.need_adjustment                       # inside the cooldown
    _introspection.set_last_adjustment_time(mgr, 0.0)
    assert mgr.need_adjustment                           # never adjusted: the cooldown is over
    mgr.adjust()
    assert not mgr.need_adjustment                       # the cooldown restarted at 500.0


class BackToBackPools:
    """Pools carved one after another out of one arena, as the CUDA caching allocator places them
    (each pool starts where the previous one ends); host allocations usually land far apart."""

    def __init__(self, nbytes: int) -> None:
        self.arena = torch.zeros(nbytes, dtype=torch.uint8)
        self.used = 0

    def __call__(self, nbytes: int, device: str, *, pinned: bool = False) -> torch.Tensor:
        pool = self.arena[self.used:self.used + nbytes]
        assert pool.numel() == nbytes, "arena exhausted"
        self.used += nbytes
        return pool


def test_adjust_publishes_descriptors_of_the_live_pools_when_pools_sit_back_to_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvxfer.cache.manager as manager_module
    import kvxfer.cache.tier_quotas as quotas_module

    arena = BackToBackPools(160 << 20)
    monkeypatch.setattr(manager_module, "allocate_pool", arena)
    monkeypatch.setattr(quotas_module, "allocate_pool", arena)
    mgr = KVCacheManager(config())
    pools = [pg.pools[0] for pg in mgr.layout.pool_groups]
    assert pools[0].end_address == pools[1].base_address          # pool group 1 right after 0
    _introspection.force_rebalance_precondition(mgr, skew=2.0)
    mgr.adjust()                                                  # pool group 0 grows: reallocated
    after = totals(mgr)
    assert after[0] > pools[0].num_slots
    for pg in mgr.layout.pool_groups:
        for desc in pg.pools:
            live = mgr.pool_tensor(pg.pool_group_index, desc.pool_index)
            assert desc.base_address == live.data_ptr() and desc.nbytes <= live.numel()
    regions = sorted((r.base_address, r.base_address + r.nbytes) for r in mgr.memory_regions())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(regions))   # no overlap
    mgr.shutdown()
