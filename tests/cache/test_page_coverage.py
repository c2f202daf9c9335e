"""Pages that hold fewer tokens than their block (recorded token counts) in a ``KVCacheManagerConfig``
manager's prefix tree.

A request ending inside a block leaves a tail block. A later request continuing those tokens enters the
whole block, which takes the tail's place; the tail's pages move into it where its own hold fewer tokens
(a sliding window's page released before the commit), each keeping the count of tokens it holds, so the
shorter endpoint stays reusable. A tail whose tokens a sibling already begins with gives that sibling its
wider pages instead. A match stops where a page it needs holds fewer tokens than the match reaches.

TPB tokens per block; layer 0 full attention, layer 1 a sliding window of WINDOW tokens.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

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
    _introspection,
)
from kvxfer.cache.common import AttnLifeCycle
from kvxfer.cache.events import Removed

TPB = 8
WINDOW = 4


def manager(*, window: int = WINDOW, backoff: int = 0) -> KVCacheManager:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(0), [BufferConfig(DataRole("key"), 256), BufferConfig(DataRole("value"), 256)]),
        AttentionLayerConfig(LayerId(1), [BufferConfig(DataRole("key"), 256), BufferConfig(DataRole("value"), 256)],
                             sliding_window_size=window)]
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(1 << 20)],
                                               layers=layers, enable_partial_reuse=True, commit_min_snapshot=True,
                                               reuse_match_backoff=backoff))


def groups(mgr: KVCacheManager) -> tuple[int, int]:
    """(the full-attention layer group, the sliding-window one)."""
    swa = _introspection.swa_life_cycle_ids(mgr)[0]
    full = next(lg for lg in _introspection.attention_life_cycle_ids(mgr) if lg != swa)
    return full, swa


def turn(mgr: KVCacheManager, prompt: list[int]) -> int:
    """Reuse what the tree has, compute the rest (the window's stale pages go first), commit, close."""
    kv = mgr.create_kv_cache(None, prompt)
    reused = kv.num_committed_tokens
    assert kv.resume()
    assert kv.resize(len(prompt), len(prompt))
    kv.commit(prompt[reused:])
    kv.close()
    return reused


def coverage(mgr: KVCacheManager, prompt: list[int], lg: int) -> int:
    """Tokens held by layer group ``lg``'s page of the last block ``prompt`` matches (0: none)."""
    _, pages = _introspection.reuse_match_pages(mgr, ReuseScope(), prompt, lg, True)
    assert pages
    return 0 if pages[-1] is None else int(pages[-1][1] or 0)


BASE = list(range(2 * TPB + WINDOW))                       # 2 full blocks and 4 tokens of block 2
EXTENDED = BASE + list(range(1000, 1000 + 20))             # 5 full blocks
REWIND = [*BASE, 2000]


def test_a_longer_block_takes_the_tail_blocks_place_and_its_window_page() -> None:
    mgr = manager()
    full, swa = groups(mgr)
    assert turn(mgr, BASE) == 0
    mgr.drain_events()
    assert turn(mgr, EXTENDED) == len(BASE)
    assert any(isinstance(e, Removed) and e.layer_groups is None for e in mgr.drain_events())   # the tail left
    # block 2 is now the full block: its own full-attention page, the tail's window page (4 tokens)
    assert coverage(mgr, REWIND, full) == TPB
    assert coverage(mgr, REWIND, swa) == len(BASE) % TPB
    assert mgr.probe_reuse(input_tokens=REWIND) == len(BASE)
    # the partial window page is stale at the longer endpoint: it does not shorten that match
    assert mgr.probe_reuse(input_tokens=EXTENDED) == len(EXTENDED)


def test_a_tail_gives_a_longer_sibling_the_pages_it_lacks() -> None:
    mgr = manager()
    full, swa = groups(mgr)
    assert turn(mgr, EXTENDED) == 0
    assert mgr.probe_reuse(input_tokens=REWIND) == 0        # no window page where BASE ends
    assert turn(mgr, BASE) == 0
    assert coverage(mgr, REWIND, swa) == len(BASE) % TPB     # attached to the full sibling
    assert coverage(mgr, REWIND, full) == TPB                # its own page holds more: kept
    assert mgr.probe_reuse(input_tokens=REWIND) == len(BASE)


def test_a_block_keeps_only_its_widest_page() -> None:
    mgr = manager()
    _, swa = groups(mgr)
    longer = [*BASE, 1000, 1001]
    turn(mgr, BASE)
    assert coverage(mgr, REWIND, swa) == 4
    assert turn(mgr, longer) == len(BASE)
    assert coverage(mgr, REWIND, swa) == 6                   # supersedes the 4-token page, covers it too
    assert mgr.probe_reuse(input_tokens=REWIND) == len(BASE)
    assert mgr.probe_reuse(input_tokens=[*longer, 2000]) == len(longer)
    assert turn(mgr, BASE) == len(BASE)                      # a narrower page does not replace it
    assert coverage(mgr, REWIND, swa) == 6


def test_a_stale_partial_page_does_not_limit_an_exact_block_boundary() -> None:
    mgr = manager(window=1)
    full, swa = groups(mgr)
    boundary = [*BASE, 1000, 1001, 1002, 1003]               # 3 full blocks
    assert turn(mgr, BASE) == 0
    assert turn(mgr, boundary) == len(BASE)
    assert (coverage(mgr, boundary, full), coverage(mgr, boundary, swa)) == (TPB, 4)
    assert mgr.probe_reuse(input_tokens=boundary) == len(boundary)   # a 1-token window needs no old block


def test_a_partial_page_the_backed_off_endpoint_needs_shortens_the_match() -> None:
    mgr = manager(window=TPB + 1, backoff=1)
    base = list(range(TPB + 4))
    boundary = base + list(range(1000, 1000 + 2 * TPB - 4))  # 3 full blocks
    _, swa = groups(mgr)
    assert turn(mgr, base) == 0
    turn(mgr, boundary)
    assert coverage(mgr, base, swa) == 4
    # backed off by one token the window reaches into block 1, whose page holds 4 of its 8 tokens
    assert mgr.probe_reuse(input_tokens=boundary) == len(base)
    assert turn(mgr, boundary) == len(base)


def test_a_replaced_page_is_no_longer_tied_to_its_block() -> None:
    mgr = manager()
    first, second = BASE, [*BASE, 1000, 1001]
    kv1 = mgr.create_kv_cache(None, first)
    assert kv1.resume() and kv1.resize(len(first), len(first))
    kv1.commit(first, is_end=True)
    attn = _introspection.attention_life_cycle_ids(mgr)
    assert [_introspection.committed_page_is_linked(kv1, 2, lg) for lg in attn] == [True, True]
    assert _introspection.committed_page_is_linked(kv1, 3, attn[0]) is None     # nothing committed there
    kv2 = mgr.create_kv_cache(None, second)
    assert kv2.num_committed_tokens == len(first)
    assert kv2.resume() and kv2.resize(len(second), len(second))
    kv2.commit(second[len(first):], is_end=True)
    kv2.close()
    try:
        # the wider block took block 2's place: kv1 still holds its pages, as private ones
        assert [_introspection.committed_page_is_linked(kv1, 2, lg) for lg in attn] == [False, False]
        assert _introspection.committed_page_is_linked(kv1, 1, attn[0]) is True
        turn(mgr, EXTENDED)
        assert [_introspection.committed_page_is_linked(kv1, 2, lg) for lg in attn] == [False, False]
    finally:
        kv1.close()
    assert mgr.probe_reuse(input_tokens=EXTENDED) == len(EXTENDED)


def test_a_planned_drop_refuses_an_endpoint_a_page_no_longer_covers() -> None:
    mgr = manager(window=TPB)
    _, swa = groups(mgr)
    prompt = list(range(3 * TPB))
    kv = mgr.create_kv_cache(None, prompt)
    assert kv.resume() and kv.resize(len(prompt))
    kv.commit(prompt)
    kv.stop_committing()
    last = next(n for n in mgr.prefix_tree.nodes() if n.depth == 2)
    assert last.page_coverage(swa) == TPB
    last.coverage[swa] -= 1
    try:
        assert kv.plan_committed_block_drop() is None
    finally:
        last.coverage[swa] += 1
    handle = kv.plan_committed_block_drop()
    kv.close()
    assert handle is not None
    handle.drop()
    assert mgr.probe_reuse(input_tokens=prompt) < len(prompt)


def test_the_life_cycle_registry_is_a_part_of_the_manager() -> None:
    mgr = manager()
    registry = mgr.life_cycle_registry
    assert registry.size == 2
    windows = {lg: lc.window_size for lg, lc in registry.attention_life_cycles() if isinstance(lc, AttnLifeCycle)}
    assert windows == {lg: (WINDOW if lg == groups(mgr)[1] else None) for lg in range(2)}
    reference_name: Any = mgr._life_cycles
    assert [lc for _, lc in reference_name.items()] == [lc for _, lc in registry.items()]
    assert registry.ssm_life_cycle_id is None


def _pages(mgr: KVCacheManager, kv: Any, layer: int, role: DataRole) -> tuple[int, int, list[int]]:
    """(pool base address, page stride, the kv cache's page of each block) of one layer's buffer."""
    mode = PageIndexMode.SHARED if kv.supports_index_mode(PageIndexMode.SHARED) else PageIndexMode.PER_LAYER
    lg = mgr.get_layer_group_id(LayerId(layer))
    convert = mgr.get_page_index_converter(LayerId(layer), role)
    pages = convert(kv.get_base_page_indices(lg, 0), mode, kv.get_scratch_desc(lg))
    return mgr.get_mem_pool_base_address(LayerId(layer), role, mode), mgr.get_page_stride(LayerId(layer), role), \
        list(pages)


def _value(layer: int, role: int, token: int, position: int) -> np.ndarray:
    return np.full(TOKEN_BYTES // 4, (layer * 7 + role * 3 + 1) * 1_000_003 + token * 131 + position, np.int32)


TOKEN_BYTES = 256 // TPB
ROLES = (DataRole("key"), DataRole("value"))


def _write(mgr: KVCacheManager, kv: Any, tokens: list[int], start: int) -> None:
    """Each token's value of each layer and role at its position, through the published addresses."""
    for layer in (0, 1):
        for r, role in enumerate(ROLES):
            pool, stride, pages = _pages(mgr, kv, layer, role)
            for i, token in enumerate(tokens):
                at = pool + stride * pages[(start + i) // TPB] + TOKEN_BYTES * ((start + i) % TPB)
                ctypes.memmove(at, _value(layer, r, token, start + i).ctypes.data, TOKEN_BYTES)


def _wrong(mgr: KVCacheManager, kv: Any, history: list[int]) -> list[tuple[int, int, int]]:
    """(layer, role, position) of every history value the kv cache's pages do not hold (the window's only
    for the sliding-window layer)."""
    out = []
    for layer in (0, 1):
        first = 0 if layer == 0 else max(0, len(history) + 1 - WINDOW)
        for r, role in enumerate(ROLES):
            pool, stride, pages = _pages(mgr, kv, layer, role)
            for pos in range(first, len(history)):
                got = np.empty(TOKEN_BYTES // 4, np.int32)
                if pages[pos // TPB] == BAD_PAGE_INDEX:
                    out.append((layer, r, pos))
                    continue
                ctypes.memmove(got.ctypes.data, pool + stride * pages[pos // TPB] + TOKEN_BYTES * (pos % TPB), TOKEN_BYTES)
                if not np.array_equal(got, _value(layer, r, history[pos], pos)):
                    out.append((layer, r, pos))
    return out


def test_the_tail_endpoint_reused_through_a_longer_block_holds_what_was_written() -> None:
    """A prompt ending inside a block is computed (its values written by position), a longer one through
    that block is committed without writing, and a rewind to the first prompt's end reuses it: every
    reused value of both layer groups (the window's for the sliding one) is the one written first."""
    mgr = manager()

    def turn_with_values(prompt: list[int], compute: bool) -> tuple[int, list[tuple[int, int, int]]]:
        kv = mgr.create_kv_cache(None, prompt)
        reused = kv.num_committed_tokens
        assert kv.resume()
        assert kv.resize(len(prompt), reused if compute else len(prompt))
        wrong = _wrong(mgr, kv, prompt[:reused]) if compute else []
        if compute:
            _write(mgr, kv, prompt[reused:], reused)
        kv.commit(prompt[reused:])
        kv.close()
        return reused, wrong

    assert turn_with_values(BASE, True) == (0, [])
    assert turn_with_values(EXTENDED, False)[0] == len(BASE)
    rewind = [*BASE, *range(3000, 3000 + TPB)]
    assert turn_with_values(rewind, True) == (len(BASE), [])
