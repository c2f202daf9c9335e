"""KVCacheManager and KVCache: allocation, lifecycle, views over real memory."""

from __future__ import annotations

import ctypes
import gc
import re

import numpy as np
import pytest
import torch

from kvxfer.cache import BufferId, CacheConfig, CacheState, KVCache, KVCacheManager, RoleSpec
from kvxfer.cache.allocator import SlotAllocator
from kvxfer.errors import (
    BlockIdError,
    CacheClosedError,
    CacheStateError,
    CapacityError,
    ManagerBusyError,
    OutOfSlotsError,
)

SCALE = RoleSpec("key_scale", head_dim=1, dtype="float32")


def manager(blocks: int = 8, **kw: object) -> KVCacheManager:
    kw.setdefault("windows", [32, None])
    kw.setdefault("enable_prefix_reuse", False)  # these tests check raw allocation; reuse has its own
    return KVCacheManager(CacheConfig.for_model(4, 4, 8, 8, "float16", blocks,
                                                roles=("key", "value", SCALE), **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("coalesce", [True, False])
def test_buffer_view_writes_land_where_descriptors_say(order: str, coalesce: bool) -> None:
    m = manager(head_order=order, coalesce=coalesce)
    layout = m.layout
    gen = torch.Generator().manual_seed(0)
    for bid, fmt in layout.formats:
        view = m.buffer_view(bid.layer_id, bid.role)
        shape = (fmt.num_heads, fmt.tokens_per_block, fmt.head_dim) if order == "HND" else \
            (fmt.tokens_per_block, fmt.num_heads, fmt.head_dim)
        assert view.shape[1:] == shape
        slot = 5
        pattern = torch.randn(shape, generator=gen).to(view.dtype)
        view[slot] = pattern
        _, pool, eb = layout.locate(bid)
        addr = pool.base_address + slot * pool.slot_bytes + eb.offset
        raw = ctypes.string_at(addr, eb.size)
        assert raw == pattern.contiguous().view(torch.uint8).numpy().tobytes(), bid
        # element (h, t, d) sits where the format says
        h, t, d = fmt.num_heads - 1, fmt.tokens_per_block - 1, fmt.head_dim - 1
        idx = (h * fmt.tokens_per_block + t) * fmt.head_dim + d if order == "HND" else \
            (t * fmt.num_heads + h) * fmt.head_dim + d
        elem = np.frombuffer(raw, dtype=np.float16 if fmt.dtype == "float16" else np.float32)[idx]
        value = pattern[h, t, d] if order == "HND" else pattern[t, h, d]
        assert elem == value.item()


def test_views_of_one_layer_group_do_not_overlap() -> None:
    """Buffers of one layer group are disjoint; layer groups sharing a pool group alias the same
    slot bytes by design (a slot belongs to one layer group's block at a time)."""
    m = manager()
    for lg in m.layout.layer_groups:
        mine = [bid for bid, _ in m.layout.formats if bid.layer_id in lg.layer_ids]
        for bid in mine:
            m.buffer_view(bid.layer_id, bid.role).fill_(bid.layer_id * 10 + len(bid.role))
        for bid in mine:
            assert bool((m.buffer_view(bid.layer_id, bid.role) == bid.layer_id * 10 + len(bid.role)).all()), bid


def test_lifecycle_and_block_ids() -> None:
    m = manager(blocks=8)
    kv = m.create_kv_cache(id="r1")
    assert kv.state is CacheState.SUSPENDED
    with pytest.raises(CacheStateError, match="resume"):
        kv.resize(16)
    assert kv.resume() and kv.state is CacheState.ACTIVE
    assert kv.resize(20)
    assert kv.capacity == 20 and kv.num_blocks == 3
    ids = [kv.block_ids(g) for g in range(2)]
    assert all(b.dtype == np.int32 and b.size == 3 for b in ids)
    assert len(set(np.concatenate(ids).tolist())) == 6  # both layer groups share one allocator
    kv.commit(range(10))
    assert kv.num_committed_tokens == 10 and kv.history_length == 10
    with pytest.raises(CapacityError, match="past capacity"):
        kv.commit(range(11))
    with pytest.raises(CapacityError, match="below history_length"):
        kv.resize(5)
    assert kv.resize(12) and kv.num_blocks == 2
    assert m.allocator(0).num_used == 4
    kv.suspend()
    assert kv.state is CacheState.SUSPENDED
    kv.close()
    assert m.allocator(0).num_used == 0
    kv.close()                          # closing again does nothing (the reference design's close)
    assert kv.state is CacheState.CLOSED
    with pytest.raises(CacheClosedError, match="r1"):
        kv.resize(4)
    first = m.create_kv_cache(id="x")
    with pytest.raises(CacheStateError, match="already open"):
        m.create_kv_cache(id="x")
    first.close()


def test_exhaustion_fails_cleanly_and_recovers() -> None:
    m = manager(blocks=4)  # 8 slots shared by two layer groups
    a = m.create_kv_cache()
    a.resume()
    assert a.resize(24)  # 3 blocks x 2 groups = 6 slots
    b = m.create_kv_cache()
    b.resume()
    before = m.allocator(0).refcount.copy()
    assert not b.resize(16)  # needs 4, 2 free: nothing half-allocated
    assert b.capacity == 0 and b.num_blocks == 0
    assert np.array_equal(before, m.allocator(0).refcount)
    assert b.resize(8)
    a.close()
    assert b.resize(32)
    assert m.allocator(0).num_used == 8
    b.close()
    assert m.num_free_slots(0) == 8


def test_sliding_window_releases_pages_out_of_window() -> None:
    m = manager(blocks=16)  # tokens_per_block 8, window 32 on layer group 0
    kv = m.create_kv_cache()
    kv.resume()
    assert kv.resize(80)
    kv.commit(range(80))
    swa, full = kv.block_ids(0), kv.block_ids(1)
    # next token at position 80 attends to 49..80: blocks 0..5 (tokens 0..47) are released
    assert (swa[:6] == -1).all() and (swa[6:] >= 0).all()
    assert (full >= 0).all()
    assert m.allocator(0).num_used == 10 + 4
    kv.close()
    assert m.allocator(0).num_used == 0


def test_sink_tokens_are_kept() -> None:
    m = manager(blocks=16, sink_tokens=4)
    kv = m.create_kv_cache()
    kv.resume()
    kv.resize(80)
    kv.commit(range(80))
    swa = kv.block_ids(0)
    assert swa[0] >= 0 and (swa[1:6] == -1).all()
    kv.close()


def test_token_ids_must_fit_uint32() -> None:
    m = manager()
    kv = m.create_kv_cache()
    kv.resume()
    kv.resize(8)
    with pytest.raises(CapacityError, match="uint32"):
        kv.commit([1, 2, 1 << 32])
    with pytest.raises(CapacityError, match="uint32"):
        kv.commit([-1])
    kv.close()


def test_shutdown_refuses_open_caches() -> None:
    m = manager()
    kv = m.create_kv_cache()
    with pytest.raises(ManagerBusyError, match=re.escape("1 KV cache(s) still open")):
        m.shutdown()
    kv.close()
    m.shutdown()
    with pytest.raises(ManagerBusyError):
        m.create_kv_cache()


def test_allocator_incref_counts_every_occurrence_in_any_order() -> None:
    """incref's two paths: ascending ids (one each) and unordered or repeated ids (counted), exactly."""
    a = SlotAllocator(8, "pg")
    a.alloc(6)
    a.incref(np.array([1, 2, 5], dtype=np.int32))
    a.incref(np.array([5, 1, 5, 0, 5], dtype=np.int32))
    assert a.refcount[:6].tolist() == [2, 3, 2, 1, 1, 5]
    with pytest.raises(BlockIdError, match="incref of free slot 6"):
        a.incref(np.array([6, 1], dtype=np.int32))
    assert a.refcount[:7].tolist() == [2, 3, 2, 1, 1, 5, 0]   # all or nothing


def test_allocator_refcounts_and_errors() -> None:
    a = SlotAllocator(6, "pg")
    ids = a.alloc(4)
    assert ids.tolist() == [0, 1, 2, 3]
    a.incref(ids[:2])
    assert a.decref(ids).tolist() == [2, 3]
    assert a.num_free == 4
    with pytest.raises(BlockIdError, match="released more often"):
        a.decref([2])
    with pytest.raises(BlockIdError, match="outside"):
        a.decref([9])
    with pytest.raises(OutOfSlotsError, match="5 slots requested, 4 free"):
        a.alloc(5)
    assert sorted(a.alloc(4).tolist()) == [2, 3, 4, 5]


def test_memory_regions_match_layout() -> None:
    m = manager()
    regions = m.memory_regions()
    pools = [p for pg in m.layout.pool_groups for p in pg.pools]
    assert [(r.base_address, r.nbytes) for r in regions] == [(p.base_address, p.nbytes) for p in pools]
    assert m.layout.locate(BufferId(3, "value"))[1].memory_kind == "cpu"


def _two_pool_groups() -> KVCacheManager:
    """Full attention and a sliding window (8 tokens) of another head size: two pool groups, 4 tokens a block."""
    from kvxfer.cache import LayerSpec, PrimaryTier
    layers = (LayerSpec(0, 2, 8), LayerSpec(1, 2, 16, window=8))
    mgr = KVCacheManager(CacheConfig(layers=layers, tokens_per_block=4, dtype="float16", tiers=(PrimaryTier(1 << 20),)))
    assert len(mgr.layout.pool_groups) == 2
    return mgr


def test_a_pin_is_all_or_nothing_across_pool_groups() -> None:
    """A pin naming a free slot in its second pool group pins nothing: the first group's pages are let go
    again, so closing their request frees every page."""
    mgr = _two_pool_groups()
    free = [mgr.allocator(pg).num_free for pg in (0, 1)]
    cache = mgr.create_kv_cache(id="r")
    assert cache.resume() and cache.resize(16)
    ids = cache.block_id_map()
    free_slot = int(np.setdiff1d(np.arange(mgr.layout.pool_groups[1].num_slots), ids[1])[0])
    with pytest.raises(BlockIdError, match="incref of free slot"):
        mgr.pin_pages({0: ids[0], 1: [free_slot]})
    cache.close()
    assert [mgr.allocator(pg).num_free for pg in (0, 1)] == free
    mgr.shutdown()


def test_pin_cache_pages_names_no_page_its_request_frees_meanwhile() -> None:
    """The request's own thread slides its window (freeing pages) while another pins the request's pages
    (the prefill engine's early plan): ids and pin are taken together, so no pin names a freed page, and
    each pin holds exactly the ids it returned until released (8 requests, threads switched every us)."""
    import sys
    import threading
    mgr = _two_pool_groups()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_no in range(8):
            cache = mgr.create_kv_cache(id=f"r{round_no}")
            assert cache.resume() and cache.resize(400)
            stop = threading.Event()

            def slide(cache: KVCache = cache, stop: threading.Event = stop) -> None:
                for n in range(4, 401, 4):
                    cache.history_length = n
                stop.set()
            thread = threading.Thread(target=slide)
            thread.start()
            pins = 0
            try:
                while not stop.is_set() or not pins:
                    ids, pin = mgr.pin_cache_pages(cache)
                    assert pin.num_pages == int((ids[0] >= 0).sum() + (ids[1] >= 0).sum())
                    pin.release()
                    pins += 1
            finally:
                thread.join()
            assert (cache.block_ids(1)[:-2] == -1).all()     # the window slid past all but its last blocks
            cache.close()
    finally:
        sys.setswitchinterval(interval)
    mgr.shutdown()


def test_a_cache_dropped_unclosed_is_closed_by_the_manager() -> None:
    """The manager holds its kv caches weakly: one whose owner drops it unclosed (an exception left it
    active) is closed at the manager's next call, its pages freed, and shutdown does not refuse."""
    m = manager()

    def run_and_fail() -> None:
        kv = m.create_kv_cache(id="lost")
        assert kv.resume() and kv.resize(16)
        raise RuntimeError("the step failed")

    kept = m.create_kv_cache(id="kept")
    assert kept.resume() and kept.resize(8)
    used = m.allocator(0).num_used
    gc.disable()                  # reference counting alone drops it: no collector pass needed
    try:
        with pytest.raises(RuntimeError, match="the step failed"):
            run_and_fail()
    finally:
        gc.enable()
    assert m.allocator(0).num_used > used                   # not closed at the drop itself...
    again = m.create_kv_cache(id="lost")                    # ...but at the manager's next entry
    assert m.allocator(0).num_used == used
    assert sorted(c.id for c in m.open_caches) == ["kept", "lost"]
    with pytest.raises(ManagerBusyError, match="2 KV cache"):
        m.shutdown()                                        # held caches stay open
    kept.close()
    again.close()
    m.shutdown()
