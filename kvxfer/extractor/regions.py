"""Memory regions and buffer placements derived from a published CacheLayoutDesc alone.

Region index convention: pools in flat (pool group, pool) order, the same order as
``KVCacheManager.memory_regions()``, so a peer can validate a table against what the other side
advertised without asking it anything.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvxfer.cache.descriptors import BufferFormat, BufferId, CacheLayoutDesc
from kvxfer.memory_region import MemoryRegion


def layout_regions(layout: CacheLayoutDesc) -> list[MemoryRegion]:
    """One MemoryRegion per pool of ``layout``, in flat (pool group, pool) order."""
    return [MemoryRegion(pool.base_address, pool.nbytes, pool.memory_kind, pool.device_id)
            for pg in layout.pool_groups for pool in pg.pools]


def region_indices(layout: CacheLayoutDesc) -> list[list[int]]:
    """``out[pool_group][pool]``: the region index of that pool."""
    out: list[list[int]] = []
    nxt = 0
    for pg in layout.pool_groups:
        out.append(list(range(nxt, nxt + len(pg.pools))))
        nxt += len(pg.pools)
    return out


def layout_roles(layout: CacheLayoutDesc) -> tuple[str, ...]:
    """The role names of ``layout``, sorted: the ``role`` coordinate of a table is an index into this."""
    return tuple(sorted({bid.role for bid, _ in layout.formats}))


@dataclass(frozen=True)
class Placement:
    """Where one (layer, role) buffer lives: block ``b``'s bytes start at ``base + b * slot_bytes``."""

    buffer_id: BufferId
    layer_group: int
    pool_group: int
    pool: int
    region: int
    base: int
    offset: int
    slot_bytes: int
    fmt: BufferFormat


_RECENT: dict[int, tuple[CacheLayoutDesc, dict[BufferId, Placement]]] = {}
_RECENT_MAX = 32
_RECENT_LOCK = threading.Lock()   # engine threads of several workers in one process plan at once


def placements(layout: CacheLayoutDesc) -> dict[BufferId, Placement]:
    """The placement of every buffer of ``layout`` (one pass over its slots; the last few layouts'
    results are remembered, since a worker plans against the same two layouts all the time). Safe to
    call from several threads: the memo is read and updated under a lock, the work is done outside it."""
    with _RECENT_LOCK:
        hit = _RECENT.get(id(layout))
    if hit is not None and hit[0] is layout:
        return dict(hit[1])
    out = _placements(layout)
    with _RECENT_LOCK:
        while len(_RECENT) >= _RECENT_MAX:
            _RECENT.pop(next(iter(_RECENT)))
        _RECENT[id(layout)] = (layout, out)
    return dict(out)


def _placements(layout: CacheLayoutDesc) -> dict[BufferId, Placement]:
    """Compute ``placements(layout)``."""
    formats = dict(layout.formats)
    regions = region_indices(layout)
    out: dict[BufferId, Placement] = {}
    for pg in layout.pool_groups:
        for variant in pg.slot_desc.variants:
            for span in variant.buffer_spans():
                pool = pg.pools[span.pool_index]
                bid = span.buffer_id
                out[bid] = Placement(bid, variant.layer_group_id, pg.pool_group_index, pool.pool_index,
                                     regions[pg.pool_group_index][pool.pool_index],
                                     pool.base_address + span.offset, span.offset, pool.slot_bytes, formats[bid])
    return out
