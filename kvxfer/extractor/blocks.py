"""plan_blocks(): the plan of ``plan_transfer`` as a BlockPlan (one run template + slot pairs), when it
repeats per block pair.

It does when both layouts hold one layer group with the same tokens per block and every token segment
is a whole block on both sides: then block pair (s, d) moves the runs of pair (0, 0) shifted by
``s x`` (source slot stride) and ``d x`` (destination slot stride), run by run. The template is taken
from ``plan_transfer`` itself on single block pairs (0 -> 0 gives the offsets, 1 -> 1 the strides) and
checked on a third pair (the last slots), so it cannot drift from what ``plan_transfer`` pairs; it is
computed once per (layouts, layers) and kept. Anything else (sliding-window layer groups, other tokens per
block, a range that cuts a block) gives None: use ``plan_transfer``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.extractor.block_ids import BlockIds, block_id_map, check_distinct
from kvxfer.extractor.compat import paired_layers
from kvxfer.extractor.pairing import plan_transfer
from kvxfer.extractor.tokens import check_token_range, refuse_read_only, token_segments
from kvxfer.extractor.writable import committed_tokens, lacking_range
from kvxfer.pagetable import BlockPlan, TransferPlan

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
#: (src_step, src_offset, dst_step, dst_offset, nbytes, src_region, dst_region) of one layout pair.
Template = tuple[U64, U64, U64, U64, U64, U32, U32]

_TEMPLATES_KEPT = 64
_templates: OrderedDict[tuple[int, int, tuple[int, ...]], tuple[CacheLayoutDesc, CacheLayoutDesc, Template | None]] = \
    OrderedDict()
_templates_lock = threading.Lock()


def plan_blocks(src_layout: CacheLayoutDesc, src_block_ids: BlockIds | Any, dst_layout: CacheLayoutDesc,
                dst_block_ids: BlockIds | Any, *, layers: Iterable[int] | None = None,
                token_range: tuple[int, int] | None = None, dst_committed: int | None = None) -> BlockPlan | None:
    """The runs ``plan_transfer`` (same arguments, same checks and errors) would move, as a BlockPlan
    in block order, or None when they do not repeat per block pair (see the module docstring)."""
    tpb = src_layout.tokens_per_block
    if dst_layout.tokens_per_block != tpb or len(src_layout.layer_groups) != 1 or len(dst_layout.layer_groups) != 1:
        return None
    tr = check_token_range(token_range)
    committed = committed_tokens(dst_block_ids, dst_committed)
    if tr is None:
        tr = lacking_range(dst_block_ids, dst_committed)
    layer_ids = tuple(paired_layers(src_layout, dst_layout, layers))
    gs, gd = src_layout.layer_groups[0].layer_group_id, dst_layout.layer_groups[0].layer_group_id
    src_ids = block_id_map(src_layout, src_block_ids, [gs], "source")[gs]
    dst_ids = block_id_map(dst_layout, dst_block_ids, [gd], "destination")
    check_distinct(dst_layout, dst_ids, "destination")
    segs = token_segments(src_ids, tpb, dst_ids[gd], tpb, tr)
    refuse_read_only(segs, gd, committed // tpb * tpb, tpb)
    if not bool((segs.length == tpb).all()):
        return None
    template = block_template(src_layout, dst_layout, layer_ids)
    if template is None:
        return None
    return BlockPlan(segs.src_slot.astype(np.uint64), segs.dst_slot.astype(np.uint64), *template)


def block_template(src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc, layers: tuple[int, ...]) -> Template | None:
    """The per-block-pair run template of two one-layer-group layouts (kept for the last 64 pairs of
    layout objects), or None when ``plan_transfer``'s runs are not affine in the slot ids."""
    key = (id(src_layout), id(dst_layout), layers)
    with _templates_lock:
        hit = _templates.get(key)
        if hit is not None and hit[0] is src_layout and hit[1] is dst_layout:
            _templates.move_to_end(key)
            return hit[2]
    template = _derive(src_layout, dst_layout, layers)
    with _templates_lock:   # the entry holds the layouts, so their ids are not reused while it is kept
        _templates[key] = (src_layout, dst_layout, template)
        while len(_templates) > _TEMPLATES_KEPT:
            _templates.popitem(last=False)
    return template


def _derive(src_layout: CacheLayoutDesc, dst_layout: CacheLayoutDesc, layers: tuple[int, ...]) -> Template | None:
    gs, gd = src_layout.layer_groups[0].layer_group_id, dst_layout.layer_groups[0].layer_group_id
    slots_s = src_layout.pool_groups[src_layout.layer_groups[0].pool_group_index].num_slots
    slots_d = dst_layout.pool_groups[dst_layout.layer_groups[0].pool_group_index].num_slots
    tpb = src_layout.tokens_per_block

    def probe(s: int, d: int) -> TransferPlan:
        return plan_transfer(src_layout, {gs: np.array([s], np.int64)}, dst_layout, {gd: np.array([d], np.int64)},
                             layers=layers, token_range=(0, tpb), dst_committed=0)

    first = probe(0, 0)
    if not len(first):   # nothing in common (disjoint heads): an empty template
        e64 = np.empty(0, np.uint64)
        return e64, e64, e64, e64, e64, np.empty(0, np.uint32), np.empty(0, np.uint32)
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
