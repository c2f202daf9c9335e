"""Statistics on a real reuse workload, with enable_stats on and off: request deltas committed or
discarded by the request, iteration counters per layer group, peaks per cache level, dirty and
excluded ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvxfer.cache import (
    KVCacheIterationStatsDelta,
    KVCacheStatsDelta,
    PoolGroupPeakBlockStats,
    SlotAccounting,
)
from kvxfer.errors import KVCacheError
from tests.support.reuse_support import TPB, make_manager, prefill, write_kv


def run_workload(enable_stats: bool) -> dict[str, Any]:
    """Three scheduler steps: a cold prompt; a request reusing 4 full + 1 partial block next to a cold
    one; the reusing request growing into generation (then discarding that step's counters)."""
    mgr = make_manager(64, enable_stats=enable_stats)
    page = mgr.layout.pool_groups[0].pools[0].slot_bytes * len(mgr.layout.pool_groups[0].pools)
    out: dict[str, Any] = {"page": page, "iters": [], "peaks": []}
    p = np.random.default_rng(0).integers(0, 1000, 22)
    prefill(mgr, p, extra_capacity=2)                       # 6 blocks, all missed; closing commits them
    out["iters"].append(mgr.get_and_reset_iteration_stats())
    out["peaks"].append(mgr.get_and_reset_iteration_peak_block_stats(0))

    b_tokens = np.concatenate([p[:18], np.arange(1000, 1006)])
    b = mgr.create_kv_cache_for_prompt(b_tokens)
    out["reused"] = b.num_reused_tokens
    out["after_create"] = b.pending_stats
    assert b.resume() and b.resize(b_tokens.size)
    write_kv(mgr, b, b_tokens, b.num_reused_tokens, b_tokens.size)
    b.commit(b_tokens[b.num_reused_tokens:])
    out["dirty"] = mgr.get_dirty_stats_kv_cache_ids()
    out["b_delta"] = b.commit_pending_stats()
    prefill(mgr, np.arange(2000, 2008))                     # cold, 2 blocks
    out["iters"].append(mgr.get_and_reset_iteration_stats())
    out["peaks"].append(mgr.get_and_reset_iteration_peak_block_stats(0))

    assert b.resize(b_tokens.size + 2 * TPB)                # 2 generation blocks
    out["gen_pending"] = b.pending_stats
    out["dirty_after_resize"] = mgr.get_dirty_stats_kv_cache_ids()
    b.discard_pending_stats()
    out["dirty_after_discard"] = mgr.get_dirty_stats_kv_cache_ids()
    out["iters"].append(mgr.get_and_reset_iteration_stats())
    b.close()
    out["committed"] = mgr.get_committed_stats()
    return out


def test_stats_on_a_real_workload() -> None:
    r = run_workload(True)
    page = r["page"]
    assert r["reused"] == 18
    assert r["after_create"] == KVCacheStatsDelta(reused_blocks=5)     # reuse allocates nothing
    assert r["dirty"] == {"kv-1"}
    # the private copy of the partially reused block and block 6 are new; block 6 is missed
    assert r["b_delta"] == KVCacheStatsDelta(alloc_total_blocks=2, alloc_new_blocks=2, reused_blocks=5,
                                             missed_blocks=1)
    assert r["iters"][0] == {0: KVCacheIterationStatsDelta(iter_alloc_total_blocks=6, iter_alloc_new_blocks=6,
                                                           iter_missed_blocks=6)}
    assert r["iters"][1] == {0: KVCacheIterationStatsDelta(
        iter_alloc_total_blocks=4, iter_alloc_new_blocks=4, iter_reused_blocks=5, iter_full_reused_blocks=4,
        iter_partial_reused_blocks=1, iter_missed_blocks=3, iter_intra_device_copy_blocks=1,
        iter_intra_device_copy_bytes=page)}                 # the partially reused block's private copy
    assert r["iters"][1][0].iter_cache_hit_rate == pytest.approx(5 / 8)
    assert r["gen_pending"] == KVCacheStatsDelta(alloc_total_blocks=2, alloc_new_blocks=2)
    assert r["dirty_after_resize"] == {"kv-1"} and r["dirty_after_discard"] == set()
    assert r["iters"][2] == {}                              # discarded, and the close committed nothing
    assert r["committed"] == KVCacheStatsDelta(alloc_total_blocks=10, alloc_new_blocks=10, reused_blocks=5,
                                               missed_blocks=9)   # 6 + 2 + 2 cold; the discarded 2 are not in
    assert r["peaks"] == [(PoolGroupPeakBlockStats(available=64, unavailable=6, evictable=5),),
                          (PoolGroupPeakBlockStats(available=64, unavailable=8, evictable=5),)]


def test_stats_disabled_count_nothing_and_peaks_read_the_present() -> None:
    r = run_workload(False)
    assert r["reused"] == 18                                 # reuse itself still works
    assert r["after_create"].empty and r["b_delta"].empty and r["gen_pending"].empty
    assert r["iters"] == [{}, {}, {}]
    assert r["committed"] == KVCacheStatsDelta()
    assert r["dirty"] == set()
    # no made-up zeros: the present accounting, not a peak nobody sampled (after step 1: 5 tree
    # blocks; after step 2: b's 6 pages held, p's 5th block and the 2 cold ones evictable)
    assert r["peaks"][0] == (PoolGroupPeakBlockStats(available=64, unavailable=0, evictable=5),)
    assert r["peaks"][1] == (PoolGroupPeakBlockStats(available=58, unavailable=6, evictable=3),)


def test_excluded_requests_record_nothing() -> None:
    mgr = make_manager(16)
    mgr.mark_stats_excluded("warmup")
    assert mgr.is_stats_excluded("warmup") and not mgr.is_stats_excluded("real")
    prefill(mgr, np.arange(8), id="warmup")
    assert mgr.get_committed_stats().empty and mgr.get_dirty_stats_kv_cache_ids() == set()
    mgr.clear_stats_excluded("warmup")
    prefill(mgr, np.arange(100, 108), id="warmup")
    assert mgr.get_committed_stats() == KVCacheStatsDelta(2, 2, 0, 2)
    mgr.mark_stats_dirty("x")
    mgr.mark_stats_dirty(None)
    assert mgr.get_dirty_stats_kv_cache_ids() == {"x"}
    mgr.clear_stats_dirty("x")
    assert mgr.get_dirty_stats_kv_cache_ids() == set()
    mgr.mark_stats_dirty("late")                             # excluding a request also undirties it ...
    mgr.mark_stats_excluded("late")
    assert mgr.get_dirty_stats_kv_cache_ids() == set()
    kv = mgr.create_kv_cache_for_prompt(None, "late2")
    assert kv.resume() and kv.resize(8)
    mgr.mark_stats_excluded("late2")                         # ... and drops what it had pending
    assert kv.commit_pending_stats() == KVCacheStatsDelta() and mgr.get_and_reset_iteration_stats() != {}
    kv.close()


@pytest.mark.parametrize("enable_stats", [False, True])
def test_an_idle_manager_reports_empty_stats(enable_stats: bool) -> None:
    """The reference's API test: nothing committed, no iteration entry, peaks of the present state."""
    mgr = make_manager(16, enable_stats=enable_stats)
    assert mgr.init_config.enable_stats is mgr.config.enable_stats is enable_stats
    assert mgr.get_committed_stats() == KVCacheStatsDelta()
    assert mgr.get_and_reset_iteration_stats() == {}
    assert mgr.get_and_reset_iteration_peak_block_stats(0) == (PoolGroupPeakBlockStats(16, 0, 0),)
    kv = mgr.create_kv_cache_for_prompt(None, "17", expected_prompt_length=8)
    assert kv.commit_pending_stats() == KVCacheStatsDelta()
    assert kv.resume() and kv.resize(8)
    delta = kv.commit_pending_stats()
    iteration = mgr.get_and_reset_iteration_stats()
    if enable_stats:
        assert delta == KVCacheStatsDelta(2, 2, 0, 2) == mgr.get_committed_stats()
        assert iteration == {0: KVCacheIterationStatsDelta(iter_alloc_total_blocks=2, iter_alloc_new_blocks=2,
                                                           iter_missed_blocks=2)}
    else:
        assert delta.empty and mgr.get_committed_stats().empty and iteration == {}
    kv.close()


def test_sliding_window_reuse_counts_only_pages_it_takes() -> None:
    """The reference's SWA case: 16 tokens, window 8, 15 reused; the window group takes blocks 2 (full)
    and 3 (partial) only, the stale 0 and 1 are not counted as reused; the private copy is new."""
    mgr = make_manager(16, windows=[8], num_layers=1)
    prefill(mgr, np.arange(16))
    mgr.get_and_reset_iteration_stats()
    kv = mgr.create_kv_cache_for_prompt(np.arange(16))
    assert kv.num_reused_tokens == 15
    assert kv.resume() and kv.resize(16)
    assert kv.commit_pending_stats() == KVCacheStatsDelta(alloc_total_blocks=1, alloc_new_blocks=1, reused_blocks=2)
    page = sum(p.slot_bytes for p in mgr.layout.pool_groups[0].pools)
    assert mgr.get_and_reset_iteration_stats() == {0: KVCacheIterationStatsDelta(
        iter_alloc_total_blocks=1, iter_alloc_new_blocks=1, iter_reused_blocks=2, iter_full_reused_blocks=1,
        iter_partial_reused_blocks=1, iter_intra_device_copy_blocks=1, iter_intra_device_copy_bytes=page)}
    kv.close()


def test_a_reverted_allocation_reports_nothing() -> None:
    """The reference's reverted generation allocation: blocks allocated and freed again before the
    commit are not counted; committed ones stay counted after a shrink."""
    mgr = make_manager(16, windows=[None, 8], swa_scratch_reuse=True)
    kv = mgr.create_kv_cache_for_prompt(np.arange(8))
    assert kv.resume() and kv.resize(8)
    assert kv.commit_pending_stats() == KVCacheStatsDelta(2, 2, 0, 2)
    assert set(mgr.get_and_reset_iteration_stats()) == {0, 1}
    assert kv.resize(12)                                     # a generation block ...
    assert kv.pending_stats == KVCacheStatsDelta(1, 1, 0, 0)
    assert kv.resize(8)                                      # ... reverted before the commit
    assert kv.pending_stats.empty and kv.commit_pending_stats().empty
    assert mgr.get_and_reset_iteration_stats() == {}
    # blocks 2..5; the window group's 2 and 3 are scratch (out of the window at 24 tokens); 4, 5 reverted
    assert kv.resize(24) and kv.get_scratch_desc(1) is not None and kv.resize(16)
    assert kv.pending_stats == KVCacheStatsDelta(2, 2, 0, 0)
    kv.commit_pending_stats()
    iteration = mgr.get_and_reset_iteration_stats()
    assert iteration == {0: KVCacheIterationStatsDelta(iter_alloc_total_blocks=2, iter_alloc_new_blocks=2,
                                                       iter_gen_alloc_blocks=2)}   # group 1: only scratch
    assert kv.resize(8)                                      # committed blocks stay counted
    assert mgr.get_committed_stats() == KVCacheStatsDelta(4, 4, 0, 2)
    kv.close()


def test_stats_delta_arithmetic() -> None:
    a = KVCacheStatsDelta(4, 3, 2, 1)
    b = a.copy()
    assert b == a and b is not a
    b.add(KVCacheStatsDelta(1, 1, 1, 1))
    assert b == KVCacheStatsDelta(5, 4, 3, 2) and a == KVCacheStatsDelta(4, 3, 2, 1)
    b.subtract(a)
    assert b == KVCacheStatsDelta(1, 1, 1, 1) and not b.empty
    b.clear()
    assert b.empty and b == KVCacheStatsDelta()
    it = KVCacheIterationStatsDelta(iter_reused_blocks=3, iter_missed_blocks=1)
    assert it.iter_cache_hit_rate == 0.75 and KVCacheIterationStatsDelta().iter_cache_hit_rate == 0.0


def test_slot_accounting_must_balance() -> None:
    with pytest.raises(KVCacheError, match="does not balance"):
        SlotAccounting(0, total=10, free=5, request_only=1, evictable=1, shared=1)
    acc = SlotAccounting(0, total=10, free=5, request_only=2, evictable=2, shared=1)
    assert (acc.available, acc.used) == (7, 3)


def test_iteration_stats_count_tier_traffic() -> None:
    """Offloads, onboards and host drops in the iteration stats agree with the manager's tier traffic."""
    mgr = make_manager(8, host_blocks=4)
    page = sum(p.slot_bytes for p in mgr.layout.pool_groups[0].pools)
    a_tokens = np.arange(100, 120)
    a = mgr.create_kv_cache_for_prompt(a_tokens)
    assert a.resume() and a.resize(20)
    write_kv(mgr, a, a_tokens, 0, 20)
    a.commit(a_tokens)
    a.suspend()
    for first in (1000, 2000, 3000):                       # cold prompts push tree pages to host, then out
        prefill(mgr, np.arange(first, first + 16))
    assert a.resume()                                      # a's offloaded pages come back
    a.close()
    it = mgr.get_and_reset_iteration_stats()[0]
    traffic = mgr.tier_traffic()
    assert it.iter_offload_blocks == traffic.offloaded_pages[1] > 0
    assert it.iter_onboard_blocks == traffic.onboarded_pages[1] > 0
    assert it.iter_offload_bytes == it.iter_offload_blocks * page
    assert it.iter_onboard_bytes == it.iter_onboard_blocks * page
    assert it.iter_host_dropped_blocks > 0 and it.iter_host_dropped_bytes == it.iter_host_dropped_blocks * page
    assert mgr.get_and_reset_iteration_stats() == {}       # reset
    peaks = mgr.get_and_reset_iteration_peak_block_stats_by_level()
    host = peaks[1][0]                                     # the host level: 4 slots, each peak on its own
    assert len(peaks) == 2 and host.available == 4 and 0 < host.unavailable <= 4 and 0 < host.evictable <= 4
