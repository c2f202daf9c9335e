"""Statistics on a real reuse workload, with enable_stats on and off."""

from __future__ import annotations

import numpy as np
import pytest
from reuse_support import TPB, make_manager, prefill, write_kv

from kvxfer.cache import IterationStats, PoolGroupPeaks, RequestStats, SlotAccounting
from kvxfer.errors import KVCacheError


def run_workload(enable_stats: bool) -> tuple[list[IterationStats], list[tuple[PoolGroupPeaks, ...]], list[RequestStats],
                                              IterationStats, int]:
    """Three scheduler iterations: a cold prompt; a request reusing 4 full + 1 partial block next to a
    cold one; the reusing request growing. Returns what the stats API reported."""
    mgr = make_manager(64, enable_stats=enable_stats)
    p = np.random.default_rng(0).integers(0, 1000, 22)
    iters, peaks, pending = [], [], []
    prefill(mgr, p, extra_capacity=2)                                        # 6 blocks, 5 committed full
    iters.append(mgr.commit_pending_stats())
    peaks.append(mgr.read_peak_usage())

    b_tokens = np.concatenate([p[:18], np.arange(1000, 1006)])
    b = mgr.create_kv_cache(b_tokens)
    reused = b.num_reused_tokens
    pending.append(b.pending_stats)
    assert b.resume() and b.resize(b_tokens.size)
    write_kv(mgr, b, b_tokens, reused, b_tokens.size)
    b.commit(b_tokens[reused:])
    prefill(mgr, np.arange(2000, 2008))                                      # cold, 2 blocks
    iters.append(mgr.commit_pending_stats())
    peaks.append(mgr.read_peak_usage())

    assert b.resize(b_tokens.size + 2 * TPB)
    pending.append(b.pending_stats)
    iters.append(mgr.commit_pending_stats())
    b.close()
    return iters, peaks, pending, mgr.total_stats, reused


def test_stats_on_a_real_workload() -> None:
    iters, peaks, pending, total, reused = run_workload(True)
    assert reused == 18
    assert pending[0] == RequestStats(allocated_blocks=5, new_blocks=0, reused_full_blocks=4,
                                      reused_partial_blocks=1, missed_blocks=1)
    assert pending[1] == RequestStats(allocated_blocks=2, new_blocks=2)      # merged deltas restart at 0
    assert iters == [
        IterationStats(requests=1, allocated_blocks=6, new_blocks=6, missed_blocks=6),
        IterationStats(requests=2, allocated_blocks=8, new_blocks=3, reused_full_blocks=4,
                       reused_partial_blocks=1, missed_blocks=3),
        IterationStats(requests=1, allocated_blocks=2, new_blocks=2),
    ]
    assert [it.hit_rate for it in iters] == [0.0, 5 / 8, 0.0]
    assert total == IterationStats(requests=4, allocated_blocks=16, new_blocks=11, reused_full_blocks=4,
                                   reused_partial_blocks=1, missed_blocks=9)
    assert total.hit_rate == pytest.approx(5 / 14)
    assert peaks == [(PoolGroupPeaks(0, max_available=64, max_evictable=5, max_used=6),),
                     (PoolGroupPeaks(0, max_available=64, max_evictable=5, max_used=8),)]


def test_stats_disabled_count_nothing_on_the_same_workload() -> None:
    iters, peaks, pending, total, reused = run_workload(False)
    assert reused == 18                                                      # reuse itself still works
    assert pending == [RequestStats(), RequestStats()]
    assert iters == [IterationStats()] * 3
    assert total == IterationStats()
    assert peaks == [(PoolGroupPeaks(0, 0, 0, 0),)] * 2


def test_slot_accounting_must_balance() -> None:
    with pytest.raises(KVCacheError, match="does not balance"):
        SlotAccounting(0, total=10, free=5, request_only=1, evictable=1, shared=1)
    acc = SlotAccounting(0, total=10, free=5, request_only=2, evictable=2, shared=1)
    assert (acc.available, acc.used) == (7, 3)
