"""extract(): a request's block ids + a published layout -> the PageTable of its bytes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.errors import PageTableError
from kvxfer.extractor.block_ids import BlockIds, block_id_map
from kvxfer.extractor.regions import layout_roles, region_indices
from kvxfer.extractor.selection import select_buffers
from kvxfer.pagetable import PageTable

I64 = npt.NDArray[np.int64]

#: Coordinates of every extracted entry. Whole-slot entries cover every buffer of their slot and carry
#: -1 in ``layer``, ``role``, ``head_start`` and ``num_heads``; ``role`` indexes ``layout_roles(layout)``.
COORDS = ("layer_group", "block", "slot", "layer", "role", "buffers", "token_start", "num_tokens",
          "head_start", "num_heads")


def extract(layout: CacheLayoutDesc, block_ids: BlockIds | Any, *, layers: Iterable[int] | None = None,
            roles: Iterable[str] | None = None, first_block: int = 0) -> PageTable:
    """The bytes of the selected (layer, role) buffers of blocks ``first_block..`` of a request.

    ``block_ids`` maps layer group id -> slot ids (or is a KVCache); -1 entries (sliding-window gaps)
    are skipped. When every buffer of a slot is selected, one entry covers the whole slot. Entries go
    layer group, pool, block, buffer-in-slot; the result is not coalesced (coords stay exact).
    """
    if isinstance(first_block, bool) or not isinstance(first_block, int | np.integer) or first_block < 0:
        raise PageTableError(f"extract: first_block must be an int >= 0, got {first_block!r}")
    chosen = select_buffers(layout, layers, roles)
    groups = sorted({layout.layer_group_of(b.layer_id).layer_group_id for b in chosen})
    ids = block_id_map(layout, block_ids, groups, "extract")
    role_code = {r: i for i, r in enumerate(layout_roles(layout))}
    formats = dict(layout.formats)
    regions = region_indices(layout)
    tpb = layout.tokens_per_block
    parts: list[PageTable] = []
    for g in groups:
        blocks = ids[g][int(first_block):]
        valid = np.flatnonzero(blocks >= 0)
        logical = valid + int(first_block)
        slots = blocks[valid]
        pg = layout.pool_groups[layout.layer_groups[g].pool_group_index]
        variant = pg.slot_desc.variant_of(g)
        for pool, cb in zip(pg.pools, variant.coalesced_buffers, strict=True):
            per, single, section = cb.num_buffers, cb.single_buffer_size, cb.buffer_ids
            picked = [i for i, b in enumerate(section) if b in chosen]
            if not picked:
                continue
            if len(picked) == per:
                offsets, sizes = np.zeros(1, np.uint64), np.full(1, pool.slot_bytes, np.uint64)
                per_buffer = np.array([[-1, -1, per, -1, -1]], dtype=np.int64)
            else:
                bufs = [section[i] for i in picked]
                offsets = np.array([i * single for i in picked], dtype=np.uint64)
                sizes = np.full(len(picked), single, np.uint64)
                per_buffer = np.array([[b.layer_id, role_code[b.role], 1, formats[b].head_start,
                                        formats[b].num_heads] for b in bufs], dtype=np.int64)
            c = offsets.size
            addr = (np.uint64(pool.base_address) + slots.astype(np.uint64)[:, None] * np.uint64(pool.slot_bytes)
                    + offsets[None, :]).ravel()
            block = np.repeat(logical, c)
            cols = np.tile(per_buffer, (slots.size, 1))
            coords = {"layer_group": np.full(addr.size, g, np.int64), "block": block,
                      "slot": np.repeat(slots, c), "layer": cols[:, 0], "role": cols[:, 1], "buffers": cols[:, 2],
                      "token_start": block * tpb, "num_tokens": np.full(addr.size, tpb, np.int64),
                      "head_start": cols[:, 3], "num_heads": cols[:, 4]}
            parts.append(PageTable(addr, np.tile(sizes, slots.size),
                                   np.full(addr.size, regions[pg.pool_group_index][pool.pool_index], np.uint32),
                                   coords))
    if not parts:
        return PageTable(np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.uint32),
                         {name: np.empty(0, np.int64) for name in COORDS})
    return PageTable.concat(parts)
