"""Expanded buffers (the reference design's ExpandedBuffer): a buffer whose own pages hold fewer tokens
than the layout's block, several of them per slot. Layouts are built by hand over numpy memory, the
source is written by logical position (layer, role, token, head, dim) from the buffer format's
definition, the plan is executed with plain memmoves, and every destination element is checked."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.cache import (
    LAYOUT_VERSION,
    BufferFormat,
    BufferId,
    CacheLayoutDesc,
    CoalescedBuffer,
    LayerGroupDesc,
    PoolDesc,
    PoolGroupDesc,
    SlotDesc,
    SlotDescVariant,
)
from kvxfer.errors import LayoutError
from kvxfer.extractor import plan_transfer

I64 = npt.NDArray[np.int64]
ROLES = {"key": 0, "value": 1, "index_key": 2}
SENTINEL = -7
HEADS, DIM = 4, 3


class Side:
    """One hand-built layout (one layer group, one pool per buffer) over numpy pools."""

    def __init__(self, tpb: int, pages: dict[str, int], order: str, heads: tuple[int, int], num_slots: int,
                 layers: int = 2) -> None:
        fmts = {BufferId(layer, role): BufferFormat("int32", DIM, page, heads[0], heads[1], HEADS, order)  # type: ignore[arg-type]
                for layer in range(layers) for role, page in pages.items()}
        cbs = sorted((CoalescedBuffer(f.nbytes * (tpb // f.tokens_per_block), (b,)) for b, f in fmts.items()),
                     key=lambda c: c.size, reverse=True)
        self.arrays = [np.full(c.size * num_slots // 4, SENTINEL, np.int32) for c in cbs]
        pools = tuple(PoolDesc(i, a.ctypes.data, c.size, num_slots, "cpu") for i, (a, c) in enumerate(zip(self.arrays, cbs, strict=True)))
        group = PoolGroupDesc(0, num_slots, SlotDesc((SlotDescVariant(0, tuple(cbs)),)), pools)
        self.layout = CacheLayoutDesc(LAYOUT_VERSION, tpb, (LayerGroupDesc(0, tuple(range(layers)), None, 0, 0),),
                                      (group,), tuple(fmts.items()))

    def cells(self, bid: BufferId, ids: I64, tokens: I64) -> tuple[int, I64, I64, I64, I64]:
        """(pool, int32 index, token, head, dim) of every element of ``bid`` for ``tokens``, from the
        format's definition: page ``t // page_tokens`` of the slot, then HND or NHD inside the page."""
        fmt = self.layout.format_of(bid)
        _, pool, span = self.layout.locate(bid)
        tok, head, dim = (a.ravel() for a in np.meshgrid(tokens, np.arange(fmt.head_start, fmt.head_start + fmt.num_heads),
                                                         np.arange(DIM), indexing="ij"))
        block, in_block = np.divmod(tok, self.layout.tokens_per_block)
        page, t = np.divmod(in_block, fmt.tokens_per_block)
        h = head - fmt.head_start
        elem = (h * fmt.tokens_per_block + t) * DIM + dim if fmt.order == "HND" else (t * fmt.num_heads + h) * DIM + dim
        byte = ids[block] * pool.slot_bytes + span.offset + page * fmt.nbytes + elem * 4
        return pool.pool_index, byte // 4, tok, head, dim


def code(layer: int, role: str, tok: I64, head: I64, dim: I64) -> I64:
    return (((layer * 4 + ROLES[role]) * 1000 + tok) * HEADS + head) * DIM + dim


def run_pair(src: Side, dst: Side, n: int, token_range: tuple[int, int] | None = None) -> None:
    rng = np.random.default_rng(n)
    src_ids = rng.permutation(src.layout.pool_groups[0].num_slots)[:-(-n // src.layout.tokens_per_block)]
    dst_ids = rng.permutation(dst.layout.pool_groups[0].num_slots)[:-(-n // dst.layout.tokens_per_block)]
    tokens = np.arange(n)
    for bid, _ in src.layout.formats:
        pool, idx, tok, head, dim = src.cells(bid, src_ids, tokens)
        src.arrays[pool][idx] = code(bid.layer_id, bid.role, tok, head, dim)
    plan = plan_transfer(src.layout, {0: src_ids}, dst.layout, {0: dst_ids}, token_range=token_range)
    for s, d, k in zip(plan.src.addr.tolist(), plan.dst.addr.tolist(), plan.src.nbytes.tolist(), strict=True):
        ctypes.memmove(d, s, k)
    lo, hi = token_range or (0, n)
    expected = [np.full_like(a, SENTINEL) for a in dst.arrays]
    for bid, _ in dst.layout.formats:
        sfmt = src.layout.format_of(bid)
        pool, idx, tok, head, dim = dst.cells(bid, dst_ids, tokens)
        moved = (tok >= lo) & (tok < hi) & (head >= sfmt.head_start) & (head < sfmt.head_start + sfmt.num_heads)
        expected[pool][idx[moved]] = code(bid.layer_id, bid.role, tok[moved], head[moved], dim[moved])
    for got, want in zip(dst.arrays, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_expansion_is_the_layouts_block_over_the_buffers_page() -> None:
    side = Side(8, {"key": 8, "index_key": 2}, "HND", (0, HEADS), 4)
    assert side.layout.expansion_of(BufferId(1, "index_key")) == 4
    assert side.layout.expansion_of(BufferId(1, "key")) == 1
    (page,) = [p for p in side.layout.aggregated_pages([BufferId(0, "index_key")])]
    assert [(b.id, b.expansion) for b in page.buffers] == [(BufferId(0, "index_key"), 4)]
    assert page.size == 4 * side.layout.format_of(BufferId(0, "index_key")).nbytes


@pytest.mark.parametrize(("src_args", "dst_args", "token_range"), [
    # expanded HND source (2-token pages in 8-token blocks) -> plain NHD destination of 4-token blocks
    ((8, {"key": 8, "index_key": 2}, "HND", (0, 4), 6), (4, {"key": 4, "index_key": 4}, "NHD", (0, 4), 12), None),
    # plain source -> expanded destination (4-token pages in 16-token blocks), TP head slice, cut range
    ((4, {"key": 4, "index_key": 4}, "NHD", (0, 4), 12), (16, {"key": 16, "index_key": 4}, "HND", (2, 2), 4), (3, 37)),
    # expanded on both sides with different page sizes
    ((12, {"key": 12, "index_key": 3}, "NHD", (0, 4), 6), (8, {"key": 8, "index_key": 2}, "HND", (0, 4), 8), (5, 41)),
])
def test_pairs_with_expanded_buffers_are_exact_by_logical_position(
        src_args: tuple[int, dict[str, int], str, tuple[int, int], int],
        dst_args: tuple[int, dict[str, int], str, tuple[int, int], int], token_range: tuple[int, int] | None) -> None:
    run_pair(Side(*src_args), Side(*dst_args), 43, token_range)


def test_a_page_that_does_not_divide_the_block_is_refused() -> None:
    fmt = BufferFormat("int32", DIM, 3, 0, HEADS, HEADS)
    cb = CoalescedBuffer(fmt.nbytes * 2, (BufferId(0, "key"),))
    group = PoolGroupDesc(0, 2, SlotDesc((SlotDescVariant(0, (cb,)),)), (PoolDesc(0, 0, cb.size, 2, "cpu"),))
    with pytest.raises(LayoutError, match="tokens_per_block 3 does not divide the layout's 8"):
        CacheLayoutDesc(LAYOUT_VERSION, 8, (LayerGroupDesc(0, (0,), None, 0, 0),), (group,), ((BufferId(0, "key"), fmt),))
    wrong = CoalescedBuffer(fmt.nbytes, (BufferId(0, "key"),))   # one page where the slot needs two
    group = PoolGroupDesc(0, 2, SlotDesc((SlotDescVariant(0, (wrong,)),)), (PoolDesc(0, 0, wrong.size, 2, "cpu"),))
    with pytest.raises(LayoutError, match="needs 288 bytes per slot"):
        CacheLayoutDesc(LAYOUT_VERSION, 6, (LayerGroupDesc(0, (0,), None, 0, 0),), (group,), ((BufferId(0, "key"), fmt),))
