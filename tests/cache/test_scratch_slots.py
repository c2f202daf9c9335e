"""Sliding-window scratch slots shared by the layers of a layer group: how many slots a step takes,
which blocks they stand in for as history and capacity move, where each layer's scratch pages are,
and the per-request switch."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from kvxfer.cache import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    PageIndexMode,
    ReuseScope,
    SwaScratchReuseConfig,
    _introspection,
)
from kvxfer.cache.descriptors import BufferId, CoalescedBuffer, SlotDescVariant
from kvxfer.cache.scratch import layer_pages_per_block, scratch_range, scratch_share, scratch_slots_needed
from kvxfer.errors import ConfigError, ScratchInUseError

TPB = 4
WINDOW = 4
KEY, VALUE = DataRole("key"), DataRole("value")


def manager(num_layers: int = 4, *, window: int | None = WINDOW, rewind: int = 0, value_size: int = 64,
            quota: int = 1 << 20) -> KVCacheManager:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(i), [BufferConfig(KEY, 64), BufferConfig(VALUE, value_size)], window)
        for i in range(num_layers)]
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(quota)], layers=layers,
        swa_scratch_reuse=SwaScratchReuseConfig(max_rewind_len=rewind)))


# --- the pure rules -----------------------------------------------------------------------------------------
def _brute_range(window: int, sink: int, history: int, capacity: int, rewind: int) -> tuple[int, int]:
    """By definition: blocks of the step no token attends to once the kept tokens are history."""
    kept = max(0, capacity - rewind)
    sink_blocks = -(-sink // TPB)
    step = range(-(-history // TPB), -(-capacity // TPB))
    stale = [b for b in step if b >= sink_blocks and (b + 1) * TPB <= kept + 1 - window]
    return (stale[0], stale[-1] + 1) if stale else (0, 0)


@pytest.mark.parametrize("window", [1, 4, 5, 9])
@pytest.mark.parametrize("sink", [0, 3, 8])
@pytest.mark.parametrize("rewind", [0, 2, 7])
def test_scratch_range_is_the_steps_blocks_out_of_the_window(window: int, sink: int, rewind: int) -> None:
    for history in range(0, 30, 3):
        for capacity in range(history, 40, 5):
            got = scratch_range(window, sink, history, capacity, TPB, rewind)
            assert (got.beg, got.end) == _brute_range(window, sink, history, capacity, rewind) or \
                (not got and _brute_range(window, sink, history, capacity, rewind) == (0, 0))
    assert not scratch_range(None, 0, 0, 100, TPB, 0)


def test_one_layers_share_of_a_slot() -> None:
    ids = [BufferId(layer, role) for layer in range(4) for role in ("key", "value")]
    coalesced = SlotDescVariant(0, (CoalescedBuffer(64, tuple(ids)),))
    assert scratch_share(coalesced) == Fraction(1, 4)
    assert layer_pages_per_block(coalesced, ids[3]) == 2
    split = SlotDescVariant(0, (CoalescedBuffer(64, tuple(ids[::2])), CoalescedBuffer(32, tuple(ids[1::2]))))
    assert scratch_share(split) == Fraction(1, 4) and layer_pages_per_block(split, ids[1]) == 1
    assert [scratch_slots_needed(n, Fraction(1, 4)) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]


# --- slots a step takes -------------------------------------------------------------------------------------
def test_the_layers_of_a_group_share_scratch_slots() -> None:
    mgr = manager(4)
    free = mgr.num_free_slots(0)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(32, 0)            # 8 blocks; at 32 tokens block 7 alone is in the window
    desc = kv.get_scratch_desc(0)
    assert desc is not None and (desc.range.beg, desc.range.end) == (0, 7)
    assert len(desc.slot_ids) == math.ceil(7 / 4)      # a slot holds one block of each of 4 layers
    pages = list(kv.get_base_page_indices(0))
    assert pages[:7] == [BAD_PAGE_INDEX] * 7 and pages[7] != BAD_PAGE_INDEX
    assert free - mgr.num_free_slots(0) == 1 + 2
    assert not kv.supports_index_mode(PageIndexMode.SHARED) and kv.supports_index_mode(PageIndexMode.PER_LAYER)
    kv.close()
    assert mgr.num_free_slots(0) == free


def test_each_layers_scratch_pages_are_distinct_and_inside_the_scratch_slots() -> None:
    mgr = manager(3, value_size=64)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(40, 0)            # 10 blocks, 0..8 scratch: ceil(9 / 3) = 3 slots
    desc = kv.get_scratch_desc(0)
    assert desc is not None and len(desc.slot_ids) == 3
    indices = kv.get_base_page_indices(0)
    slot_bytes = mgr.pool_group_descs[0].pools[0].slot_bytes
    for layer in range(3):
        seen: set[int] = set()
        for role in (KEY, VALUE):
            base = mgr.get_mem_pool_base_address(LayerId(layer), role, PageIndexMode.PER_LAYER)
            stride = mgr.get_page_stride(LayerId(layer), role)
            pages = mgr.get_page_index_converter(LayerId(layer), role)(indices, PageIndexMode.PER_LAYER, desc)
            for ordinal in range(desc.range.beg, desc.range.end):
                addr = base + stride * pages[ordinal]
                assert any(base + s * slot_bytes <= addr < base + (s + 1) * slot_bytes for s in desc.slot_ids)
                assert addr not in seen, f"layer {layer} block {ordinal} {role} overlaps another scratch page"
                seen.add(addr)
            own = base + indices[9] * slot_bytes                   # block 9 stays in its own slot
            assert own <= base + stride * pages[9] < own + slot_bytes
    with pytest.raises(ConfigError, match="index_mode must be given"):
        mgr.get_page_index_converter(LayerId(0), KEY)(indices, None, desc)
    with pytest.raises(ConfigError, match="index_mode must be given"):
        mgr.get_mem_pool_base_address(LayerId(0), KEY)
    kv.close()


def test_the_scratch_range_follows_history_and_capacity() -> None:
    mgr = manager(2)
    free = mgr.num_free_slots(0)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(32, 0)
    kv.commit(list(range(32)))                         # history 32 = capacity: no block of the step left
    assert kv.get_scratch_desc(0) is None and not kv.has_scratch_slots
    assert kv.resize(44, 32)                           # step [32, 44): blocks 8..10, 8 and 9 out by 44
    desc = kv.get_scratch_desc(0)
    assert desc is not None and (desc.range.beg, desc.range.end) == (8, 10) and len(desc.slot_ids) == 1
    assert list(kv.get_base_page_indices(0))[8:10] == [BAD_PAGE_INDEX] * 2
    kv.suspend()                                       # a suspended request holds no scratch slot
    assert not kv.has_scratch_slots
    assert kv.resume()                                 # the step still needs them
    again = kv.get_scratch_desc(0)
    assert again is not None and again.range == desc.range and len(again.slot_ids) == 1
    kv.history_length = 40                             # step [40, 44): block 10 only, in the window
    assert kv.get_scratch_desc(0) is None and not kv.has_scratch_slots
    kv.close()
    mgr.clear_reusable_blocks()                        # the tree kept block 7's page
    assert mgr.num_free_slots(0) == free


def test_the_rewind_tail_and_full_attention_take_no_scratch() -> None:
    kv = manager(2, rewind=8).create_kv_cache()
    assert kv.resume() and kv.resize(32, 0)            # out of the window at 24 tokens: blocks 0..5
    desc = kv.get_scratch_desc(0)
    assert desc is not None and (desc.range.beg, desc.range.end) == (0, 5)
    kv.close()
    full = manager(2, window=None).create_kv_cache()
    assert full.resume() and full.resize(32, 0) and full.get_scratch_desc(0) is None
    full.close()


# --- the per-request switch ---------------------------------------------------------------------------------
def test_the_switch_is_refused_while_the_step_needs_scratch() -> None:
    mgr = manager(2)
    kv = mgr.create_kv_cache()
    assert kv.enable_swa_scratch_reuse and kv.resume() and kv.resize(32, 0)
    with pytest.raises(ScratchInUseError, match="scratch blocks are needed"):
        kv.enable_swa_scratch_reuse = False
    with pytest.raises(ConfigError, match="resize"):
        kv.capacity = 40                               # the range depends on history: resize() only
    kv.commit(list(range(32)))
    kv.enable_swa_scratch_reuse = False
    kv.capacity = 40                                   # without scratch: every block of the step gets a page
    assert BAD_PAGE_INDEX not in list(kv.get_base_page_indices(0))[8:]
    with pytest.raises(ScratchInUseError, match="cannot enable"):
        kv.enable_swa_scratch_reuse = True             # the step [32, 40) would have scratch blocks
    kv.history_length = 40
    kv.enable_swa_scratch_reuse = True
    kv.close()


def test_an_exact_tail_block_matches_without_partial_matching() -> None:
    mgr = manager(1, window=8)
    kv = mgr.create_kv_cache()
    tokens = list(range(31))                           # 7 full blocks and a tail of 3 tokens
    assert kv.resume() and kv.resize(31, 0)
    kv.commit(tokens)
    kv.close()                                         # the tail enters the tree
    lg = _introspection.swa_life_cycle_ids(mgr)[0]
    num, pages = _introspection.reuse_match_pages(mgr, ReuseScope(), tokens, lg)
    assert num == 31 and len(pages) == 8
    assert [p is not None for p in pages] == [False] * 6 + [True] * 2   # scratch blocks 0..5 kept no page
    num, _ = _introspection.reuse_match_pages(mgr, ReuseScope(), tokens[:30], lg)
    assert num == 28                                   # 2 of the tail's 3 tokens: a partial match only
