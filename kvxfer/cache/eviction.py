"""The eviction controller: which pages may move or be dropped (locked, held, droppable), in what
order (priority, LRU, leaves first), and making room in a tier by offloading one tier down or dropping."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cache.events import Removed, layer_group_subset
from kvxfer.cache.kv_cache import CacheState
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.radix_tree import DEFAULT_PRIORITY, BlockNode
from kvxfer.errors import OutOfSlotsError

IntArray = npt.NDArray[np.int32]

# Victim ordering key: held pages (a suspended request's) after droppable ones, then priority, then LRU.
_HELD_BIT = 60
_PRIORITY_SHIFT = 48
_LAST = (1 << _HELD_BIT) - 1


class EvictionController:
    """Making room in a tier: offload to the tier below, or drop tree-only blocks."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts``, through which this part reaches the others."""
        self.state = state
        self.parts = parts

    def reserve(self, needs: dict[int, int]) -> None:
        """Make sure every pool group has the slots ``needs`` asks for, or raise OutOfSlotsError."""
        for pg, n in needs.items():
            if n > self.state.allocators[pg].num_free:
                self.make_room(pg, n - self.state.allocators[pg].num_free)
            if n > self.state.allocators[pg].num_free:
                raise OutOfSlotsError(f"pool group {pg}: {n} slots needed, {self.state.allocators[pg].num_free} free "
                                      f"of {self.state.allocators[pg].num_slots}")

    def make_room(self, pool_group: int, n: int) -> int:
        """Free ``n`` primary slots of ``pool_group`` (offloading or dropping pages), as far as
        possible; returns the slots freed."""
        return self.make_room_in(0, pool_group, n)

    def tree_only(self, node: BlockNode) -> bool:
        """Whether every page of ``node`` is referenced by the tree alone."""
        for lg, (page, tier) in enumerate(zip(node.pages.tolist(), node.tiers.tolist(), strict=True)):
            if page >= 0 and self.state.alloc_of(tier, self.state.lg_pool_group[lg]).refcount[page] != 1:
                return False
        return True

    def evict_all(self, victims: list[BlockNode], flat_pages: list[int], flat_tiers: list[int]) -> None:
        """Let go of the pages of tree-only blocks just taken out of the tree (in eviction order): one
        reference drop per (tier, pool group), freed slots stacked in the order the blocks went; their
        Removed events (per block, one per medium it had pages on, in layer-group order) put as runs of
        the same medium and layer groups, which the queue merges exactly as it would one by one.
        ``flat_pages`` / ``flat_tiers``: the victims' pages and their tiers, block by block, layer
        groups in order."""
        if not victims:
            return
        n_lg = len(self.state.layout.layer_groups)
        all_pages = np.array(flat_pages, dtype=np.int32)
        all_tiers = np.array(flat_tiers, dtype=np.int64)
        pages, tiers = all_pages.reshape(len(victims), n_lg), all_tiers.reshape(len(victims), n_lg)
        keys = [node.key for node in victims]
        flat_pgs = np.tile(np.asarray(self.state.lg_pool_group, dtype=np.int64), len(victims))
        live = all_pages >= 0
        for tier, pg in sorted({(int(t), int(g)) for t, g in zip(all_tiers[live].tolist(), flat_pgs[live].tolist(),
                                                                   strict=True)}):
            slots = all_pages[live & (all_tiers == tier) & (flat_pgs == pg)]
            owners = self.state.tree_owner[tier][pg]
            for slot in slots.tolist():
                owners.pop(slot, None)
            self.state.alloc_of(tier, pg).decref_each(slots)
            self.state.in_tree_t[tier][pg][slots] = False
        colder = np.flatnonzero(live & (all_tiers > 0)) % n_lg      # layer groups of colder-tier pages
        counts = np.bincount(colder, minlength=n_lg).tolist()
        for lg in dict.fromkeys(colder.tolist()):                      # in the order the blocks reach them
            if (delta := self.state.stats.traffic(lg)) is not None:
                delta.iter_host_dropped_blocks += counts[lg]
                delta.iter_host_dropped_bytes += counts[lg] * self.state.page_bytes[self.state.lg_pool_group[lg]]
        # Blocks with a page in every layer group, all in one tier, make one Removed of that medium.
        uniform = (pages >= 0).all(axis=1) & (tiers == tiers[:, :1]).all(axis=1)
        code = np.where(uniform, tiers[:, 0], -1)
        starts = [0, *(np.flatnonzero((code[1:] != code[:-1]) | (code[1:] < 0)) + 1).tolist()]
        for s, e in zip(starts, [*starts[1:], len(victims)], strict=True):
            if code[s] >= 0:
                self.state.events.put(Removed(tuple(keys[s:e]), self.state.media[int(code[s])]))
                continue
            media = [self.state.media[t] if p >= 0 else None for p, t in zip(pages[s].tolist(), tiers[s].tolist(),
                                                                        strict=True)]
            for medium in dict.fromkeys(m for m in media if m is not None):
                self.state.events.put(Removed((keys[s],), medium, layer_group_subset([m == medium for m in media])))
        self.state.traffic.dropped(len(victims))

    def locked_mask(self, tier: int, pool_group: int) -> npt.NDArray[np.bool_]:
        """Slots of ``tier`` that must not move: pages and scratch slots of ACTIVE requests, and the
        primary pages of a request being resumed (its colder pages may still move down to let a swap through)."""
        mask = np.zeros(self.state.alloc_of(tier, pool_group).num_slots, dtype=bool)
        lgs = self.state.pg_layer_groups[pool_group]
        pinned = self.state.pinned if tier == 0 else ()
        blocks: list[IntArray] = []
        tiers: list[npt.NDArray[np.int8]] = []
        scratch: list[IntArray] = []
        for cache in self.state.caches.values():
            if cache.state is CacheState.ACTIVE or cache.id in pinned:
                record = cache.record
                for lg in lgs:
                    blocks.append(record.blocks[lg])
                    tiers.append(record.tiers[lg])
                    if tier == 0:
                        scratch.append(record.scratch[lg])   # scratch slots stay where the kernels write
        if blocks:                                          # one pass over all of them, not one per cache
            flat, flat_tiers = np.concatenate(blocks), np.concatenate(tiers)
            mask[flat[(flat >= 0) & (flat_tiers == tier)]] = True
        if scratch:
            mask[np.concatenate(scratch)] = True
        return mask

    def victims(self, tier: int, pool_group: int) -> IntArray:
        """Movable slots of ``(tier, pool_group)`` in eviction order: droppable (tree-only) pages before
        held ones, then lowest priority, then least recently used."""
        alloc = self.state.alloc_of(tier, pool_group)
        movable = (alloc.refcount > 0) & ~self.locked_mask(tier, pool_group)
        if not movable.any():
            return np.empty(0, dtype=np.int32)
        recency = np.zeros(alloc.num_slots, dtype=np.int64)
        held_stamp = np.int64(DEFAULT_PRIORITY) << _PRIORITY_SHIFT
        lgs = self.state.pg_layer_groups[pool_group]
        blocks: list[IntArray] = []
        tiers: list[npt.NDArray[np.int8]] = []
        cache_stamps: list[int] = []
        for cache in self.state.caches.values():
            if cache.state is CacheState.ACTIVE:
                continue
            # A request being resumed moves last: its pages are about to come up.
            stamp = _LAST if cache.id in self.state.pinned else int(held_stamp | cache.record.last_used)
            for lg in lgs:
                blocks.append(cache.record.blocks[lg])
                tiers.append(cache.record.tiers[lg])
                cache_stamps.append(stamp)
        if blocks:                      # every held page's latest stamp, in one pass
            flat, flat_tiers = np.concatenate(blocks), np.concatenate(tiers)
            per_page = np.repeat(np.array(cache_stamps, dtype=np.int64), [b.size for b in blocks])
            here = (flat >= 0) & (flat_tiers == tier)
            np.maximum.at(recency, flat[here], per_page[here])
        owners = self.state.tree_owner[tier][pool_group]
        if owners:                          # tree pages: their block's priority and LRU stamp
            slots = np.fromiter(owners, dtype=np.int64, count=len(owners))
            stamps = np.fromiter(((node.priority << _PRIORITY_SHIFT) | node.last_used for node, _ in owners.values()),
                                 dtype=np.int64, count=len(owners))
            recency[slots] = np.maximum(recency[slots], stamps)
        held = alloc.refcount > self.state.in_tree_t[tier][pool_group]
        key = (held.astype(np.int64) << _HELD_BIT) | recency
        idx = np.flatnonzero(movable)
        return idx[np.argsort(key[idx], kind="stable")].astype(np.int32)

    def make_room_in(self, tier: int, pool_group: int, n: int) -> int:
        """Free up to ``n`` slots of ``(tier, pool_group)``; returns the slots freed.

        A warm tier offloads its coldest movable pages one tier down (making room there first,
        recursively); the coldest tier drops tree-only blocks (lowest priority, least recently used,
        leaves before parents). A warm tier drops its own droppable blocks only when the tiers below
        cannot take its pages (they are full of held pages).
        """
        if n <= 0:
            return 0
        alloc = self.state.alloc_of(tier, pool_group)
        before = alloc.num_free
        if tier < len(self.state.tiers) - 1:
            below = self.state.alloc_of(tier + 1, pool_group)
            while (freed := alloc.num_free - before) < n:
                victims = self.victims(tier, pool_group)
                want = min(n - freed, victims.size)
                if want == 0:
                    break
                if below.num_free < want:
                    self.make_room_in(tier + 1, pool_group, want - below.num_free)
                    # Dropping below may have freed pages of this tier too: pick victims afresh.
                    victims = self.victims(tier, pool_group)
                    want = min(n - (alloc.num_free - before), victims.size, below.num_free)
                    if want <= 0:
                        break
                self.move(pool_group, tier, victims[:want], tier + 1)
        freed = alloc.num_free - before
        if freed < n:
            self.drop_in(tier, pool_group, n - freed)
        return alloc.num_free - before

    def droppable_here(self, node: BlockNode, tier: int) -> bool:
        """Whether dropping ``node`` is eviction at ``tier``: tree-only, no page in a warmer tier."""
        return self.tree_only(node) and not (node.tiers[node.pages >= 0] < tier).any()

    def drop_in(self, tier: int, pool_group: int, n: int) -> int:
        """Drop tree-only leaves droppable at ``tier`` until ``n`` slots of ``(tier, pool_group)`` are
        free (or none is left); emits Removed. Returns the slots of that tier freed.

        The leaves are chosen one by one (a parent becomes a leaf when its last child goes) and their
        pages released together at the end: a tree-only page has one reference, so each of the chosen
        blocks' pages of ``(tier, pool_group)`` below the usable limit frees a slot."""
        alloc = self.state.alloc_of(tier, pool_group)
        before = alloc.num_free
        usable = alloc.usable
        here = self.state.pg_layer_groups[pool_group]
        refcounts = [[self.state.alloc_of(t, pg).refcount for pg in range(len(self.state.allocators))]
                     for t in range(len(self.state.tiers))]
        lg_pg = self.state.lg_pool_group
        freed = 0
        kept: list[BlockNode] = []
        victims: list[BlockNode] = []
        flat_pages: list[int] = []
        flat_tiers: list[int] = []
        try:
            while freed < n:
                node = self.state.tree.pop_leaf()
                if node is None:
                    break
                pages, tiers = node.pages.tolist(), node.tiers.tolist()
                state = _drop_state(pages, tiers, tier, refcounts, lg_pg)
                if state is None:
                    continue             # requeued when its request lets go
                if state:
                    self.state.tree.remove(node)
                    victims.append(node)
                    flat_pages += pages
                    flat_tiers += tiers
                    for lg in here:
                        if tiers[lg] == tier and 0 <= pages[lg] < usable:
                            freed += 1
                else:
                    kept.append(node)
        finally:
            self.evict_all(victims, flat_pages, flat_tiers)
            for node in kept:
                self.state.tree.requeue(node)
        return alloc.num_free - before

    def room_estimate(self, tier: int, pool_group: int) -> int:
        """About how many used slots of ``(tier, pool_group)`` ``_make_room_in`` can free now (it
        errs low: the caller still checks what it got)."""
        drop = self.droppable_pages(tier, pool_group)
        if tier == len(self.state.tiers) - 1:
            return drop
        movable = int(np.count_nonzero((self.state.alloc_of(tier, pool_group).refcount > 0)
                                       & ~self.locked_mask(tier, pool_group)))
        return max(min(movable, self.accept(tier + 1, pool_group)), drop)

    def accept(self, tier: int, pool_group: int) -> int:
        """How many pages ``(tier, pool_group)`` can take from the tier above (free slots, plus what
        it can push further down or drop)."""
        free = self.state.alloc_of(tier, pool_group).num_free
        if tier == len(self.state.tiers) - 1:
            return free + self.droppable_pages(tier, pool_group)
        return free + self.accept(tier + 1, pool_group)

    def droppable_pages(self, tier: int, pool_group: int) -> int:
        """Pages of ``(tier, pool_group)`` in blocks ``_drop_in(tier, ...)`` can reach: droppable at
        that tier, with every descendant droppable too (leaves go first)."""
        ready: dict[int, bool] = {}
        count = 0
        lgs = self.state.pg_layer_groups[pool_group]
        for node in reversed(list(self.state.tree.nodes())):   # children before parents
            ok = self.droppable_here(node, tier) and all(ready[id(c)] for c in node.children.values())
            ready[id(node)] = ok
            if ok:
                count += sum(1 for lg in lgs if node.pages[lg] >= 0 and node.tiers[lg] == tier)
        return count

    def move(self, pool_group: int, src_tier: int, src: IntArray, dst_tier: int) -> None:
        """Move pages ``src`` of ``src_tier`` to fresh slots of ``dst_tier`` (one batched copy), then
        repoint every owner; on a failed copy the pages stay where they were."""
        dst = self.state.alloc_of(dst_tier, pool_group).alloc(src.size)
        self.parts.movement.copy_pages(pool_group, [(src_tier, src, dst_tier, dst)])
        self.parts.movement.relocate(pool_group, src_tier, src, dst_tier, dst)


def _drop_state(pages: list[int], tiers: list[int], tier: int, refcounts: list[list[npt.NDArray[np.int32]]],
                lg_pool_group: list[int]) -> bool | None:
    """For a block with ``pages`` / ``tiers`` per layer group: None when a request still holds one of
    its pages (reference count above the tree's one); else whether dropping it is eviction at ``tier``
    (``_droppable_here``: none of its pages is in a warmer tier)."""
    warmer = False
    for lg, page in enumerate(pages):
        if page >= 0:
            if refcounts[tiers[lg]][lg_pool_group[lg]][page] != 1:
                return None
            warmer = warmer or tiers[lg] < tier
    return not warmer
