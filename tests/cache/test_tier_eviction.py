"""Eviction across tiers inside the cache manager: offload under pressure, onboarding at resume and
at prefix reuse (exact bytes from host and from disk), resume refusals without side effects, events,
quotas, and a property test over random workloads with a shrinking primary share."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.cache import DiskTier, HostTier, KVCache, KVCacheManager, Removed, TierTraffic, Updated
from kvxfer.cache.cuda_utils import cuda_usable
from kvxfer.cache.hashing import DEFAULT_SCOPE, block_keys
from kvxfer.cache.manager import DISK_MEDIUM, HOST_MEDIUM
from kvxfer.errors import CacheStateError, ManagerBusyError, TierError
from tests.support.reuse_support import TPB, check_kv, make_manager, write_kv
from tests.support.tier_helpers import multi_pool_config

HOST, DISK = 1, 2


# --- helpers ------------------------------------------------------------------------------------------
def tiered_manager(path: Path, primary: int, host: int = 0, disk: int = 0, **kw: Any) -> KVCacheManager:
    """A reuse_support manager (2 full-attention layers, TPB 4) with ``host``/``disk`` blocks of colder tiers."""
    return make_manager(primary, host_blocks=host, disk_blocks=disk, disk_path=str(path) if disk else None, **kw)


def run_prefill(mgr: KVCacheManager, tokens: npt.ArrayLike, cache_id: str | None = None) -> KVCache | None:
    """create -> resume -> resize -> write -> commit, leaving the cache ACTIVE; None (the cache closed
    again) when the primary tier cannot hold it."""
    arr = np.asarray(tokens, dtype=np.int64)
    kv = mgr.create_kv_cache_for_prompt(arr, cache_id)
    if not kv.resume() or not kv.resize(int(arr.size)):
        kv.close()
        return None
    write_kv(mgr, kv, arr, kv.num_committed_tokens, int(arr.size))
    kv.commit(arr[kv.num_committed_tokens:])
    return kv


def filler(mgr: KVCacheManager, blocks: int) -> KVCache:
    """An ACTIVE request holding ``blocks`` fresh primary blocks (pressure)."""
    kv = mgr.create_kv_cache()
    assert kv.resume()
    assert kv.resize(blocks * TPB)
    return kv


def tiers_of(kv: KVCache) -> list[int]:
    return kv.page_tiers(0).tolist()


def keys_of(tokens: npt.ArrayLike) -> tuple[bytes, ...]:
    return tuple(block_keys(np.asarray(tokens, dtype=np.int64), TPB, DEFAULT_SCOPE.root_key))


def moved(tokens: npt.ArrayLike, medium: str, old_medium: str) -> Updated:
    """The tier-move event of the chain of ``tokens``' full blocks: keys, parents and tokens per block."""
    keys = keys_of(tokens)
    toks = [int(t) for t in np.asarray(tokens)]
    return Updated(keys, medium, old_medium=old_medium, parent_hashes=(None, *keys[:-1]),
                   block_tokens=tuple(tuple(toks[i * TPB:(i + 1) * TPB]) for i in range(len(keys))), block_size=TPB)


def check_tier_references(mgr: KVCacheManager) -> None:
    """Every slot of every tier has exactly as many references as open caches and tree blocks point at
    it (so no page is lost or held twice), no slot is the page of two tree blocks, accounting balances."""
    layout = mgr.layout
    n_pg = len(layout.pool_groups)
    expected = [[np.zeros(mgr.allocator(pg, t).num_slots, dtype=np.int64) for pg in range(n_pg)]
                for t in range(mgr.num_tiers)]
    for kv in mgr.open_caches:
        for lg, lgd in enumerate(layout.layer_groups):
            ids, tiers = kv.page_locations(lg)
            for t in range(mgr.num_tiers):
                np.add.at(expected[t][lgd.pool_group_index], ids[(ids >= 0) & (tiers == t)], 1)
    tree_pages: set[tuple[int, int, int]] = set()
    for node in mgr.prefix_tree.nodes():
        for lg, (page, t) in enumerate(zip(node.pages.tolist(), node.tiers.tolist(), strict=True)):
            if page >= 0:
                pg = layout.layer_groups[lg].pool_group_index
                assert (t, pg, page) not in tree_pages, f"tier {t} pool group {pg} slot {page} in two tree blocks"
                tree_pages.add((t, pg, page))
                expected[t][pg][page] += 1
    for t in range(mgr.num_tiers):
        for pg in range(n_pg):
            np.testing.assert_array_equal(mgr.allocator(pg, t).refcount, expected[t][pg],
                                          err_msg=f"tier {t} pool group {pg}")
            mgr.slot_accounting(pg, t)   # balances, or raises


def snapshot(mgr: KVCacheManager) -> list[Any]:
    """Everything a refused call must leave unchanged: every cache's page locations, every tier's refcounts."""
    out: list[Any] = []
    for kv in mgr.open_caches:
        out.append((kv.id, kv.state, [loc.tolist() for lg in range(len(mgr.layout.layer_groups))
                                      for loc in kv.page_locations(lg)]))
    for t in range(mgr.num_tiers):
        out.append(mgr.allocator(0, t).refcount.tolist())
    out.append(sorted((n.key, n.pages.tolist(), n.tiers.tolist()) for n in mgr.prefix_tree.nodes()))
    return out


TOKENS_A = np.arange(100, 120)   # 5 blocks


# --- offload and onboard ---------------------------------------------------------------------------------
def test_held_pages_offload_to_host_and_come_back_exact(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 8, host=16)
    a = run_prefill(mgr, TOKENS_A, "a")
    assert a is not None
    a.suspend()
    mgr.drain_events()
    b = filler(mgr, 8)                                   # needs every primary slot: A's pages go down
    assert tiers_of(a) == [HOST] * 5
    assert mgr.storage_stats(HostTier).slots_used == (5,)
    assert mgr.storage_stats(0).slots_used == (8,)
    assert mgr.drain_events() == [moved(TOKENS_A, HOST_MEDIUM, "CPU")]
    with pytest.raises(CacheStateError, match="offloaded"):
        a.block_ids(0)
    check_tier_references(mgr)
    b.close()
    assert a.resume()
    assert tiers_of(a) == [0] * 5
    assert mgr.storage_stats(HostTier).slots_used == (0,)
    assert check_kv(mgr, a, TOKENS_A, 0, TOKENS_A.size) == TOKENS_A.size
    assert mgr.drain_events() == [moved(TOKENS_A, "CPU", HOST_MEDIUM)]   # back in the primary
    page = sum(p.slot_bytes for p in mgr.layout.pool_groups[0].pools)
    assert mgr.tier_traffic() == TierTraffic((0, 5), (0, 5), 0, 10 * page)
    check_tier_references(mgr)
    a.close()
    mgr.shutdown()


def test_offload_cascades_to_disk_and_onboards_exact(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 8, host=2, disk=16)
    a = run_prefill(mgr, TOKENS_A, "a")
    assert a is not None
    a.suspend()
    b = filler(mgr, 8)
    assert sorted(tiers_of(a)) == [HOST, HOST, DISK, DISK, DISK]
    assert mgr.storage_stats(DiskTier).slots_used == (3,)
    check_tier_references(mgr)
    b.close()
    assert a.resume()
    assert tiers_of(a) == [0] * 5
    assert check_kv(mgr, a, TOKENS_A, 0, TOKENS_A.size) == TOKENS_A.size
    assert mgr.storage_stats(DiskTier).slots_used == (0,)
    check_tier_references(mgr)
    a.close()
    mgr.shutdown()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".kv")]   # shutdown removes the pool files


def test_suspend_resume_round_trips_keep_writing(tmp_path: Path) -> None:
    """A request suspended and resumed several times, offloaded in between, keeps its KV exact and
    continues to grow after each resume."""
    mgr = tiered_manager(tmp_path, 6, host=2, disk=8)
    tokens = np.arange(500, 524)                         # 6 blocks, written in 3 steps of 2
    kv = mgr.create_kv_cache_for_prompt(tokens[:1], "r")
    for step in range(3):
        assert kv.resume()
        lo, hi = step * 8, step * 8 + 8
        assert kv.resize(hi)
        write_kv(mgr, kv, tokens, lo, hi)
        kv.commit(tokens[kv.num_committed_tokens:hi])
        kv.suspend()
        other = filler(mgr, 6)                           # push everything of r out of the primary
        assert 0 not in tiers_of(kv)
        other.close()
        check_tier_references(mgr)
    assert kv.resume()
    assert check_kv(mgr, kv, tokens, 0, 24) == 24
    kv.close()
    check_tier_references(mgr)
    mgr.shutdown()


def test_locked_pages_never_move(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 4, host=8)
    a = run_prefill(mgr, np.arange(16), "a")             # ACTIVE, all 4 primary slots
    assert a is not None
    b = mgr.create_kv_cache()
    assert b.resume()
    assert not b.resize(4)                               # nothing movable: refused, nothing moved
    assert tiers_of(a) == [0] * 4
    assert mgr.storage_stats(HostTier).slots_used == (0,)
    a.suspend()
    assert b.resize(4)                                   # now A's pages are held: one goes to the host
    assert sorted(tiers_of(a)) == [0, 0, 0, HOST]
    b.close()
    a.close()
    check_tier_references(mgr)
    mgr.shutdown()


# --- resume refusals --------------------------------------------------------------------------------------
def test_resume_false_without_side_effects(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 8, host=2, disk=16)
    a = run_prefill(mgr, TOKENS_A, "a")
    assert a is not None
    a.suspend()
    b = filler(mgr, 8)
    mgr.drain_events()
    before = snapshot(mgr)
    assert not a.resume()                                # B locks the whole primary tier
    assert snapshot(mgr) == before
    assert mgr.drain_events() == []
    b.close()
    assert a.resume()
    assert check_kv(mgr, a, TOKENS_A, 0, TOKENS_A.size) == TOKENS_A.size
    a.close()
    mgr.shutdown()


def test_resume_respects_max_utilization(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 8, host=16, resume_max_utilization=0.5)
    tokens = np.arange(300, 316)                         # 4 blocks
    a = run_prefill(mgr, tokens, "a")
    assert a is not None
    a.suspend()
    filler(mgr, 8).close()                               # A offloaded to the host
    assert tiers_of(a) == [HOST] * 4
    c = filler(mgr, 1)                                   # 1 locked + 4 > 0.5 * 8
    before = snapshot(mgr)
    assert not a.resume()
    assert snapshot(mgr) == before
    c.close()
    assert a.resume()                                    # 0 + 4 <= 4
    assert check_kv(mgr, a, tokens, 0, 16) == 16
    a.close()
    mgr.shutdown()


def test_resume_swaps_pages_through_full_tiers(tmp_path: Path) -> None:
    """Every tier full of held pages: a resume is refused while no slot is free anywhere; with one
    free slot it swaps the request's pages up and the displaced ones down, chunk by chunk."""
    mgr = tiered_manager(tmp_path, 4, host=2, disk=2)
    tokens_a, tokens_b = np.arange(16), np.arange(40, 52)
    a = run_prefill(mgr, tokens_a, "a")
    assert a is not None
    a.suspend()
    b = run_prefill(mgr, tokens_b, "b")                  # 3 blocks
    assert b is not None
    f = filler(mgr, 1)
    b.suspend()
    f.suspend()
    assert sorted(tiers_of(a)) == [HOST, HOST, DISK, DISK]
    assert all(mgr.allocator(0, t).num_free == 0 for t in range(3))
    before = snapshot(mgr)
    assert not a.resume()                                # nowhere to start a swap
    assert snapshot(mgr) == before
    f.close()
    assert a.resume()
    assert tiers_of(a) == [0] * 4
    assert sorted(tiers_of(b)) == [HOST, HOST, DISK]
    assert check_kv(mgr, a, tokens_a, 0, 16) == 16
    check_tier_references(mgr)
    a.suspend()
    assert b.resume()
    assert check_kv(mgr, b, tokens_b, 0, 12) == 12
    assert a.resume() is False                           # B locks 3 of 4 primary slots
    b.close()
    assert a.resume()
    assert check_kv(mgr, a, tokens_a, 0, 16) == 16
    a.close()
    check_tier_references(mgr)
    mgr.shutdown()


# --- prefix tree: events, drops, reuse from colder tiers --------------------------------------------------
def test_events_for_moves_and_drops_and_reuse_from_disk(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 4, host=2, disk=2)
    p1, p2, p3 = np.arange(0, 8), np.arange(50, 58), np.arange(90, 98)
    for p in (p1, p2):
        kv = run_prefill(mgr, p)
        assert kv is not None
        kv.close()                                       # tree-only (droppable) pages
    mgr.drain_events()
    c = filler(mgr, 4)
    assert mgr.drain_events() == [moved(p1, HOST_MEDIUM, "CPU"),
                                  moved(p1, DISK_MEDIUM, HOST_MEDIUM),
                                  moved(p2, HOST_MEDIUM, "CPU")]
    c.close()
    kv = run_prefill(mgr, p3)
    assert kv is not None
    kv.close()
    mgr.drain_events()
    c = filler(mgr, 4)                                   # the coldest tier drops p1 (leaf first)
    k1 = keys_of(p1)
    assert mgr.drain_events() == [Removed((k1[1], k1[0]), DISK_MEDIUM),
                                  moved(p2, DISK_MEDIUM, HOST_MEDIUM),
                                  moved(p3, HOST_MEDIUM, "CPU")]
    c.close()
    check_tier_references(mgr)
    traffic = mgr.tier_traffic()
    assert (traffic.offloaded_pages, traffic.onboarded_pages, traffic.dropped_blocks) == ((0, 6, 4), (0, 0, 0), 2)
    # p2 lives on disk now: a request with that prefix reuses it and onboards it at resume.
    prompt = np.concatenate([p2, [7, 7, 7]])
    assert mgr.probe_prompt_reuse(prompt) == 8
    kv = mgr.create_kv_cache_for_prompt(prompt, "reuse")
    assert kv.num_reused_tokens == 8
    assert tiers_of(kv) == [DISK, DISK]
    assert kv.resume()
    assert tiers_of(kv) == [0, 0]
    assert check_kv(mgr, kv, prompt, 0, 8) == 8
    check_tier_references(mgr)
    kv.close()
    mgr.shutdown()


def test_partial_reuse_of_an_offloaded_block(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 4, host=4)
    p = np.arange(200, 208)
    kv = run_prefill(mgr, p)
    assert kv is not None
    kv.close()
    filler(mgr, 4).close()                               # p's blocks go to the host
    prompt = np.concatenate([p[:6], [1, 2, 3]])          # block 0 full, block 1 partial (2 tokens)
    kv = mgr.create_kv_cache_for_prompt(prompt, "partial")
    assert kv.num_reused_tokens == 6
    assert tiers_of(kv) == [HOST, HOST]
    assert kv.resume()                                   # onboard both, then copy the partial block
    ids = kv.block_ids(0)
    assert ids[1] not in [n.pages[0] for n in mgr.prefix_tree.nodes()]
    assert check_kv(mgr, kv, prompt, 0, 6) == 6
    check_tier_references(mgr)
    kv.close()
    mgr.shutdown()


def test_priority_beats_recency_when_offloading(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 4, host=4)
    p1, p2 = np.arange(0, 8), np.arange(20, 28)
    kv1 = run_prefill(mgr, p1)
    assert kv1 is not None
    kv1.set_priority(90)                                 # older, but worth more
    kv1.close()
    kv2 = run_prefill(mgr, p2)
    assert kv2 is not None
    kv2.close()
    mgr.drain_events()
    filler(mgr, 2).close()
    assert mgr.drain_events() == [moved(p2, HOST_MEDIUM, "CPU")]
    tiers = {n.key: n.tiers.tolist() for n in mgr.prefix_tree.nodes()}
    assert [tiers[k] for k in keys_of(p1)] == [[0], [0]]
    assert [tiers[k] for k in keys_of(p2)] == [[HOST], [HOST]]
    mgr.shutdown()


def test_reset_prefix_tree_frees_every_tier(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 4, host=2, disk=2)
    for start in (0, 20, 40, 60):
        kv = run_prefill(mgr, np.arange(start, start + 8))
        assert kv is not None
        kv.close()
    assert [sum(mgr.storage_stats(t).slots_used) for t in range(3)] == [4, 2, 2]
    mgr.drain_events()
    assert mgr.reset_prefix_tree()
    assert [sum(mgr.storage_stats(t).slots_used) for t in range(3)] == [0, 0, 0]
    assert [type(e).__name__ for e in mgr.drain_events()] == ["AllCleared"]
    check_tier_references(mgr)
    mgr.shutdown()


def test_failed_offload_leaves_pages_in_place(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 4, disk=4)
    p = np.arange(0, 8)
    kv = run_prefill(mgr, p)
    assert kv is not None
    kv.close()
    for name in os.listdir(tmp_path):                    # the disk tier's files vanish behind its back
        os.unlink(tmp_path / name)
    mgr.drain_events()
    before = snapshot(mgr)
    f = mgr.create_kv_cache_for_prompt(None, "f")
    assert f.resume()
    with pytest.raises(TierError, match="was removed"):
        f.resize(4 * TPB)
    assert f.capacity == 0
    assert mgr.drain_events() == []
    f.close()
    assert snapshot(mgr) == before                       # the tree's pages still primary, disk slots freed
    check_tier_references(mgr)
    kv = mgr.create_kv_cache_for_prompt(np.concatenate([p, [1]]), "again")
    assert kv.resume()
    assert check_kv(mgr, kv, p, 0, 8) == 8
    kv.close()
    mgr.shutdown()                                       # files already gone: still a clean shutdown


# --- quotas and configuration -----------------------------------------------------------------------------
def test_resize_quota_moves_surplus_down_and_keeps_bytes(tmp_path: Path) -> None:
    mgr = tiered_manager(tmp_path, 8, host=8, disk=8)
    block = mgr.config.tiers[1].quota_bytes // 8
    a = run_prefill(mgr, TOKENS_A, "a")
    assert a is not None
    a.suspend()
    b = filler(mgr, 8)
    assert tiers_of(a) == [HOST] * 5
    with pytest.raises(ManagerBusyError, match="active"):
        mgr.resize_quota(HostTier, 2 * block)
    b.close()
    with pytest.raises(TierError, match="primary quota must be an int in"):
        mgr.resize_quota(0, 2 * mgr.config.primary.quota_bytes)   # the registered pools cannot grow
    before = snapshot(mgr)
    with pytest.raises(TierError, match="quota_bytes=100"):
        mgr.resize_quota(HostTier, 100)
    assert snapshot(mgr) == before
    mgr.resize_quota(HostTier, 2 * block)
    assert mgr.storage_stats(HostTier).slots_total == (2,)
    assert sorted(tiers_of(a)) == [HOST, HOST, DISK, DISK, DISK]
    assert mgr.current_config.tiers[1] == HostTier(2 * block, None)
    assert mgr.config.tiers[1] == HostTier(8 * block, None)          # the initial config is kept
    check_tier_references(mgr)
    before = snapshot(mgr)
    with pytest.raises(TierError, match="cannot be evicted"):
        mgr.resize_quota(DiskTier, block)                # 3 held pages on disk, nothing below: refused
    assert snapshot(mgr) == before
    assert mgr.storage_stats(DiskTier).slots_total == (8,)
    mgr.resize_quota(HOST, 16 * block)
    assert mgr.storage_stats(HOST).slots_total == (16,)
    assert a.resume()
    assert check_kv(mgr, a, TOKENS_A, 0, TOKENS_A.size) == TOKENS_A.size
    a.close()
    check_tier_references(mgr)
    mgr.shutdown()


def test_disk_path_errors_at_construction(tmp_path: Path) -> None:
    with pytest.raises(TierError, match="does not exist"):
        tiered_manager(tmp_path / "missing", 4, host=2, disk=2)
    with pytest.raises(TierError, match="has no HostTier"):
        tiered_manager(tmp_path, 4).storage_stats(HostTier)


# --- property: random workloads, a shrinking primary share ------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["new", "new", "resume", "suspend", "close", "squeeze", "release"]),
                         st.integers(0, 2**16)), min_size=4, max_size=28)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_no_page_lost_or_duplicated_across_tiers(tmp_path: Path, ops: list[tuple[str, int]]) -> None:
    """Random requests over a small vocabulary (so prefixes are shared and partially reused) are
    prefilled, suspended, resumed and closed while a ballast request takes ever more of the primary
    tier ("squeeze"). At every quiescent point each slot of each tier is held exactly by its owners;
    every resumed request reads back exactly the KV it wrote; at the end nothing is left behind."""
    path = Path(tempfile.mkdtemp(dir=tmp_path))          # one directory per example
    mgr = tiered_manager(path, 12, host=5, disk=8)
    ballast = mgr.create_kv_cache_for_prompt(None, "ballast")
    assert ballast.resume()
    tokens: dict[str, npt.NDArray[np.int64]] = {}
    for i, (op, seed) in enumerate(ops):
        rng = np.random.default_rng(seed)
        suspended = [kv for kv in mgr.open_caches if kv.id in tokens and kv.state.value == "suspended"]
        active = [kv for kv in mgr.open_caches if kv.id in tokens and kv.state.value == "active"]
        if op == "new":
            prompt = rng.integers(0, 3, int(rng.integers(5, 17)))
            kv = run_prefill(mgr, prompt, f"r{i}")
            if kv is not None:
                tokens[kv.id] = prompt
                if rng.random() < 0.7:
                    kv.suspend()
                else:
                    kv.close()
        elif op == "resume" and suspended:
            kv = suspended[int(rng.integers(len(suspended)))]
            if kv.resume():
                assert check_kv(mgr, kv, tokens[kv.id], 0, tokens[kv.id].size) == tokens[kv.id].size
        elif op == "suspend" and active:
            active[int(rng.integers(len(active)))].suspend()
        elif op == "close" and (suspended or active):
            pool = suspended + active
            pool[int(rng.integers(len(pool)))].close()
        elif op == "squeeze":
            ballast.resize(ballast.capacity + TPB * int(rng.integers(1, 3)))   # may be refused
        elif op == "release" and ballast.capacity:
            ballast.resize(max(0, ballast.capacity - 2 * TPB))
        check_tier_references(mgr)
    ballast.close()
    for kv in mgr.open_caches:
        if kv.state.value == "active":
            kv.close()
    # Resume, check and close the rest. Nothing is locked now, so a resume can only be refused when no
    # tier has a free slot to start swapping pages through (then the request is closed unchecked).
    for kv in mgr.open_caches:
        if kv.resume():
            assert check_kv(mgr, kv, tokens[kv.id], 0, tokens[kv.id].size) == tokens[kv.id].size
        else:
            assert all(mgr.allocator(0, t).num_free == 0 for t in range(mgr.num_tiers))
        kv.close()
        check_tier_references(mgr)
    for t in range(mgr.num_tiers):
        acc = mgr.slot_accounting(0, t)
        assert acc.request_only == acc.shared == 0
        assert acc.free + acc.evictable == acc.total
    mgr.shutdown()


# --- several pool groups, CPU and CUDA primary --------------------------------------------------------------
def _slot_rows(mgr: KVCacheManager, kv: KVCache) -> list[list[npt.NDArray[np.uint8]]]:
    """The raw bytes of every page of ``kv``, per layer group, per pool of its pool group."""
    out = []
    for lgd in mgr.layout.layer_groups:
        pg = mgr.layout.pool_groups[lgd.pool_group_index]
        ids = torch.from_numpy(kv.block_ids(lgd.layer_group_id).astype(np.int64))
        out.append([mgr.pool_tensor(pg.pool_group_index, p.pool_index).view(p.num_slots, p.slot_bytes)[
            ids.to(mgr.device)].cpu().numpy() for p in pg.pools])
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_every_pool_group_round_trips_exact_bytes(tmp_path: Path, device: str) -> None:
    """Two pool groups with aligned and unaligned pools (the tier helpers' config): a suspended
    request's pages pushed through host and disk come back byte for byte, on a CPU or CUDA primary."""
    if device.startswith("cuda") and not cuda_usable():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False or cuda-python (cuda.bindings) is missing")
    mgr = KVCacheManager(multi_pool_config(str(tmp_path), primary_slots=24, host_slots=6, disk_slots=40,
                                           device=device))
    slots = mgr.layout.pool_groups[0].num_slots
    assert [pg.num_slots for pg in mgr.layout.pool_groups] == [slots, slots]
    a = mgr.create_kv_cache_for_prompt(None, "a")
    assert a.resume()
    assert a.resize(10 * 16)
    gen = torch.Generator().manual_seed(7)
    for pg in mgr.layout.pool_groups:
        for p in pg.pools:
            t = mgr.pool_tensor(pg.pool_group_index, p.pool_index)
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen).to(t.device))
    expected = _slot_rows(mgr, a)
    a.suspend()
    b = mgr.create_kv_cache_for_prompt(None, "b")
    assert b.resume()
    assert b.resize(slots * 16)                          # every primary slot of both groups
    for lg in range(len(mgr.layout.layer_groups)):       # 6 pages fit the host, 4 went on to disk
        assert sorted(a.page_tiers(lg).tolist()) == [HOST] * 6 + [DISK] * 4
    check_tier_references(mgr)
    b.close()
    assert a.resume()
    for got_lg, exp_lg in zip(_slot_rows(mgr, a), expected, strict=True):
        for got, exp in zip(got_lg, exp_lg, strict=True):
            np.testing.assert_array_equal(got, exp)
    a.close()
    check_tier_references(mgr)
    mgr.shutdown()
