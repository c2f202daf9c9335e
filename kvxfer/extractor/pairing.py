"""plan_transfer(): pair two published layouts by logical coordinates into one TransferPlan.

A (layer, role) buffer holds, per block, a [heads x tokens] grid of rows (one row = head_dim
elements). Both sides are cut into token segments that stay inside one block on each side
(``tokens.token_segments``) and into the head range both hold. Inside a segment each side addresses
row (head h, token t) affinely (HND: head stride tokens_per_block rows, token stride 1 row; NHD:
head stride 1 row, token stride num_heads rows), so the largest pieces contiguous on BOTH sides
follow from the strides: whole [heads x tokens] blocks, one run per head, one run per token, or
single rows (HND against NHD). Runs are computed once per (format pair, segments) and broadcast
over every buffer sharing them. Identical layouts (same fingerprint) move whole coalesced slot
runs instead. Finally entries are ordered by source address and coalesced on both sides.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import BufferFormat, CacheLayoutDesc
from kvxfer.extractor.block_ids import BlockIds, block_id_map, check_distinct
from kvxfer.extractor.compat import buffer_pairs, check_layer_groups, paired_layers
from kvxfer.extractor.regions import Placement, placements, region_indices
from kvxfer.extractor.tokens import Segments, check_token_range, refuse_read_only, token_segments
from kvxfer.extractor.writable import committed_tokens, lacking_range
from kvxfer.pagetable import PageTable, TransferPlan

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
# One batch of entries: src_addr, src_region, dst_addr, dst_region, nbytes.
Entries = tuple[U64, U32, U64, U32, U64]


def plan_transfer(src_layout: CacheLayoutDesc, src_block_ids: BlockIds | Any, dst_layout: CacheLayoutDesc,
                  dst_block_ids: BlockIds | Any, *, layers: Iterable[int] | None = None,
                  token_range: tuple[int, int] | None = None, dst_committed: int | None = None) -> TransferPlan:
    """The plan moving the KV of ``layers`` (default: all) for the tokens both block lists cover (within
    ``token_range`` when given) from the source request's pages to the destination request's pages.

    ``dst_committed`` (default: ``num_committed_tokens`` of a KVCache destination, else 0) is what the
    destination already holds as final: its blocks before ``dst_committed // tokens_per_block`` are
    read-only (they may be shared with its prefix tree), and a range reaching into a read-only block
    raises ReadOnlyPageError naming the layer group, block, slot and tokens. Without ``token_range``
    the plan covers what the destination lacks: [committed, capacity) of a KVCache destination,
    the tokens from ``dst_committed`` on otherwise.
    Heads move where both sides hold them (one plan per source rank when tensor-parallel splits
    differ). Raises LayoutMismatch naming the first incompatible field, BlockIdError for a block id
    outside its pool group (or a destination slot listed twice). The plan is ordered by source
    address and coalesced.
    """
    tr = check_token_range(token_range)
    committed = committed_tokens(dst_block_ids, dst_committed)
    if tr is None:
        tr = lacking_range(dst_block_ids, dst_committed)
    read_only = committed // dst_layout.tokens_per_block * dst_layout.tokens_per_block
    layer_ids = paired_layers(src_layout, dst_layout, layers)
    batches: list[Entries] = []
    if src_layout.fingerprint == dst_layout.fingerprint:
        # Same layer groups, formats and slot structure on both sides: only the layer set matters.
        wanted = set(layer_ids)
        groups = [lg.layer_group_id for lg in src_layout.layer_groups if wanted.intersection(lg.layer_ids)]
        src_ids = block_id_map(src_layout, src_block_ids, groups, "source")
        dst_ids = block_id_map(dst_layout, dst_block_ids, groups, "destination")
        check_distinct(dst_layout, dst_ids, "destination")
        tpb = src_layout.tokens_per_block
        for g in groups:
            segs = token_segments(src_ids[g], tpb, dst_ids[g], tpb, tr)
            refuse_read_only(segs, g, read_only, tpb)
            full = segs.length == tpb
            batches.extend(_whole_buffer_runs(src_layout, dst_layout, g, wanted, segs.take(full)))
            if not full.all():   # a token range cutting blocks: the cut blocks go row by row
                in_group = wanted.intersection(src_layout.layer_groups[g].layer_ids)
                pairs = buffer_pairs(placements(src_layout), placements(dst_layout), in_group)
                batches.extend(_row_runs(pairs, segs.take(~full)))
    else:
        check_layer_groups(src_layout, dst_layout, layer_ids)
        pairs = buffer_pairs(placements(src_layout), placements(dst_layout), layer_ids)
        src_ids = block_id_map(src_layout, src_block_ids, sorted({s.layer_group for s, _ in pairs}), "source")
        dst_ids = block_id_map(dst_layout, dst_block_ids, sorted({d.layer_group for _, d in pairs}), "destination")
        check_distinct(dst_layout, dst_ids, "destination")
        by_group_pair: dict[tuple[int, int], list[tuple[Placement, Placement]]] = {}
        for s, d in pairs:
            by_group_pair.setdefault((s.layer_group, d.layer_group), []).append((s, d))
        for (gs, gd), group_pairs in by_group_pair.items():
            segs = token_segments(src_ids[gs], src_layout.tokens_per_block, dst_ids[gd],
                                  dst_layout.tokens_per_block, tr)
            refuse_read_only(segs, gd, read_only, dst_layout.tokens_per_block)
            if len(segs):
                batches.extend(_row_runs(group_pairs, segs))
    if not batches:
        return TransferPlan.empty()
    batches.sort(key=lambda b: (int(b[1][0]), int(b[0][0])) if b[0].size else (-1, 0))
    if len(batches) == 1:
        src_addr, src_region, dst_addr, dst_region, nbytes = batches[0]
    else:
        src_addr, src_region, dst_addr, dst_region, nbytes = (np.concatenate(c) for c in zip(*batches, strict=True))
    plan = TransferPlan(PageTable(src_addr, nbytes, src_region), PageTable(dst_addr, nbytes, dst_region))
    return plan.sort_by_source().coalesce()


def _whole_buffer_runs(src: CacheLayoutDesc, dst: CacheLayoutDesc, group: int, layer_ids: set[int],
                       segs: Segments) -> list[Entries]:
    """Identical layouts, whole blocks: per pool, each run of consecutive chosen buffers of a slot (the
    whole slot when all are chosen) moves as one entry per block."""
    if not len(segs):
        return []
    src_regions, dst_regions = region_indices(src), region_indices(dst)
    pgi = src.layer_groups[group].pool_group_index
    pg_s, pg_d = src.pool_groups[pgi], dst.pool_groups[pgi]
    out: list[Entries] = []
    variant = pg_s.slot_desc.variant_of(group)
    for p, (pool_s, pool_d, cb) in enumerate(zip(pg_s.pools, pg_d.pools, variant.coalesced_buffers, strict=True)):
        single, section = cb.single_buffer_size, cb.buffer_ids
        picked = np.array([b.layer_id in layer_ids for b in section], dtype=bool)
        if not picked.any():
            continue
        edges = np.diff(np.concatenate([[False], picked, [False]]).astype(np.int8))
        first, stop = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        offsets = (first * single).astype(np.uint64)
        sizes = ((stop - first) * single).astype(np.uint64)
        slot_bytes = np.uint64(pool_s.slot_bytes)
        src_addr = (np.uint64(pool_s.base_address) + segs.src_slot.astype(np.uint64)[:, None] * slot_bytes
                    + offsets[None, :]).ravel()
        dst_addr = (np.uint64(pool_d.base_address) + segs.dst_slot.astype(np.uint64)[:, None] * slot_bytes
                    + offsets[None, :]).ravel()
        n = src_addr.size
        out.append((src_addr, np.full(n, src_regions[pgi][p], np.uint32), dst_addr,
                    np.full(n, dst_regions[pgi][p], np.uint32), np.tile(sizes, len(segs))))
    return out


def _strides(fmt: BufferFormat, row: int) -> tuple[int, int]:
    """(head stride, token stride) in bytes inside one buffer."""
    if fmt.order == "HND":
        return fmt.tokens_per_block * row, row
    return row, fmt.num_heads * row


def _expand(count: I64) -> tuple[I64, I64]:
    """For ``count[s]`` items per segment: (segment of each item, index of the item inside its segment)."""
    seg = np.repeat(np.arange(count.size, dtype=np.int64), count)
    first = np.cumsum(count) - count
    return seg, np.arange(seg.size, dtype=np.int64) - first[seg]


def row_run_template(fs: BufferFormat, fd: BufferFormat, segs: Segments) -> tuple[I64, I64, I64, I64] | None:
    """Runs contiguous on both sides for one format pair: (segment, source byte offset in the buffer,
    destination byte offset in the buffer, bytes) per run, or None when the head ranges do not meet.
    No segment may cross a page of either format (``split_segments``)."""
    h0 = max(fs.head_start, fd.head_start)
    k = min(fs.head_start + fs.num_heads, fd.head_start + fd.num_heads) - h0
    if k <= 0:
        return None
    row = fs.head_dim * fs.itemsize
    sh_s, st_s = _strides(fs, row)
    sh_d, st_d = _strides(fd, row)
    n = segs.length
    # An expanded buffer holds several of its own pages per slot: page p starts at p * fmt.nbytes.
    page_s, tok_s = np.divmod(segs.src_tok, fs.tokens_per_block)
    page_d, tok_d = np.divmod(segs.dst_tok, fd.tokens_per_block)
    base_s = page_s * fs.nbytes + (h0 - fs.head_start) * sh_s + tok_s * st_s
    base_d = page_d * fd.nbytes + (h0 - fd.head_start) * sh_d + tok_d * st_d
    if st_s == row and st_d == row:
        # Tokens contiguous on both sides: one run per head, or one for all heads when the segment
        # is a whole block on both sides (head stride == segment bytes).
        merged = np.asarray((k == 1) | ((n * row == sh_s) & (n * row == sh_d)))
        count = np.where(merged, 1, k).astype(np.int64)
        seg, j = _expand(count)
        return seg, base_s[seg] + j * sh_s, base_d[seg] + j * sh_d, (np.where(merged, k * n, n) * row)[seg]
    if sh_s == row and sh_d == row:
        # Heads contiguous on both sides: one run per token, or one for the segment when the head
        # slice is every head on both sides (token stride == head slice bytes).
        merged = np.asarray((n == 1) | ((st_s == k * row) & (st_d == k * row)))
        count = np.where(merged, 1, n).astype(np.int64)
        seg, j = _expand(count)
        return seg, base_s[seg] + j * st_s, base_d[seg] + j * st_d, (np.where(merged, k * n, k) * row)[seg]
    # Transposed (HND against NHD): every row is its own run, listed in source memory order.
    seg, j = _expand(n * k)
    if fs.order == "HND":
        head, tok = np.divmod(j, n[seg])
    else:
        tok, head = np.divmod(j, k)
    return (seg, base_s[seg] + head * sh_s + tok * st_s, base_d[seg] + head * sh_d + tok * st_d,
            np.full(seg.size, row, np.int64))


def _row_runs(pairs: list[tuple[Placement, Placement]], segs: Segments) -> list[Entries]:
    """Entries of ``pairs`` (buffers of one layer-group pair) over ``segs``, grouped by format pair so
    that each run template is computed once and broadcast over the buffers sharing it."""
    by_format: dict[tuple[BufferFormat, BufferFormat], list[tuple[Placement, Placement]]] = {}
    for s, d in pairs:
        by_format.setdefault((s.fmt, d.fmt), []).append((s, d))
    out: list[Entries] = []
    for (fs, fd), same_format in by_format.items():
        fsegs = split_segments(segs, fs.tokens_per_block, fd.tokens_per_block)
        template = row_run_template(fs, fd, fsegs)
        if template is None:
            continue
        by_region: dict[int, list[tuple[Placement, Placement]]] = {}
        for m in sorted(same_format, key=lambda m: (m[0].region, m[0].base)):
            by_region.setdefault(m[0].region, []).append(m)
        out.extend(_broadcast(template, fsegs, members) for members in by_region.values())
    return out


def split_segments(segs: Segments, src_page: int, dst_page: int) -> Segments:
    """``segs`` cut so that none crosses a page of ``src_page`` source or ``dst_page`` destination
    tokens (expanded buffers: pages smaller than a block). Both divide their layout's tokens_per_block,
    so the cuts are the multiples of either inside a segment; unchanged when nothing crosses."""
    crosses = (segs.src_tok % src_page + segs.length > src_page) | (segs.dst_tok % dst_page + segs.length > dst_page)
    if not crosses.any():
        return segs
    start, end = segs.start, segs.start + segs.length
    positions = [start]
    for unit in {src_page, dst_page}:
        count = np.maximum(0, (end - 1) // unit - start // unit)
        seg, k = _expand(count)
        positions.append((start[seg] // unit + 1 + k) * unit)
    pos = np.unique(np.concatenate(positions))
    seg = np.searchsorted(start, pos, side="right") - 1
    nxt = np.concatenate([pos[1:], [np.iinfo(np.int64).max]])
    length = np.minimum(nxt, end[seg]) - pos
    shift = pos - start[seg]
    return Segments(pos, length, segs.src_slot[seg], segs.src_tok[seg] + shift, segs.dst_slot[seg],
                    segs.dst_tok[seg] + shift)


def _broadcast(template: tuple[I64, I64, I64, I64], segs: Segments,
               members: list[tuple[Placement, Placement]]) -> Entries:
    """The template's runs for every buffer pair of ``members`` (one source region, ascending offsets)."""
    seg, src_rel, dst_rel, length = template
    src_slot = segs.src_slot[seg].astype(np.uint64)
    dst_slot = segs.dst_slot[seg].astype(np.uint64)
    src_base = np.array([s.base for s, _ in members], dtype=np.uint64)[:, None]
    dst_base = np.array([d.base for _, d in members], dtype=np.uint64)[:, None]
    src_step = np.array([s.slot_bytes for s, _ in members], dtype=np.uint64)[:, None]
    dst_step = np.array([d.slot_bytes for _, d in members], dtype=np.uint64)[:, None]
    src_region = np.array([s.region for s, _ in members], dtype=np.uint32)[:, None]
    dst_region = np.array([d.region for _, d in members], dtype=np.uint32)[:, None]
    grid = (len(members), seg.size)
    cols = (src_base + src_slot[None, :] * src_step + src_rel.astype(np.uint64)[None, :],
            np.broadcast_to(src_region, grid),
            dst_base + dst_slot[None, :] * dst_step + dst_rel.astype(np.uint64)[None, :],
            np.broadcast_to(dst_region, grid),
            np.broadcast_to(length.astype(np.uint64)[None, :], grid))
    per_seg = seg.size // len(segs)
    if per_seg * len(segs) == seg.size and np.all(seg == np.arange(seg.size) // per_seg):
        # Every segment has the same number of runs: list segment by segment, then buffer, then
        # run, which is source-memory order whenever the source slots ascend (no sort needed).
        shape = (len(members), len(segs), per_seg)
        flat = [np.ascontiguousarray(c.reshape(shape).transpose(1, 0, 2)).ravel() for c in cols]
    else:
        flat = [np.ascontiguousarray(c).ravel() for c in cols]
    return (flat[0].astype(np.uint64, copy=False), flat[1].astype(np.uint32, copy=False),
            flat[2].astype(np.uint64, copy=False), flat[3].astype(np.uint32, copy=False),
            flat[4].astype(np.uint64, copy=False))
