"""Moving pages between slots and tiers: batched copies through the copy engine, repointing every
owner (tree blocks, requests) after a move, counting the copies."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.copy_engine import CopyHandle
from kvxfer.cache.events import Updated, layer_group_subset
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.radix_tree import BlockNode
from kvxfer.errors import KvxferError

IntArray = npt.NDArray[np.int32]


class PageMovement:
    """Copies of pages and the bookkeeping that follows them."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts``, through which this part reaches the others."""
        self.state = state
        self.parts = parts

    def copy_pages(self, pool_group: int, jobs: list[tuple[int, IntArray, int, IntArray]]) -> None:
        """Run ``(src tier, src slots, dst tier, dst slots)`` copies back to back through the copy
        engine and wait for all; on failure the destination slots are freed and the error re-raised."""
        assert self.state.copier is not None
        if any(self.state.tiers[src_t].memory_kind == "cuda" for src_t, _, _, _ in jobs):
            torch.cuda.current_stream(self.state.device).synchronize()   # the KV being moved must be written
        if self.state.readiness is not None:          # sources written and destinations let go of on every
            for src_t, src, dst_t, dst in jobs:   # request's stream too
                if src_t == 0:
                    self.state.readiness.synchronize(pool_group, src)
                if dst_t == 0:
                    self.state.readiness.synchronize(pool_group, dst)
        handles: list[CopyHandle] = []
        try:
            for src_t, src, dst_t, dst in jobs:
                handles.append(self.state.copier.copy_slots(self.state.tiers[src_t], self.state.tiers[dst_t], pool_group, src, dst))
            for handle in handles:
                handle.wait()
        except BaseException:
            for handle in handles:   # let every queued copy finish before its slots are reused
                with contextlib.suppress(KvxferError):
                    handle.wait()
            for _, _, dst_t, dst in jobs:
                self.state.alloc_of(dst_t, pool_group).decref(dst)
            raise

    def relocate(self, pool_group: int, src_tier: int, src: IntArray, dst_tier: int, dst: IntArray, *,
                  dst_alloc: SlotAllocator | None = None, dst_in_tree: npt.NDArray[np.bool_] | None = None,
                  dst_owner: dict[int, tuple[BlockNode, int]] | None = None) -> None:
        """Pages ``src`` of ``src_tier`` now live in slots ``dst`` (freshly allocated, one reference
        each) of ``dst_tier``: carry the reference counts over, repoint the tree blocks and the
        requests holding them, free the sources, emit Updated for a change of medium."""
        src_alloc = self.state.alloc_of(src_tier, pool_group)
        dst_alloc = dst_alloc if dst_alloc is not None else self.state.alloc_of(dst_tier, pool_group)
        dst_in_tree = dst_in_tree if dst_in_tree is not None else self.state.in_tree_t[dst_tier][pool_group]
        dst_owner = dst_owner if dst_owner is not None else self.state.tree_owner[dst_tier][pool_group]
        refs = src_alloc.refcount[src].astype(np.int64)
        extra = np.repeat(dst, refs - 1)
        if extra.size:
            dst_alloc.incref(extra)
        src_owner = self.state.tree_owner[src_tier][pool_group]
        moved: dict[int, list[BlockNode]] = {}
        owner_lgs = np.full(src.size, self.state.pg_layer_groups[pool_group][0], dtype=np.int64)
        for i, (s, d) in enumerate(zip(src.tolist(), dst.tolist(), strict=True)):
            owner = src_owner.pop(s, None)
            if owner is not None:
                node, lg = owner
                owner_lgs[i] = lg
                node.pages[lg] = d
                node.tiers[lg] = dst_tier
                dst_owner[d] = owner
                moved.setdefault(lg, []).append(node)
        src_in_tree = self.state.in_tree_t[src_tier][pool_group]
        dst_in_tree[dst] = src_in_tree[src]
        src_in_tree[src] = False
        order = np.argsort(src)
        sorted_src, sorted_dst = src[order], dst[order]
        if sorted_src.size:
            self._repoint_requests(pool_group, src_tier, sorted_src, sorted_dst, dst_tier, order, owner_lgs)
        src_alloc.decref(np.repeat(src, refs))
        if src_tier != dst_tier:
            self.state.traffic.moved(src_tier, dst_tier, int(src.size), int(src.size) * self.state.page_bytes[pool_group])
            self.count_copies(pool_group, "onboard" if dst_tier < src_tier else "offload", int(src.size),
                               owner_lgs)
        if moved and src_tier != dst_tier:
            self.put_moves(moved, self.state.media[src_tier], self.state.media[dst_tier])

    def _repoint_requests(self, pool_group: int, src_tier: int, sorted_src: IntArray, sorted_dst: IntArray,
                          dst_tier: int, order: npt.NDArray[np.intp], owner_lgs: npt.NDArray[np.int64]) -> None:
        """Point every request's pages ``sorted_src`` of ``src_tier`` at ``sorted_dst`` of ``dst_tier``
        (in place) and note the layer group each moved page is found in: one search over all the
        requests' pages of the pool group, writing back only the arrays that hold a moved page."""
        lgs = self.state.pg_layer_groups[pool_group]
        blocks: list[IntArray] = []
        tiers: list[npt.NDArray[np.int8]] = []
        seg_lgs: list[int] = []
        for cache in self.state.caches.values():
            for lg in lgs:
                if cache.record.blocks[lg].size:
                    blocks.append(cache.record.blocks[lg])
                    tiers.append(cache.record.tiers[lg])
                    seg_lgs.append(lg)
        if not blocks:
            return
        flat, flat_tiers = np.concatenate(blocks), np.concatenate(tiers)
        idx = np.minimum(np.searchsorted(sorted_src, flat), sorted_src.size - 1)
        hit = (flat_tiers == src_tier) & (flat >= 0) & (sorted_src[idx] == flat)
        if not hit.any():
            return
        sizes = [b.size for b in blocks]
        # later arrays win where a page is held twice, as when each array was searched in turn
        owner_lgs[order[idx[hit]]] = np.repeat(np.array(seg_lgs, dtype=np.int64), sizes)[hit]
        starts = np.cumsum([0, *sizes[:-1]])
        hits_per = np.add.reduceat(hit.astype(np.int64), starts)
        for i in np.flatnonzero(hits_per).tolist():
            s, e = int(starts[i]), int(starts[i]) + sizes[i]
            seg = hit[s:e]
            blocks[i][seg] = sorted_dst[idx[s:e][seg]]
            tiers[i][seg] = dst_tier

    def put_moves(self, moved: dict[int, list[BlockNode]], old: str, new: str) -> None:
        """Updated events for blocks whose pages of the listed layer groups moved ``old`` -> ``new``
        (one event when every layer group moved the same blocks), each block with its parent and tokens
        so a router can store it anew on ``new``."""
        n_lg = len(self.state.layout.layer_groups)
        tpb = self.state.layout.tokens_per_block
        nodes = [list({n.key: n for n in v}.values()) for v in moved.values()]

        def update(blocks: list[BlockNode], layer_groups: tuple[int, ...] | None) -> Updated:
            return Updated(tuple(n.key for n in blocks), new, old_medium=old, layer_groups=layer_groups,
                           parent_hashes=tuple(None if n.parent is None or n.parent.is_root else n.parent.key
                                               for n in blocks),
                           block_tokens=tuple(tuple(n.tokens.tolist()) for n in blocks), block_size=tpb)

        keys = [[n.key for n in v] for v in nodes]
        if len(moved) == n_lg and all(k == keys[0] for k in keys):
            self.state.events.put(update(nodes[0], None))
            return
        for lg, blocks in zip(moved, nodes, strict=True):
            self.state.events.put(update(blocks, layer_group_subset([i == lg for i in range(n_lg)])))

    def count_copies(self, pool_group: int, kind: str, pages: int, layer_groups: npt.NDArray[np.int64] | None) -> None:
        """Count ``pages`` copied pages of a pool group in the iteration stats of the layer groups
        they belong to (``layer_groups[i]`` per page; the pool group's first one when unknown).
        ``kind``: "onboard" (to a warmer tier), "offload" (to a colder one) or "intra" (same device)."""
        if not self.state.stats.enabled or pages == 0:
            return
        lgs = np.full(pages, self.state.pg_layer_groups[pool_group][0], dtype=np.int64) if layer_groups is None \
            else layer_groups
        nbytes = self.state.page_bytes[pool_group]
        for lg, n in zip(*np.unique(lgs, return_counts=True), strict=True):
            delta = self.state.stats.traffic(int(lg))
            assert delta is not None
            count = int(n)
            if kind == "onboard":
                delta.iter_onboard_blocks += count
                delta.iter_onboard_bytes += count * nbytes
            elif kind == "offload":
                delta.iter_offload_blocks += count
                delta.iter_offload_bytes += count * nbytes
            else:
                delta.iter_intra_device_copy_blocks += count
                delta.iter_intra_device_copy_bytes += count * nbytes
