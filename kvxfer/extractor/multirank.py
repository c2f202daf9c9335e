"""Transfer plans between tensor-parallel rank sets: several ranks (one layout each) on each side.

A process that holds several ranks registers every rank's regions with one transport, in rank order
(``all_regions``); a rank's own region indices are then shifted by the regions of the ranks before it
(``region_offsets``). ``plan_between`` pairs every (source rank, destination rank) with
``plan_transfer`` and returns one plan in those concatenated region indices: what the prefill and
decode workers send, and what an integrator moving KV between rank sets of its own engines needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.cache.descriptors import CacheLayoutDesc
from kvxfer.cache.memory import MemoryRegion
from kvxfer.errors import KvxferError
from kvxfer.extractor.block_ids import BlockIds
from kvxfer.extractor.blocks import TemplateCache, plan_templated
from kvxfer.extractor.pairing import plan_transfer
from kvxfer.extractor.regions import layout_regions
from kvxfer.pagetable import BlockPlan, PageTable, TransferPlan
from kvxfer.pagetable.phased import PhasedPlan


def region_offsets(layouts: Sequence[CacheLayoutDesc]) -> list[int]:
    """Index of each rank's first region in the concatenation of every rank's regions."""
    counts = [sum(len(pg.pools) for pg in lay.pool_groups) for lay in layouts]
    return [int(x) for x in np.cumsum([0, *counts[:-1]])]


def all_regions(layouts: Sequence[CacheLayoutDesc]) -> list[MemoryRegion]:
    """Every rank's regions in rank order: what a worker's transport registers and advertises."""
    return [r for lay in layouts for r in layout_regions(lay)]


def _shift(table: PageTable, offset: int) -> PageTable:
    return PageTable(table.addr, table.nbytes, table.region + np.uint32(offset))


def plan_between(src_layouts: Sequence[CacheLayoutDesc], src_ids: Sequence[BlockIds | Any],
                 dst_layouts: Sequence[CacheLayoutDesc], dst_ids: Sequence[BlockIds | Any], *,
                 token_range: tuple[int, int], layers: Sequence[int] | None = None,
                 dst_committed: Sequence[int | None] | None = None,
                 templates: TemplateCache | None = None) -> TransferPlan:
    """One plan moving ``token_range`` of ``layers`` from every source rank to every destination rank.

    ``src_ids[i]`` / ``dst_ids[j]`` are the block ids (a ``KVCache`` or its ``block_id_map()``) of the
    request on source rank ``i`` / destination rank ``j``. Pairs each (source rank, destination rank)
    with ``plan_transfer`` (heads move where both hold them, so a rank pair whose head ranges do not
    meet adds nothing); region indices are those of the concatenated rank regions on each side
    (``all_regions``). ``dst_committed[j]`` (default: from a KVCache destination) makes rank ``j``'s
    committed blocks read-only (``plan_transfer`` refuses to write them).

    ``templates``: a rank pair whose layouts differ (tokens per block, head split, head order) is planned
    with ``plan_templated`` (same runs, same checks and errors, its run templates kept there: a worker
    keeps one cache per peer), its BlockPlans expanded with array arithmetic instead of pairing every
    segment; None: ``plan_transfer`` pairs every rank pair.
    """
    src_off, dst_off = region_offsets(src_layouts), region_offsets(dst_layouts)
    committed = [None] * len(dst_layouts) if dst_committed is None else list(dst_committed)
    plans: list[TransferPlan] = []
    for i, (sl, si) in enumerate(zip(src_layouts, src_ids, strict=True)):
        for j, (dl, di, dc) in enumerate(zip(dst_layouts, dst_ids, committed, strict=True)):
            plan = _templated(sl, si, dl, di, layers, token_range, dc, templates) \
                if templates is not None and sl.fingerprint != dl.fingerprint else None
            if plan is None:
                plan = plan_transfer(sl, si, dl, di, layers=layers, token_range=token_range, dst_committed=dc)
            if len(plan):
                plans.append(TransferPlan(_shift(plan.src, src_off[i]), _shift(plan.dst, dst_off[j])))
    if not plans:
        return TransferPlan.empty()
    return plans[0] if len(plans) == 1 else TransferPlan.concat(plans)


def warm_templates(src_layouts: Sequence[CacheLayoutDesc], dst_layouts: Sequence[CacheLayoutDesc],
                   templates: TemplateCache) -> int:
    """Make in ``templates`` the run templates of every rank pair of differing layouts for the segments of
    whole transfers (those of one common period of both block grids, every layer: each starts where a grid
    is cut), so a request planned with them pays no template of its own, only one probe for a prompt that
    ends at a new place inside a block. A worker calls it when it learns a peer's layouts. Returns how
    many templates it made; a pair that cannot be planned so (several layer groups, too few slots for one
    period, layouts that do not pair) is left to the requests, which report why."""
    made = 0
    for sl in src_layouts:
        for dl in dst_layouts:
            if sl.fingerprint == dl.fingerprint or len(sl.layer_groups) != 1 or len(dl.layer_groups) != 1:
                continue
            ts, td = sl.tokens_per_block, dl.tokens_per_block
            period = ts * td // math.gcd(ts, td)
            gs, gd = sl.layer_groups[0], dl.layer_groups[0]
            if period // ts > sl.pool_groups[gs.pool_group_index].num_slots or \
                    period // td > dl.pool_groups[gd.pool_group_index].num_slots:
                continue
            before = len(templates)
            try:
                plan_templated(sl, {gs.layer_group_id: np.arange(period // ts)}, dl,
                               {gd.layer_group_id: np.arange(period // td)}, token_range=(0, period),
                               templates=templates)
            except KvxferError:
                continue
            made += len(templates) - before
    return made


def plan_phased(src_layouts: Sequence[CacheLayoutDesc], src_ids: Sequence[BlockIds | Any],
                dst_layouts: Sequence[CacheLayoutDesc], dst_ids: Sequence[BlockIds | Any], *,
                token_range: tuple[int, int], layers: Sequence[int] | None = None,
                dst_committed: Sequence[int | None] | None = None,
                templates: TemplateCache | None = None) -> PhasedPlan:
    """``plan_between``'s plan without its expansion: every rank pair's BlockPlans (``plan_templated``'s
    phases where the layouts differ and ``templates`` is given), region-shifted, and a pair planned by
    ``plan_transfer`` as one block of its runs; ``expand()`` lists exactly ``plan_between``'s runs, in its
    order. O(blocks + template runs) for the templated pairs, however finely the layouts cut the bytes."""
    src_off, dst_off = region_offsets(src_layouts), region_offsets(dst_layouts)
    committed = [None] * len(dst_layouts) if dst_committed is None else list(dst_committed)
    phases: list[BlockPlan] = []
    for i, (sl, si) in enumerate(zip(src_layouts, src_ids, strict=True)):
        for j, (dl, di, dc) in enumerate(zip(dst_layouts, dst_ids, committed, strict=True)):
            templated = plan_templated(sl, si, dl, di, layers=layers, token_range=token_range, dst_committed=dc,
                                       templates=templates) \
                if templates is not None and sl.fingerprint != dl.fingerprint else None
            if templated is not None:
                phases += [p.shift_regions(src_off[i], dst_off[j]) for p in templated if len(p)]
                continue
            plan = plan_transfer(sl, si, dl, di, layers=layers, token_range=token_range, dst_committed=dc)
            if len(plan):
                phases.append(_one_block(plan).shift_regions(src_off[i], dst_off[j]))
    return PhasedPlan(tuple(phases))


def _one_block(plan: TransferPlan) -> BlockPlan:
    """A TransferPlan as a BlockPlan of one block (slot 0, step 0): its runs as the template."""
    step = np.zeros(len(plan), np.uint64)
    slot = np.zeros(1, np.uint64)
    return BlockPlan(slot, slot, step, plan.src.addr, step, plan.dst.addr, plan.src.nbytes, plan.src.region,
                     plan.dst.region)


def _templated(src: CacheLayoutDesc, src_ids: Any, dst: CacheLayoutDesc, dst_ids: Any, layers: Sequence[int] | None,
               token_range: tuple[int, int], committed: int | None, templates: TemplateCache) -> TransferPlan | None:
    """``plan_transfer``'s plan of one rank pair through ``plan_templated``, or None where it has none."""
    phases = plan_templated(src, src_ids, dst, dst_ids, layers=layers, token_range=token_range,
                            dst_committed=committed, templates=templates)
    if phases is None:
        return None
    plans = [p.expand() for p in phases if len(p)]
    if not plans:
        return TransferPlan.empty()
    return plans[0] if len(plans) == 1 else TransferPlan.concat(plans)
