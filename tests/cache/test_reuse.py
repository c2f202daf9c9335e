"""Prefix reuse through the cache manager: scopes, full and partial reuse checked on page contents,
copy-on-write, duplicates, eviction order, sliding windows, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.cache import AllCleared, CacheState, Created, Removed, ReuseScope, Stored, block_keys
from kvxfer.errors import CapacityError, ConfigError
from tests.support.reuse_support import (
    TPB,
    check_kv,
    check_references,
    make_manager,
    prefill,
    slot_bytes,
    write_kv,
)


def toks(seed: int, n: int, lo: int = 0, hi: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(lo, hi, n)


def test_reuse_is_isolated_by_scope() -> None:
    mgr = make_manager(64)
    p = toks(0, 22)
    scope = ReuseScope.for_tenant("tenant-a", 1)
    prefill(mgr, p, reuse_scope=scope)
    prefill(mgr, np.concatenate([p[:3], toks(1, 9, 1000, 2000)]), reuse_scope=ReuseScope.for_tenant("tenant-a", 2))
    assert mgr.probe_prompt_reuse(p, scope) == 20          # 5 full blocks; 2 tokens of a 6th never entered
    # lora 2 has its own block sharing p's first 3 tokens: only that one is partially reusable there
    for other, expected in ((None, 0), (ReuseScope.for_tenant("tenant-a", 2), 3),
                            (ReuseScope.for_tenant("tenant-b", 1), 0), (ReuseScope.for_tenant("tenant-a"), 0),
                            (ReuseScope(lora_id=1), 0)):
        assert mgr.probe_prompt_reuse(p, other) == expected
        kv = mgr.create_kv_cache_for_prompt(p, reuse_scope=other)
        assert kv.num_reused_tokens == expected and kv.num_blocks == (expected > 0)
        kv.close()
    check_references(mgr)


def test_full_reuse_reads_back_the_written_kv() -> None:
    mgr = make_manager(64)
    p = toks(2, 22)
    first = prefill(mgr, p, close=False)
    ids = first.block_ids(0)
    first.close()
    q = np.concatenate([p[:16], toks(3, 9, 1000, 2000)])
    kv = mgr.create_kv_cache_for_prompt(q)
    assert kv.state is CacheState.SUSPENDED
    assert kv.num_reused_tokens == 16 and kv.num_committed_tokens == 16 and kv.history_length == 16
    np.testing.assert_array_equal(kv.block_ids(0), ids[:4])
    assert check_kv(mgr, kv, q, 0, 16) == 16
    assert kv.resume() and kv.resize(q.size)
    np.testing.assert_array_equal(kv.block_ids(0)[:4], ids[:4])
    assert not np.isin(kv.block_ids(0)[4:], ids[:5]).any()      # fresh, never one of p's tree pages
    write_kv(mgr, kv, q, 16, q.size)
    kv.commit(q[16:])
    check_kv(mgr, kv, q, 0, q.size)
    check_references(mgr)
    kv.close()
    acc = mgr.slot_accounting(0)
    assert (acc.evictable, acc.shared, acc.request_only) == (5 + 2, 0, 0)   # p's 5 blocks + q's 2 new ones


def test_partial_reuse_copies_the_block_before_writing() -> None:
    mgr = make_manager(64)
    p = toks(4, 24)
    ids = prefill(mgr, p, close=False)
    tree_ids = ids.block_ids(0)
    ids.close()
    q = np.concatenate([p[:14], toks(5, 6, 1000, 2000)])   # block 3 = p[12:16] shares 2 tokens
    src = int(tree_ids[3])
    before = slot_bytes(mgr, 0, src)
    kv = mgr.create_kv_cache_for_prompt(q)
    assert kv.num_reused_tokens == 14
    np.testing.assert_array_equal(kv.block_ids(0), tree_ids[:4])    # shared until resume
    assert mgr.allocator(0).refcount[src] == 2
    assert kv.resume()
    copy = int(kv.block_ids(0)[3])
    assert copy != src and mgr.allocator(0).refcount[src] == 1 and mgr.allocator(0).refcount[copy] == 1
    assert slot_bytes(mgr, 0, copy) == before                        # whole slot copied, every pool
    check_kv(mgr, kv, q, 0, 14)
    assert kv.resize(q.size)
    write_kv(mgr, kv, q, 14, q.size)
    kv.commit(q[14:])
    assert slot_bytes(mgr, 0, src) == before                         # the tree's page never written
    check_kv(mgr, kv, q, 0, q.size)
    kv.close()
    again = mgr.create_kv_cache_for_prompt(np.concatenate([p, [7]]))
    assert again.num_reused_tokens == 24
    check_kv(mgr, again, p, 0, 24)
    again.close()
    check_references(mgr)


def test_partial_reuse_can_be_disabled() -> None:
    mgr = make_manager(64, enable_partial_reuse=False)
    p = toks(6, 24)
    prefill(mgr, p)
    q = np.concatenate([p[:14], toks(7, 6, 1000, 2000)])
    assert mgr.probe_prompt_reuse(q) == 12
    assert mgr.probe_prompt_reuse(p) == 20                  # the last token is never reused: block 5 is not taken


def test_the_last_prompt_token_is_always_computed() -> None:
    mgr = make_manager(32)
    p = toks(8, 16)
    prefill(mgr, p)
    kv = mgr.create_kv_cache_for_prompt(p)
    assert kv.num_reused_tokens == 15                # 3 full blocks + 3 tokens of the 4th, copied
    assert kv.resume()
    write_kv(mgr, kv, p, 15, 16)
    kv.commit(p[15:])                                # the block is full again: it adopts the tree's page
    check_kv(mgr, kv, p, 0, 16)
    kv.close()
    check_references(mgr)
    assert mgr.slot_accounting(0).evictable == 4


def test_duplicate_commit_adopts_the_existing_pages() -> None:
    mgr = make_manager(64)
    p = toks(9, 18)
    a, b = mgr.create_kv_cache_for_prompt(p), mgr.create_kv_cache_for_prompt(p)   # neither can reuse: nothing committed yet
    for kv in (a, b):
        assert kv.num_reused_tokens == 0 and kv.resume() and kv.resize(p.size)
        write_kv(mgr, kv, p, 0, p.size)
    a.commit(p)
    assert [type(e) for e in mgr.drain_events()] == [Created, Stored]
    free = mgr.num_free_slots()
    own = b.block_ids(0)
    b.commit(p)
    assert mgr.drain_events() == []
    np.testing.assert_array_equal(b.block_ids(0)[:4], a.block_ids(0)[:4])
    assert b.block_ids(0)[4] == own[4]
    assert mgr.num_free_slots() == free + 4
    assert (mgr.allocator(0).refcount[own[:4]] == 0).all()
    check_kv(mgr, b, p, 0, p.size)
    check_references(mgr)
    a.close()
    b.close()
    acc = mgr.slot_accounting(0)
    assert (acc.free, acc.evictable, acc.shared, acc.request_only) == (60, 4, 0, 0)


@pytest.mark.parametrize("touch_x", [False, True])
def test_eviction_order_priority_then_lru_leaves_first(touch_x: bool) -> None:
    mgr = make_manager(16)
    x, y, z = toks(10, 12, 0, 100), toks(11, 12, 100, 200), toks(12, 12, 200, 300)
    prefill(mgr, x)
    kv = mgr.create_kv_cache_for_prompt(y)
    assert kv.resume() and kv.resize(12)
    write_kv(mgr, kv, y, 0, 12)
    kv.commit(y, priority=80)                        # y outlives older, lower-priority blocks
    kv.close()
    prefill(mgr, z)
    if touch_x:                                      # reusing x makes it more recent than z
        kv = mgr.create_kv_cache_for_prompt(np.concatenate([x, [999]]))
        assert kv.num_reused_tokens == 12
        kv.close()
    mgr.drain_events()
    assert mgr.slot_accounting(0).evictable == 9 and mgr.num_free_slots() == 7
    big = mgr.create_kv_cache()
    assert big.resume() and big.resize(11 * TPB)     # 4 slots must come from eviction
    root = ReuseScope().root_key
    kx, kz = block_keys(x, TPB, root), block_keys(z, TPB, root)
    first, second = (kz, kx) if touch_x else (kx, kz)
    assert mgr.drain_events() == [Removed((first[2], first[1], first[0], second[2]), "CPU")]
    evicted_first, evicted_second = (z, x) if touch_x else (x, z)
    assert mgr.probe_prompt_reuse(np.concatenate([y, [1]])) == 12
    assert mgr.probe_prompt_reuse(np.concatenate([evicted_first, [1]])) == 0
    assert mgr.probe_prompt_reuse(np.concatenate([evicted_second, [1]])) == 8
    big.close()
    check_references(mgr)


def test_eviction_never_frees_a_page_a_request_holds() -> None:
    mgr = make_manager(8)
    p = toks(13, 8)
    prefill(mgr, p)
    holder = mgr.create_kv_cache_for_prompt(np.concatenate([p, [5]]))
    assert holder.num_reused_tokens == 8 and holder.resume()
    big = mgr.create_kv_cache()
    assert big.resume()
    assert not big.resize(7 * TPB)                   # 6 free, 0 evictable: refused, nothing taken
    assert big.num_blocks == 0 and mgr.num_free_slots() == 6
    assert big.resize(6 * TPB)
    write_kv(mgr, big, toks(14, 24, 5000, 6000), 0, 24)
    check_kv(mgr, holder, p, 0, 8)
    check_references(mgr)
    holder.close()
    assert big.resize(8 * TPB)                       # now the two tree pages can go
    assert mgr.prefix_tree.num_blocks == 0
    big.close()
    check_references(mgr)


def test_resume_waits_for_room_to_copy_a_partial_block() -> None:
    mgr = make_manager(6)
    p = toks(15, 8)
    prefill(mgr, p)
    q = np.concatenate([p[:6], [3000, 3001, 3002]])
    kv = mgr.create_kv_cache_for_prompt(q)
    assert kv.num_reused_tokens == 6
    ids = kv.block_ids(0)
    filler = mgr.create_kv_cache()
    assert filler.resume() and filler.resize(4 * TPB)
    assert not kv.resume()
    assert kv.state is CacheState.SUSPENDED
    np.testing.assert_array_equal(kv.block_ids(0), ids)
    filler.close()
    assert kv.resume()
    assert kv.block_ids(0)[1] != ids[1]
    check_kv(mgr, kv, q, 0, 6)
    kv.close()
    check_references(mgr)


def test_sliding_window_reuse_locks_only_window_pages() -> None:
    mgr = make_manager(64, windows=[None, 8])
    assert [lg.pool_group_index for lg in mgr.layout.layer_groups] == [0, 0]   # one shared allocator
    p = toks(16, 24)
    kv = prefill(mgr, p, close=False)
    # history 24: the next token sees 17..24, so window blocks 0..3 went, from the request and the tree
    np.testing.assert_array_equal(kv.block_ids(1)[:4], [-1] * 4)
    tree_swa = [int(n.pages[1]) for n in sorted(mgr.prefix_tree.nodes(), key=lambda n: n.depth)]
    assert tree_swa[:4] == [-1] * 4 and min(tree_swa[4:]) >= 0
    kv.close()
    acc = mgr.slot_accounting(0)
    assert (acc.evictable, acc.request_only, acc.shared) == (6 + 2, 0, 0)
    # a follow-up turn reuses everything: its window pages are there
    q = np.concatenate([p, toks(17, 5, 1000, 2000)])
    kv = mgr.create_kv_cache_for_prompt(q)
    assert kv.num_reused_tokens == 24
    assert (kv.block_ids(0) >= 0).all() and kv.num_blocks == 6
    np.testing.assert_array_equal(kv.block_ids(1) >= 0, [False] * 4 + [True] * 2)
    check_kv(mgr, kv, q, 0, 24)
    acc = mgr.slot_accounting(0)
    assert (acc.shared, acc.evictable, acc.request_only) == (8, 0, 0)
    check_references(mgr)
    kv.close()
    # an earlier cut point would need window pages that are gone: nothing is reused there
    assert mgr.probe_prompt_reuse(np.concatenate([p[:20], toks(18, 5, 1000, 2000)])) == 0


@pytest.mark.parametrize(("sink", "expected"), [(0, 0), (4, 4)])
def test_reuse_stops_where_window_pages_are_gone(sink: int, expected: int) -> None:
    mgr = make_manager(64, windows=[None, 8], sink_tokens=sink)
    full_only = make_manager(64)
    p = toks(18, 32)
    for m in (mgr, full_only):
        kv = m.create_kv_cache_for_prompt(p)
        assert kv.resume() and kv.resize(32)
        write_kv(m, kv, p, 0, 32)
        kv.history_length = 32                       # written before committed: old window pages go
        kv.commit(p)
        kv.close()
    q = np.concatenate([p[:20], toks(19, 5, 1000, 2000)])
    assert full_only.probe_prompt_reuse(q) == 20
    assert mgr.probe_prompt_reuse(q) == expected
    assert mgr.probe_prompt_reuse(np.concatenate([p, [1]])) == 32   # the last window is there
    kv = mgr.create_kv_cache_for_prompt(np.concatenate([p, [1]]))
    np.testing.assert_array_equal(kv.block_ids(1) >= 0, [True] * (sink // TPB) + [False] * (6 - sink // TPB) + [True] * 2)
    check_kv(mgr, kv, p, 0, 32)
    kv.close()
    check_references(mgr)


def test_extra_keys_keep_multimodal_blocks_apart() -> None:
    mgr = make_manager(32)
    p = toks(20, 13)
    prefill(mgr, p, extra_keys={1: b"image-A"})
    assert mgr.probe_prompt_reuse(p, extra_keys={1: b"image-A"}) == 12
    assert mgr.probe_prompt_reuse(p, extra_keys={1: b"image-B"}) == 4   # no partial reuse into a keyed block
    assert mgr.probe_prompt_reuse(p) == 4


def test_reset_prefix_tree_and_shutdown() -> None:
    mgr = make_manager(16)
    p = toks(21, 12)
    prefill(mgr, p)
    holder = mgr.create_kv_cache_for_prompt(p)
    assert not mgr.reset_prefix_tree()
    holder.close()
    mgr.drain_events()
    assert mgr.reset_prefix_tree()
    assert mgr.drain_events() == [AllCleared()]
    assert mgr.num_free_slots() == 16 and mgr.probe_prompt_reuse(p) == 0
    prefill(mgr, p)
    mgr.shutdown()
    assert mgr.drain_events()[-1] == AllCleared()


def test_bad_input_is_refused_without_side_effects() -> None:
    mgr = make_manager(16)
    with pytest.raises(ConfigError, match="reuse_scope must be a ReuseScope"):
        mgr.create_kv_cache_for_prompt([1, 2, 3], reuse_scope="tenant")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="extra_keys must map"):
        mgr.create_kv_cache_for_prompt([1, 2, 3], extra_keys=[b"x"])  # type: ignore[arg-type]
    with pytest.raises(CapacityError, match="token ids must fit uint32"):
        mgr.create_kv_cache_for_prompt([1, 2**32])
    with pytest.raises(CapacityError, match="token ids must fit uint32"):
        mgr.probe_prompt_reuse([-5])
    assert mgr.open_caches == []
    kv = mgr.create_kv_cache()
    kv.resume()
    kv.resize(8)
    with pytest.raises(ConfigError, match=r"priority must be an int in \[0, 100\], got 101"):
        kv.commit([1, 2, 3, 4], priority=101)
    assert kv.num_committed_tokens == 0 and mgr.prefix_tree.num_blocks == 0
    kv.close()
    check_references(mgr)
