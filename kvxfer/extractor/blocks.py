"""plan_blocks(): the plan of ``plan_transfer`` as a BlockPlan (one run template + slot pairs), when it
repeats per block pair.

It does when both layouts hold one layer group with the same tokens per block and every token segment
is a whole block on both sides: then block pair (s, d) moves the runs of pair (0, 0) shifted by
``s x`` (source slot stride) and ``d x`` (destination slot stride), run by run. The template is taken
from ``plan_transfer`` itself on single block pairs (0 -> 0 gives the offsets, 1 -> 1 the strides) and
checked on a third pair (the last slots), so it cannot drift from what ``plan_transfer`` pairs; it is
computed once per (layouts, layers) and kept. Anything else (sliding-window layer groups, other tokens per
block, a range that cuts a block) gives None: use ``plan_transfer``.

plan_templated(): any two one-layer-group layouts, whatever their tokens per block, head split and head
order, as a few BlockPlans, one per *phase*: the token segments of a transfer (the pieces lying in one
block on each side) repeat a handful of shapes (source token offset, destination token offset, length;
two for 32 -> 64 or 32 -> 16 tokens per block, one when the block sizes agree), and all segments of one
shape move the same runs shifted by their slots. Each phase is a run template (derived from
``plan_transfer`` on one segment and checked on two more, as above, kept per layout pair) and its
segments' slot pairs, so the plan is O(blocks + template runs) however finely the layouts cut the bytes
(a segment shorter than the widest from its offsets, where a prompt ends inside a block, takes its template
from one probe whose runs lie inside the widest segment's runs, and their strides):
planning the 70B / 128k-token case takes a few milliseconds where the expanded plan lists up to 167
million runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.errors import ConfigError
from kvxfer.extractor.block_ids import BlockIds, block_id_map, check_distinct
from kvxfer.extractor.compat import paired_layers
from kvxfer.extractor.pairing import plan_transfer
from kvxfer.extractor.tokens import Segments, check_token_range, refuse_read_only, token_segments
from kvxfer.extractor.writable import committed_tokens, lacking_range
from kvxfer.pagetable import BlockPlan, TransferPlan

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
#: (src_step, src_offset, dst_step, dst_offset, nbytes, src_region, dst_region) of one layout pair.
Template = tuple[U64, U64, U64, U64, U64, U32, U32]

_TEMPLATES_KEPT = 64


class TemplateCache:
    """Run templates of layout pairs, the least recently used dropped past ``kept``: keyed by the two
    layout objects (each entry holds them, so their ids are not reused while it is kept), the layers and
    the segment shape. A worker keeps one per peer (its layouts x the peer's), so that one peer's pairs do
    not push another's out; the functions below share a module-wide one when given none."""

    def __init__(self, kept: int = _TEMPLATES_KEPT) -> None:
        if not isinstance(kept, int) or kept < 1:
            raise ConfigError(f"TemplateCache: kept must be a positive int, got {kept!r}")
        self.kept = kept
        self.entries: OrderedDict[tuple[int, int, tuple[int, ...]],
                                  tuple[CacheLayoutDesc, CacheLayoutDesc, Template | None]] = OrderedDict()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc, key: tuple[int, ...],
            make: Callable[[], Template | None]) -> Template | None:
        """The template kept for (``src_layout``, ``dst_layout``, ``key``), made by ``make`` when missing."""
        full = (id(src_layout), id(dst_layout), key)
        with self.lock:
            hit = self.entries.get(full)
            if hit is not None and hit[0] is src_layout and hit[1] is dst_layout:
                self.entries.move_to_end(full)
                return hit[2]
        template = make()
        with self.lock:
            self.entries[full] = (src_layout, dst_layout, template)
            while len(self.entries) > self.kept:
                self.entries.popitem(last=False)
        return template

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


_shared = TemplateCache()
_templates, _templates_lock = _shared.entries, _shared.lock


def plan_blocks(src_layout: CacheLayoutDesc, src_block_ids: BlockIds | Any, dst_layout: CacheLayoutDesc,
                dst_block_ids: BlockIds | Any, *, layers: Iterable[int] | None = None,
                token_range: tuple[int, int] | None = None, dst_committed: int | None = None) -> BlockPlan | None:
    """The runs ``plan_transfer`` (same arguments, same checks and errors) would move, as a BlockPlan
    in block order, or None when they do not repeat per block pair (see the module docstring)."""
    tpb = src_layout.tokens_per_block
    if dst_layout.tokens_per_block != tpb or len(src_layout.layer_groups) != 1 or len(dst_layout.layer_groups) != 1:
        return None
    layer_ids, segs = _segments(src_layout, src_block_ids, dst_layout, dst_block_ids, layers, token_range,
                                dst_committed)
    if not bool((segs.length == tpb).all()):
        return None
    template = block_template(src_layout, dst_layout, layer_ids)
    if template is None:
        return None
    return BlockPlan(segs.src_slot.astype(np.uint64), segs.dst_slot.astype(np.uint64), *template)


def plan_templated(src_layout: CacheLayoutDesc, src_block_ids: BlockIds | Any, dst_layout: CacheLayoutDesc,
                   dst_block_ids: BlockIds | Any, *, layers: Iterable[int] | None = None,
                   token_range: tuple[int, int] | None = None,
                   dst_committed: int | None = None, templates: TemplateCache | None = None) -> list[BlockPlan] | None:
    """The runs ``plan_transfer`` (same arguments, same checks and errors) would move, as one BlockPlan
    per segment shape (see the module docstring), in the order of each shape's first segment; None when
    a layout holds several layer groups or a shape's runs are not affine in the slots (use
    ``plan_transfer``). ``templates``: where the layout pair's templates are kept (default: the module's
    cache)."""
    if len(src_layout.layer_groups) != 1 or len(dst_layout.layer_groups) != 1:
        return None
    layer_ids, segs = _segments(src_layout, src_block_ids, dst_layout, dst_block_ids, layers, token_range,
                                dst_committed)
    if not len(segs):
        return []
    # One key per segment shape: (source offset, destination offset, length), each below 2**20 tokens.
    key = (segs.src_tok << 42) | (segs.dst_tok << 21) | segs.length
    shapes, first, which = np.unique(key, return_index=True, return_inverse=True)
    plans: list[tuple[int, BlockPlan]] = []
    for k in range(shapes.size):
        i = int(first[k])
        shape = (int(segs.src_tok[i]), int(segs.dst_tok[i]), int(segs.length[i]))
        template = segment_template(src_layout, dst_layout, layer_ids, shape, templates)
        if template is None:
            return None
        mine = which == k
        plans.append((i, BlockPlan(segs.src_slot[mine].astype(np.uint64), segs.dst_slot[mine].astype(np.uint64),
                                   *template)))
    return [bp for _, bp in sorted(plans, key=lambda item: item[0])]


def _segments(src_layout: CacheLayoutDesc, src_block_ids: BlockIds | Any, dst_layout: CacheLayoutDesc,
              dst_block_ids: BlockIds | Any, layers: Iterable[int] | None, token_range: tuple[int, int] | None,
              dst_committed: int | None) -> tuple[tuple[int, ...], Segments]:
    """The paired layers and the token segments of a transfer between two one-layer-group layouts, with
    ``plan_transfer``'s checks (token range, distinct destination blocks, no write into a committed page)."""
    ts, td = src_layout.tokens_per_block, dst_layout.tokens_per_block
    tr = check_token_range(token_range)
    committed = committed_tokens(dst_block_ids, dst_committed)
    if tr is None:
        tr = lacking_range(dst_block_ids, dst_committed)
    layer_ids = tuple(paired_layers(src_layout, dst_layout, layers))
    gs, gd = src_layout.layer_groups[0].layer_group_id, dst_layout.layer_groups[0].layer_group_id
    src_ids = block_id_map(src_layout, src_block_ids, [gs], "source")[gs]
    dst_ids = block_id_map(dst_layout, dst_block_ids, [gd], "destination")
    check_distinct(dst_layout, dst_ids, "destination")
    segs = token_segments(src_ids, ts, dst_ids[gd], td, tr)
    refuse_read_only(segs, gd, committed // td * td, td)
    return layer_ids, segs


def segment_template(src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc, layers: tuple[int, ...],
                     shape: tuple[int, int, int], templates: TemplateCache | None = None) -> Template | None:
    """The run template of the segments of ``shape`` (source token offset, destination token offset,
    length) between two one-layer-group layouts (kept in ``templates``, else in the module's cache of the
    last 64 (layout pair, layers, shape)), or None when ``plan_transfer``'s runs for such a segment are not
    affine in its slots."""
    cache = _shared if templates is None else templates
    src_tok, dst_tok, length = shape
    widest = min(src_layout.tokens_per_block - src_tok, dst_layout.tokens_per_block - dst_tok)

    def make() -> Template | None:
        # A segment shorter than the widest from its offsets (a prompt's last one, ending inside a block) moves
        # a part of that widest segment's runs: one probe, placed inside them, instead of three.
        if length < widest:
            wider = segment_template(src_layout, dst_layout, layers, (src_tok, dst_tok, widest), cache)
            if wider is not None:
                within = _derive_within(wider, src_layout, dst_layout, layers, shape)
                if within is not None:
                    return within
        return _derive(src_layout, dst_layout, layers, shape)
    return cache.get(src_layout, dst_layout, (*layers, -1, *shape), make)


def block_template(src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc, layers: tuple[int, ...]) -> Template | None:
    """The per-block-pair run template of two one-layer-group layouts (kept for the last 64 pairs of
    layout objects), or None when ``plan_transfer``'s runs are not affine in the slot ids."""
    return _shared.get(src_layout, dst_layout, layers, lambda: _derive(src_layout, dst_layout, layers))


def _probe(src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc, layers: tuple[int, ...],
           shape: tuple[int, int, int], s: int, d: int) -> TransferPlan:
    """``plan_transfer`` of one segment of ``shape`` from source slot ``s`` to destination slot ``d``."""
    gs, gd = src_layout.layer_groups[0].layer_group_id, dst_layout.layer_groups[0].layer_group_id
    ts, td = src_layout.tokens_per_block, dst_layout.tokens_per_block
    src_tok, dst_tok, length = shape
    # A token position with those offsets inside its blocks: src_tok + ts * i == dst_tok + td * j.
    start = next(src_tok + ts * i for i in range(td + 1) if (src_tok + ts * i - dst_tok) % td == 0)
    sb, db = start // ts, start // td
    sids, dids = np.full(sb + 1, -1, np.int64), np.full(db + 1, -1, np.int64)
    sids[sb], dids[db] = s, d
    return plan_transfer(src_layout, {gs: sids}, dst_layout, {gd: dids}, layers=layers,
                         token_range=(start, start + length), dst_committed=0)


def _derive_within(wider: Template, src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc,
                   layers: tuple[int, ...], shape: tuple[int, int, int]) -> Template | None:
    """The template of ``shape`` from its one probe at slots (0, 0), each run placed inside a run of
    ``wider`` (the template of a longer segment from the same offsets): its bytes at the same distance
    from that run's start on both sides, in the same regions, so it moves with that run's strides. None
    when a run is not inside one (``_derive`` then probes three pairs)."""
    first = _probe(src_layout, dst_layout, layers, shape, 0, 0)
    if not len(first):
        return _empty_template()
    w_src_step, w_src, w_dst_step, w_dst, w_n, w_sreg, w_dreg = wider
    if not w_n.size:
        return None
    order = np.argsort(w_dst, kind="stable")       # destination runs never overlap: one holds each byte
    k = order[np.maximum(np.searchsorted(w_dst[order], first.dst.addr, side="right") - 1, 0)]
    d_in = first.dst.addr.astype(np.int64) - w_dst[k].astype(np.int64)
    s_in = first.src.addr.astype(np.int64) - w_src[k].astype(np.int64)
    inside = ((d_in >= 0) & (d_in == s_in) & (d_in + first.src.nbytes.astype(np.int64) <= w_n[k].astype(np.int64))
              & (first.src.region == w_sreg[k]) & (first.dst.region == w_dreg[k]))
    if not bool(inside.all()):
        return None
    return (w_src_step[k], first.src.addr, w_dst_step[k], first.dst.addr, first.src.nbytes, first.src.region,
            first.dst.region)


def _empty_template() -> Template:
    e64 = np.empty(0, np.uint64)
    return e64, e64, e64, e64, e64, np.empty(0, np.uint32), np.empty(0, np.uint32)


def _derive(src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc, layers: tuple[int, ...],
            shape: tuple[int, int, int] | None = None) -> Template | None:
    """The template of one segment shape (None: a whole block on both sides of equal block sizes), from
    ``plan_transfer`` on single segments of that shape: slot pair (0, 0) gives the offsets, (1, 1) the
    strides, and the last slots check them."""
    slots_s = src_layout.pool_groups[src_layout.layer_groups[0].pool_group_index].num_slots
    slots_d = dst_layout.pool_groups[dst_layout.layer_groups[0].pool_group_index].num_slots
    full = shape if shape is not None else (0, 0, src_layout.tokens_per_block)

    def probe(s: int, d: int) -> TransferPlan:
        return _probe(src_layout, dst_layout, layers, full, s, d)

    first = probe(0, 0)
    if not len(first):   # nothing in common (disjoint heads): an empty template
        return _empty_template()
    one_s, one_d = min(1, slots_s - 1), min(1, slots_d - 1)
    second = probe(one_s, one_d) if (one_s, one_d) != (0, 0) else first
    if not _same_runs(first, second):
        return None
    # Strides: the second pair's addresses minus the first's (0 on a side with one slot).
    src_step = (second.src.addr.astype(np.int64) - first.src.addr.astype(np.int64)) if one_s else np.zeros(len(first), np.int64)
    dst_step = (second.dst.addr.astype(np.int64) - first.dst.addr.astype(np.int64)) if one_d else np.zeros(len(first), np.int64)
    if bool((src_step < 0).any()) or bool((dst_step < 0).any()):
        return None
    template: Template = (src_step.astype(np.uint64), first.src.addr, dst_step.astype(np.uint64), first.dst.addr,
                          first.src.nbytes, first.src.region, first.dst.region)
    last_s, last_d = slots_s - 1, slots_d - 1
    if (last_s, last_d) not in ((0, 0), (one_s, one_d)):
        third = probe(last_s, last_d)
        if not _same_runs(first, third) or \
                not np.array_equal(third.src.addr, np.uint64(last_s) * template[0] + template[1]) or \
                not np.array_equal(third.dst.addr, np.uint64(last_d) * template[2] + template[3]):
            return None
    return template


def _same_runs(a: TransferPlan, b: TransferPlan) -> bool:
    """The two single-pair plans list runs of the same lengths in the same regions, in the same order."""
    return (len(a) == len(b) and np.array_equal(a.src.nbytes, b.src.nbytes)
            and np.array_equal(a.src.region, b.src.region) and np.array_equal(a.dst.region, b.dst.region))
