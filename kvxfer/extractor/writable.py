"""Read-only destination pages: no transfer writes a page its destination shares.

A destination's committed blocks are read-only and may be shared with its prefix tree (docs/reuse.md,
"Writers"): a block before ``num_committed_tokens // tokens_per_block`` of a KVCache. A recomputed
prefix is not bit-identical, so writing one would silently change KV other requests use. These helpers
let the side that knows its committed tokens keep plans out of those pages: ``writable_block_ids``
hides them from a peer that plans (they become -1: no page), ``check_writable`` refuses a page table
that reaches into one, naming the block and slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.errors import BlockIdError, ReadOnlyPageError
from kvxfer.extractor.block_ids import BlockIds, block_id_map
from kvxfer.extractor.regions import region_indices
from kvxfer.extractor.tokens import MAX_TOKEN
from kvxfer.pagetable import PageTable, PhasedPlan

I64 = npt.NDArray[np.int64]


@runtime_checkable
class HasCommittedTokens(Protocol):
    """A destination that knows how many of its tokens are final and how many it can hold: a KVCache."""

    @property
    def num_committed_tokens(self) -> int: ...

    @property
    def capacity(self) -> int: ...


def committed_tokens(block_ids: BlockIds | Any, committed: int | None = None) -> int:
    """``committed`` when given, else a KVCache's ``num_committed_tokens``, else 0 (nothing read-only)."""
    if committed is None:
        committed = block_ids.num_committed_tokens if isinstance(block_ids, HasCommittedTokens) else 0
    if isinstance(committed, bool) or not isinstance(committed, int | np.integer) or committed < 0:
        raise BlockIdError(f"committed tokens must be an int >= 0, got {committed!r}")
    return int(committed)


def lacking_range(block_ids: BlockIds | Any, committed: int | None = None) -> tuple[int, int] | None:
    """The tokens a destination lacks: [committed, capacity) of a KVCache, [committed, ...) when only
    ``committed`` is known, None (no limit) when neither is."""
    done = committed_tokens(block_ids, committed)
    if isinstance(block_ids, HasCommittedTokens):
        return done, max(done, int(block_ids.capacity))
    return (done, MAX_TOKEN) if done else None


def writable_block_ids(layout: CacheLayoutDesc, block_ids: BlockIds | Any,
                       committed: int | None = None) -> dict[int, I64]:
    """The block ids of every layer group with the read-only blocks (before ``committed //
    tokens_per_block``) replaced by -1, so a peer planning writes from them cannot name those pages."""
    ids = block_id_map(layout, block_ids, range(len(layout.layer_groups)), "destination")
    n = committed_tokens(block_ids, committed) // layout.tokens_per_block
    for arr in ids.values():
        arr[:n] = -1
    return ids


def check_writable(table: PageTable, layouts: Sequence[CacheLayoutDesc], block_ids: Sequence[BlockIds | Any],
                   committed: Sequence[int | None] | None = None) -> None:
    """Raise ReadOnlyPageError when an entry of ``table`` (regions numbered over every rank's pools in
    rank order, as a worker registers them) overlaps a read-only page of ``block_ids[rank]``."""
    if len(layouts) != len(block_ids):
        raise BlockIdError(f"check_writable: {len(layouts)} layouts for {len(block_ids)} block-id maps")
    limits = [None] * len(layouts) if committed is None else list(committed)
    starts: list[I64] = []
    ends: list[I64] = []
    region: list[I64] = []
    label: list[I64] = []   # rank, layer group, block, slot
    offset = 0
    for rank, (layout, ids_in, limit) in enumerate(zip(layouts, block_ids, limits, strict=True)):
        n = committed_tokens(ids_in, limit) // layout.tokens_per_block
        ids = block_id_map(layout, ids_in, range(len(layout.layer_groups)), "destination")
        regions = region_indices(layout)
        for g, arr in ids.items():
            head = arr[:n]
            blocks = np.flatnonzero(head >= 0)
            slots = head[blocks]
            pg = layout.pool_groups[layout.layer_groups[g].pool_group_index]
            for pool in pg.pools:
                first = pool.base_address + slots * pool.slot_bytes
                starts.append(first)
                ends.append(first + pool.slot_bytes)
                region.append(np.full(slots.size, offset + regions[pg.pool_group_index][pool.pool_index], np.int64))
                label.append(np.stack([np.full(slots.size, rank), np.full(slots.size, g), blocks, slots], axis=1))
        offset += sum(len(pg.pools) for pg in layout.pool_groups)
    if not starts or not len(table):
        return
    lo, hi, reg = np.concatenate(starts), np.concatenate(ends), np.concatenate(region)
    labels = np.concatenate(label)
    if not lo.size:
        return
    addr = table.addr.astype(np.int64)
    stop = addr + table.nbytes.astype(np.int64)
    # Ranges of one region never overlap (distinct slots), so both their starts and ends ascend: the first
    # range ending after an entry's start overlaps it if it starts before the entry's end.
    order = np.lexsort((lo, reg))
    lo, hi, reg, labels = lo[order], hi[order], reg[order], labels[order]
    bad = np.zeros(len(table), bool)
    hit = np.full(len(table), -1, np.int64)
    for r in np.unique(reg).tolist():
        sel = np.flatnonzero(reg == r)
        entries = np.flatnonzero(table.region.astype(np.int64) == r)
        if not entries.size:
            continue
        cand = np.searchsorted(hi[sel], addr[entries], side="right")
        ok = cand < sel.size
        over = np.zeros(entries.size, bool)
        over[ok] = lo[sel][cand[ok]] < stop[entries][ok]
        bad[entries[over]] = True
        hit[entries[over]] = sel[cand[over]]
    if bad.any():
        i = int(np.argmax(bad))
        rank, g, block, slot = labels[hit[i]].tolist()
        raise ReadOnlyPageError(
            f"destination entry {i} ({int(table.addr[i]):#x}, {int(table.nbytes[i])} bytes, region "
            f"{int(table.region[i])}) writes rank {rank} layer group {g} block {block} (slot {slot}), a committed "
            f"page the destination may share with its prefix tree; {int(bad.sum())} entries do")


def check_writable_phased(plan: PhasedPlan, layouts: Sequence[CacheLayoutDesc], block_ids: Sequence[BlockIds | Any],
                          committed: Sequence[int | None] | None = None) -> None:
    """``check_writable`` on a PhasedPlan's destination without its expansion where its template allows: a
    template run that lies inside one slot of its pool (its step the pool's slot size) writes, in block b,
    the pool's slot ``dst_slots[b] + k`` for a k of its own, so the check is whether those slots meet the
    read-only ones (O(blocks x distinct k + read-only blocks)). A phase with another run shape is checked
    through its expansion. ReadOnlyPageError names the phase, block, template run and the page."""
    if len(layouts) != len(block_ids):
        raise BlockIdError(f"check_writable: {len(layouts)} layouts for {len(block_ids)} block-id maps")
    limits = [None] * len(layouts) if committed is None else list(committed)
    # Per region (pools of every rank, in rank order): base, slot size, read-only slots and their labels.
    pools: list[tuple[int, int]] = []
    ro: dict[int, tuple[I64, I64]] = {}   # region -> (slots, labels as rows of rank, group, block, slot)
    for rank, (layout, ids_in, limit) in enumerate(zip(layouts, block_ids, limits, strict=True)):
        offset = len(pools)
        pools += [(pool.base_address, pool.slot_bytes) for pg in layout.pool_groups for pool in pg.pools]
        n = committed_tokens(ids_in, limit) // layout.tokens_per_block
        ids = block_id_map(layout, ids_in, range(len(layout.layer_groups)), "destination")
        regions = region_indices(layout)
        for g, arr in ids.items():
            blocks = np.flatnonzero(arr[:n] >= 0)
            slots = arr[:n][blocks].astype(np.int64)
            pg = layout.layer_groups[g].pool_group_index
            label = np.stack([np.full(slots.size, rank), np.full(slots.size, g), blocks, slots], axis=1)
            for r in regions[pg]:
                old = ro.get(offset + r)
                ro[offset + r] = (slots, label) if old is None else (np.concatenate([old[0], slots]),
                                                                     np.concatenate([old[1], label]))
    if not ro:
        return
    for i, phase in enumerate(plan.phases):
        live = np.flatnonzero(phase.nbytes > 0)
        if not live.size:
            continue
        region = phase.dst_region[live].astype(np.int64)
        if int(region.max()) >= len(pools):
            raise BlockIdError(f"check_writable: phase {i} writes region {int(region.max())}, the layouts have "
                               f"{len(pools)}")
        base = np.array([pools[r][0] for r in region.tolist()], np.int64)
        size = np.array([pools[r][1] for r in region.tolist()], np.int64)
        rel = phase.dst_offset[live].astype(np.int64) - base
        k, within = np.divmod(rel, size)
        if not bool((phase.dst_step[live].astype(np.int64) == size).all()) or \
                bool((within + phase.nbytes[live].astype(np.int64) > size).any()):
            try:
                check_writable(phase.expand().dst, layouts, block_ids, committed)
            except ReadOnlyPageError as exc:
                raise ReadOnlyPageError(f"phase {i}: {exc}") from None
            continue
        slots = phase.dst_slots.astype(np.int64)
        for r, kk in sorted({(int(a), int(b)) for a, b in zip(region.tolist(), k.tolist(), strict=True)}):
            if r not in ro:
                continue
            ro_slots, labels = ro[r]
            hit = np.isin(slots + kk, ro_slots)
            if hit.any():
                b = int(np.argmax(hit))
                t = int(live[int(np.argmax((region == r) & (k == kk)))])
                rank, g, block, slot = labels[int(np.argmax(ro_slots == slots[b] + kk))].tolist()
                raise ReadOnlyPageError(
                    f"phase {i} block {b} template run {t} writes rank {rank} layer group {g} block {block} (slot "
                    f"{slot}), a committed page the destination may share with its prefix tree; "
                    f"{int(hit.sum())} blocks of that run do")
