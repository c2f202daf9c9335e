"""The manager's side of the radix tree: keying a request's blocks, planning and locking a prefix match
(sliding windows included), copy-on-write of a partially reused block, entering committed blocks."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.events import AllCleared, Removed, Stored, Updated, layer_group_subset, stored_extra_keys
from kvxfer.cache.hashing import (
    DEFAULT_SCOPE,
    ExtraKeys,
    ReuseScope,
    TokenIdExt,
    block_keys,
    check_extra_keys,
)
from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.radix_tree import DEFAULT_PRIORITY, BlockNode, PrefixMatch
from kvxfer.errors import ConfigError, KVCacheError, OutOfSlotsError

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]
TokenArray = npt.NDArray[np.int64]

@dataclass(frozen=True)
class _ReusePlan:
    """What a new request takes from the prefix tree: ``pages[b, layer_group]`` for its first
    ``len(pages)`` blocks (-1 where not needed), the first ``len(nodes)`` of them full blocks."""

    num_tokens: int
    nodes: tuple[BlockNode, ...]
    partial: BlockNode | None
    pages: IntArray
    tiers: TierArray
    #: Tokens the match reached before the recurrent layer groups' snapshots cut it (0: not cut).
    unpruned: int = 0
    #: Tokens the tree walk matched before any page check (where the lookup's content leaves the tree).
    walked: int = 0


def check_scope(scope: ReuseScope | None, what: str) -> ReuseScope:
    if scope is None:
        return DEFAULT_SCOPE
    if not isinstance(scope, ReuseScope):
        raise ConfigError(f"{what}: reuse_scope must be a ReuseScope, got {type(scope).__name__}")
    return scope


class PrefixReuse:
    """Prefix matching and the tree's pages."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts``, through which this part reaches the others."""
        self.state = state
        self.parts = parts

    def keys(self, cache: KVCache, tokens: TokenArray, parent: bytes, first_block: int = 0) -> list[bytes]:
        """Block keys of ``tokens`` for a request, chained from ``parent``, under the manager's algorithm."""
        return block_keys(tokens, self.state.layout.tokens_per_block, parent, first_block=first_block,
                          extra_keys=cache.record.extra_keys, algo=self.state.key_algo, scope=cache.reuse_scope,
                          digests=self.state.digests)

    def count_reuse(self, cache: KVCache, plan: _ReusePlan) -> None:
        """Pending counters of a prefix match, as the reference counts them: per layer group the pages
        reused (full blocks, and the partially reused one), not the stale sliding-window positions that
        need none; per request the positions reused in any layer group. Reuse allocates nothing."""
        if not self.state.stats.records(cache.id) or plan.num_tokens == 0:
            return
        has_page = plan.pages >= 0
        full = len(plan.nodes)
        cache.record.pending.request.reused_blocks += int(np.count_nonzero(has_page.any(axis=1)))
        for g in range(plan.pages.shape[1]):
            it = cache.record.pending.layer_group(g)
            full_pages = int(np.count_nonzero(has_page[:full, g]))
            partial_pages = int(np.count_nonzero(has_page[full:, g]))
            it.iter_reused_blocks += full_pages + partial_pages
            it.iter_full_reused_blocks += full_pages
            it.iter_partial_reused_blocks += partial_pages
        self.parts.usage.mark_pending(cache)

    def probe_prompt_reuse(self, tokens: Sequence[TokenIdExt] | npt.ArrayLike, scope: ReuseScope | None = None,
                           extra_keys: ExtraKeys | None = None) -> int:
        """How many tokens ``create_kv_cache_for_prompt(tokens, reuse_scope=scope)`` would reuse now
        (never the last prompt token); takes nothing (no page, no LRU update, no statistics)."""
        return self.probe(scope, tokens, extra_keys, holdback=1, what="probe_prompt_reuse")

    def probe(self, scope: ReuseScope | None, tokens: Sequence[TokenIdExt] | npt.ArrayLike | None,
               extra_keys: ExtraKeys | None, holdback: int, what: str) -> int:
        """How many tokens a match of ``tokens`` (less ``holdback`` at the end) would reuse now."""
        with self.state.lock:
            scope = check_scope(scope, what)
            extras = check_extra_keys(extra_keys, what)
            if tokens is None:
                return 0
            arr = self.state.encode_tokens(tokens, what)
            if not self.state.config.enable_prefix_reuse:
                return 0
            root = scope.root_key_for(self.state.key_algo)
            keys = block_keys(arr, self.state.layout.tokens_per_block, root, extra_keys=extras, algo=self.state.key_algo,
                              scope=scope, digests=self.state.digests)
            return self.plan_matching(root, keys, arr, extras, holdback).num_tokens

    def plan_matching(self, root_key: bytes, keys: list[bytes], tokens: TokenArray, extras: dict[int, bytes],
                       holdback: int) -> _ReusePlan:
        """The reuse plan of the first ``len(tokens) - holdback`` tokens, trimmed by the configured
        ``reuse_match_backoff`` (the match then ends that many tokens earlier)."""
        limit = tokens.size - holdback
        backoff = self.state.reuse_match_backoff
        if backoff:     # trim the raw walk (what the tree holds), then keep what every layer group can use
            match = self.state.tree.match(root_key, keys, tokens, max_tokens=max(limit, 0),
                                          exact_only=not self.state.config.enable_partial_reuse)
            partial = match.partial_tokens if match.partial is not None and len(match.nodes) not in extras else 0
            limit = len(match.nodes) * self.state.layout.tokens_per_block + partial - backoff
        return self.plan_reuse(root_key, keys, tokens, extras, limit)

    def plan_reuse(self, root_key: bytes, keys: list[bytes], tokens: TokenArray,
                    extras: dict[int, bytes], max_tokens: int) -> _ReusePlan:
        """The longest prefix of at most ``max_tokens`` tokens whose pages exist for every layer group
        that needs them."""
        tpb = self.state.layout.tokens_per_block
        n_lg = len(self.state.layout.layer_groups)
        none = _ReusePlan(0, (), None, np.empty((0, n_lg), dtype=np.int32), np.empty((0, n_lg), dtype=np.int8))
        if max_tokens <= 0:
            return none
        match = self.state.tree.match(root_key, keys, tokens, max_tokens=max_tokens,
                                      exact_only=not self.state.config.enable_partial_reuse)
        nodes = match.nodes
        partial = match.partial if len(nodes) not in extras else None
        walked = len(nodes) * tpb + (match.partial_tokens if partial is not None else 0)
        plan = self._plan_pages(match, nodes, partial, n_lg)
        return dataclasses.replace(plan, walked=walked)

    def _plan_pages(self, match: PrefixMatch, nodes: tuple[BlockNode, ...], partial: BlockNode | None,
                    n_lg: int) -> _ReusePlan:
        """The plan of a tree walk: the longest prefix of it whose pages every layer group needs exist
        and hold the tokens reused from them (``prune``); it may end inside a full block whose page
        of some layer group covers only part of it."""
        tpb = self.state.layout.tokens_per_block
        none = _ReusePlan(0, (), None, np.empty((0, n_lg), dtype=np.int32), np.empty((0, n_lg), dtype=np.int8))
        rows = [*nodes, *(() if partial is None else (partial,))]
        if not rows:
            return none
        cov = np.stack([np.where(n.pages >= 0, n.coverage, 0) for n in rows])
        last = match.partial_tokens if partial is not None else tpb
        recurrent = self.state.recurrent_groups
        nb, last = self.prune(cov, last, recurrent)
        unpruned = 0
        if recurrent:       # what the attention pages alone would give (the hybrid diagnostic)
            nb0, last0 = self.prune(cov, match.partial_tokens if partial is not None else tpb, ())
            unpruned = (nb0 - 1) * tpb + last0 if nb0 else 0
        if nb == 0:
            return dataclasses.replace(none, unpruned=unpruned)
        n_tok = (nb - 1) * tpb + last
        taken = rows[:nb]
        pages = np.stack([n.pages for n in taken])
        tiers = np.stack([n.tiers for n in taken])
        if last == tpb and nb <= len(nodes):
            full_nodes, part = tuple(taken), None
        else:
            full_nodes, part = tuple(taken[:-1]), taken[-1]
        return _ReusePlan(n_tok, full_nodes, part, self.needed_pages(pages, n_tok), tiers,
                          unpruned if unpruned > n_tok else 0)

    def prune(self, cov: IntArray, last: int, recurrent: Sequence[int]) -> tuple[int, int]:
        """The reusable part of a walk over ``cov.shape[0]`` blocks whose last one matched ``last``
        tokens: (blocks, tokens of the last one). ``cov[b, lg]``: the tokens block b's page of layer
        group lg holds (0: none). A recurrent group's snapshot is the state after exactly that many
        tokens, so the match ends at the last snapshot it reaches; an attention group needs, at the
        endpoint, every block outside its stale window range to hold the tokens matched there (a
        page holding fewer shortens the match to what it holds). Each step only shortens the match,
        and the recurrent cut moves the endpoint the attention checks use, so it repeats until
        nothing changes."""
        tpb = self.state.layout.tokens_per_block
        nb = cov.shape[0]
        attn = [lg for lg in range(cov.shape[1]) if lg not in self.state.recurrent_groups]
        while nb:
            for lg in recurrent:
                col = cov[:nb, lg]
                matched = np.full(nb, tpb, dtype=np.int64)
                matched[-1] = last
                hits = np.flatnonzero((col > 0) & (matched >= col))
                if not hits.size:
                    return 0, 0
                nb, last = int(hits[-1]) + 1, int(col[hits[-1]])
            n = (nb - 1) * tpb + last
            need = np.full(nb, tpb, dtype=np.int64)
            need[-1] = last
            cut = None
            for lg in attn:
                lo, sink = self.window_start(lg, np.array([n], dtype=np.int64))
                bad = cov[:nb, lg] < need
                if int(lo[0]) > sink:
                    bad[sink:int(lo[0])] = False      # stale blocks: no page needed there
                first_bad = np.flatnonzero(bad)
                if first_bad.size:
                    cut = (int(first_bad[0]), int(cov[int(first_bad[0]), lg]))
                    break
            if cut is None:
                break
            i, c = cut
            nb, last = (i + 1, c) if c > 0 else (i, tpb)
        return nb, (last if nb else 0)

    def window_start(self, layer_group: int, num_tokens: npt.NDArray[np.int64]) -> tuple[
            npt.NDArray[np.int64], int]:
        """(first block a request of ``num_tokens`` still needs after its sinks, sink blocks) for a
        layer group; the same rule ``_release_out_of_window`` frees by."""
        lg = self.state.layout.layer_groups[layer_group]
        if lg.recurrent:    # only the snapshot of the block the prefix ends in
            return np.maximum(0, -(-num_tokens // self.state.layout.tokens_per_block) - 1), 0
        if lg.window is None:
            return np.zeros_like(num_tokens), 0
        tpb = self.state.layout.tokens_per_block
        sink = math.ceil(lg.sink_tokens / tpb)
        first = np.maximum(0, num_tokens - lg.window + 1) // tpb
        return np.where(first <= sink, 0, first), sink

    def needed_pages(self, pages: IntArray, num_tokens: int) -> IntArray:
        """``pages`` with -1 where a sliding-window group does not need the block."""
        out = pages.astype(np.int32, copy=True)
        idx = np.arange(pages.shape[0])
        for lg in range(pages.shape[1]):
            lo, sink = self.window_start(lg, np.array([num_tokens], dtype=np.int64))
            out[(idx >= sink) & (idx < int(lo[0])), lg] = -1
        return out

    def lock_reuse(self, cache: KVCache, tokens: TokenArray, plan: _ReusePlan) -> None:
        """Take a reference on the planned pages and make them the cache's first blocks."""
        cache.record.unpruned_tokens = plan.unpruned
        cache.record.walked_tokens = plan.walked
        if plan.num_tokens == 0:
            return
        for lg in range(plan.pages.shape[1]):
            col, tiers = plan.pages[:, lg].copy(), plan.tiers[:, lg].copy()
            tiers[col < 0] = 0      # a block the request does not need (stale window) has no page anywhere
            if lg in self.state.recurrent_groups:   # the snapshot, held until resume copies it
                col, tiers = col[-1:], tiers[-1:]
                cache.record.ssm_shared.add(lg)
            for tier in np.unique(tiers[col >= 0]).tolist():
                self.state.alloc_of(tier, self.state.lg_pool_group[lg]).incref(col[(col >= 0) & (tiers == tier)])
            cache.record.blocks[lg] = col
            cache.record.tiers[lg] = tiers
        cache.record.tokens = tokens[:plan.num_tokens].copy()
        cache.record.history = plan.num_tokens
        cache.record.capacity = plan.pages.shape[0] * self.state.layout.tokens_per_block
        cache.num_reused_tokens = plan.num_tokens
        cache.record.keys = cache.record.prompt_keys[:len(plan.nodes)]
        cache.record.tree_nodes = list(plan.nodes)
        cache.record.partial_src = plan.partial
        self.state.tree.touch_all((*plan.nodes, plan.partial))

    def copy_on_write(self, cache: KVCache, stream: Any = None) -> bool:
        """Give the cache private copies of its partially reused block (shared with the tree) before
        it may write there (the copy runs on ``stream``); False, changing nothing, when no slot can be
        had."""
        src_node = cache.record.partial_src
        if src_node is None:
            return True
        b = cache.num_committed_tokens // self.state.layout.tokens_per_block
        srcs = [-1 if lg in self.state.recurrent_groups else int(blocks[b])
                for lg, blocks in enumerate(cache.record.blocks)]
        needs: dict[int, int] = {}
        for lg, src in enumerate(srcs):
            if src >= 0:
                needs[self.state.lg_pool_group[lg]] = needs.get(self.state.lg_pool_group[lg], 0) + 1
        try:
            self.parts.eviction.reserve(needs)
        except OutOfSlotsError:
            return False
        by_pg: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for lg, src in enumerate(srcs):
            if src < 0:
                continue
            pg = self.state.lg_pool_group[lg]
            dst = int(self.state.allocators[pg].alloc(1)[0])
            by_pg.setdefault(pg, ([], [], []))[0].append(src)
            by_pg[pg][1].append(dst)
            by_pg[pg][2].append(lg)
            cache.record.blocks[lg][b] = dst
        target = self.parts.streams.stream_of(stream)
        with torch.cuda.stream(target) if target is not None else contextlib.nullcontext():
            for pg, (src_ids, dst_ids, lgs) in by_pg.items():
                src_arr, dst_arr = np.array(src_ids, dtype=np.int32), np.array(dst_ids, dtype=np.int32)
                if self.state.readiness is not None:
                    self.state.readiness.wait_for(pg, np.concatenate([src_arr, dst_arr]), target)
                self.state.copy_slots(pg, src_arr, dst_arr)
                if self.state.readiness is not None:
                    self.state.readiness.stamp(pg, src_arr, target)
                self.state.allocators[pg].decref(src_arr)
                self.parts.movement.count_copies(pg, "intra", len(src_ids), np.array(lgs, dtype=np.int64))
        if by_pg and self.state.stats.records(cache.id):      # the private copy is a new block (as the reference)
            cache.record.pending.request.alloc_total_blocks += 1
            cache.record.pending.request.alloc_new_blocks += 1
            for _, _, lgs in by_pg.values():
                for lg in lgs:
                    cache.record.pending.layer_group(lg).iter_alloc_total_blocks += 1
                    cache.record.pending.layer_group(lg).iter_alloc_new_blocks += 1
            self.parts.usage.mark_pending(cache)
        cache.record.partial_src = None
        self.state.tree.touch(src_node)
        return True

    def insert_committed(self, cache: KVCache, priority: int | None) -> None:
        """Key the cache's newly full blocks and enter them into the tree (adopting duplicates).

        The new blocks are, in order, some the tree already has (adopted one by one), then either a
        chain of blocks new to the tree (entered in one batch: one reference-count update per pool
        group, one Stored per run of blocks with the same layer groups) or, when the block before them
        left the tree, blocks that cannot be entered at all."""
        tpb = self.state.layout.tokens_per_block
        full = cache.num_committed_tokens // tpb
        have = len(cache.record.keys)
        if full <= have:
            return
        toks = cache.record.tokens
        known = min(full, len(cache.record.prompt_keys))
        upto = have
        if known > have and cache.input_tokens is not None:
            diff = np.flatnonzero(toks[have * tpb:known * tpb] != cache.input_tokens[have * tpb:known * tpb])
            upto = known if not diff.size else have + int(diff[0]) // tpb
        new_keys = cache.record.prompt_keys[have:upto]
        parent_key = cache.record.keys[-1] if cache.record.keys else cache.record.root_key
        if upto > have:
            parent_key = new_keys[-1]
        new_keys += self.keys(cache, toks[upto * tpb:full * tpb], parent_key, first_block=upto)
        recurrent = self.state.recurrent_groups
        pages = np.stack([np.full(full - have, -1, dtype=np.int32) if lg in recurrent else blocks[have:full]
                          for lg, blocks in enumerate(cache.record.blocks)], axis=1)
        snap = self.parts.recurrent.snapshot_row(cache, have, full)   # the block a state snapshot goes to
        root_key = cache.record.root_key
        cache.record.keys.extend(new_keys)
        swaps: dict[int, tuple[list[int], list[int]]] = {}
        b = have
        try:
            while b < full:
                parent = cache.record.tree_nodes[b - 1] if b > 0 else None
                if b > 0 and (parent is None or parent.removed):
                    cache.record.tree_nodes.extend([None] * (full - b))    # the chain cannot continue in the tree
                    return
                node = self.state.tree.child(root_key, parent, new_keys[b - have])
                if node is None:
                    break
                self.adopt(cache, b, node, swaps)
                if b == snap:
                    self.adopt_snapshot(cache, node)
                old = node.priority
                if priority is not None and self.state.tree.set_priority(node, priority):
                    self.state.events.put(Updated((node.key,), self.state.node_medium(node), priority, old_priority=old))
                self.state.tree.touch(node)
                cache.record.tree_nodes.append(node)
                b += 1
        finally:
            for pg, (theirs, mine) in swaps.items():
                self.state.allocators[pg].incref(np.array(theirs, dtype=np.int32))
                self.state.allocators[pg].decref_each(np.array(mine, dtype=np.int32))
        if b < full:
            taken: list[tuple[int, int]] = []
            if snap is not None and snap >= b:
                for lg in recurrent:
                    slot = self.parts.recurrent.take_snapshot(cache, lg)
                    if slot >= 0:
                        pages[snap - have, lg] = slot
                        taken.append((lg, slot))
            self.enter_chain(cache, b, new_keys[b - have:], pages[b - have:],
                              DEFAULT_PRIORITY if priority is None else priority)
            for lg, slot in taken:      # the tree now holds the snapshot: the copy's own reference goes
                self.state.allocators[self.state.lg_pool_group[lg]].decref(np.array([slot], dtype=np.int32))

    def adopt_snapshot(self, cache: KVCache, node: BlockNode) -> None:
        """Give a tree block the commit ends at a snapshot of the cache's state in each recurrent layer
        group where it has none (one it has stays)."""
        for lg in self.state.recurrent_groups:
            if int(node.pages[lg]) >= 0:
                continue
            slot = self.parts.recurrent.take_snapshot(cache, lg)
            if slot < 0:
                continue
            node.pages[lg] = slot
            node.tiers[lg] = 0
            self.mark_tree_pages(node, [lg])
            self.state.allocators[self.state.lg_pool_group[lg]].decref(np.array([slot], dtype=np.int32))

    def enter_tail(self, cache: KVCache, *, share_state: bool = False) -> BlockNode | None:
        """Enter the cache's partial last committed block (its committed tokens end inside a block)
        into the tree as a tail block: a leaf holding those tokens and the cache's pages of that block,
        keyed by the chain key of its tokens, with one Stored event. A recurrent layer group's page is
        a snapshot of the cache's state there: a copy, or (``share_state``, when no commit follows)
        the state slot itself, which the cache then holds as the tree's (a later resume gives it a
        private copy). When a sibling already begins with the same tokens (a longer or equal block
        covers them) no block is added: the sibling takes the cache's page of each layer group where its
        own holds fewer tokens (or it has none), so this endpoint stays reusable. A shorter tail sibling
        the new block continues is replaced by it (``absorb``). Returns the block that took pages (None:
        nothing entered; the block before is not in the tree, or every page is already the tree's).
        Attention pages stay the cache's too: it writes only past the tokens the tree's page holds."""
        tpb = self.state.layout.tokens_per_block
        recurrent = self.state.recurrent_groups
        attn = [lg for lg in range(len(cache.record.blocks)) if lg not in recurrent]
        n = cache.num_committed_tokens
        full, rem = divmod(n, tpb)
        if rem == 0 or len(cache.record.tree_nodes) != full or not attn \
                or full >= cache.record.blocks[attn[0]].size:
            return None
        parent = cache.record.tree_nodes[full - 1] if full else None
        if full and (parent is None or parent.removed):
            return None
        tail = cache.record.tokens[full * tpb:n]
        extra = full in cache.record.extra_keys
        covering, shorter = self.tail_siblings(cache.record.root_key, parent, tail, extra)
        n_lg = len(cache.record.blocks)
        pages = np.full(n_lg, -1, dtype=np.int32)
        tiers = np.zeros(n_lg, dtype=np.int8)
        for lg in attn:
            page, tier = int(cache.record.blocks[lg][full]), int(cache.record.tiers[lg][full])
            if page < 0:
                continue
            pg = self.state.lg_pool_group[lg]
            if self.state.in_tree_t[tier][pg][page]:
                owner = self.state.tree_owner[tier][pg].get(page)
                if owner is None or owner[0] is not shorter or covering is not None:
                    continue                # a page the tree has already stays where it is
                self.unlink_page(shorter, lg)   # the cache's own earlier endpoint: this one holds more
            pages[lg], tiers[lg] = page, tier
        snapshots: list[int] = []
        for lg in recurrent:
            if covering is not None and covering.page_coverage(lg) >= rem:
                continue            # the covering block's snapshot is as late or later: keep it
            slot = self.snapshot_slot(cache, lg, share_state)
            if slot >= 0:
                pages[lg] = slot
                snapshots.append(lg)
        try:
            if covering is not None:
                took = [lg for lg in np.flatnonzero(pages >= 0).tolist()
                        if self.install_page(covering, lg, int(pages[lg]), int(tiers[lg]), rem, cache)]
                self.state.tree.touch(covering)
                if took:
                    cache.record.tail_node = covering
                return covering if took else None
            if not (pages >= 0).any():
                return None
            node = self.insert_tail(cache, parent, tail, pages, tiers)
        finally:
            for lg in snapshots:    # the tree took its own reference (or none): the snapshot's goes
                self.release_snapshot(cache, lg, int(pages[lg]), share_state)
        if shorter is not None:
            self.absorb(node, shorter, cache.reuse_scope.lora_id)
        cache.record.tail_node = node
        return node

    def snapshot_slot(self, cache: KVCache, layer_group: int, share: bool) -> int:
        """A slot holding the cache's recurrent state of ``layer_group`` now, with a reference the caller
        gives back through ``release_snapshot``: the live state slot itself (``share``) or a copy of
        it; -1 when there is none."""
        if not share:
            return int(self.parts.recurrent.take_snapshot(cache, layer_group))
        live = cache.record.blocks[layer_group]
        if live.size == 0 or layer_group in cache.record.ssm_shared or int(cache.record.tiers[layer_group][0]) != 0:
            return -1
        return int(live[0])

    def release_snapshot(self, cache: KVCache, layer_group: int, slot: int, shared: bool) -> None:
        """Give back ``snapshot_slot``'s reference: a copy's own reference goes; a shared state slot the
        tree took becomes, for the cache, the tree's snapshot (copied into a private slot at resume)."""
        pg = self.state.lg_pool_group[layer_group]
        if not shared:
            self.state.allocators[pg].decref(np.array([slot], dtype=np.int32))
        elif self.state.in_tree_t[0][pg][slot]:
            cache.record.ssm_shared.add(layer_group)

    def insert_tail(self, cache: KVCache, parent: BlockNode | None, tail: TokenArray, pages: IntArray,
                    tiers: TierArray) -> BlockNode:
        """Add the tail block of ``tail`` under ``parent`` with ``pages`` (each holding all of it), give
        the tree its references and emit its Stored event."""
        tpb = self.state.layout.tokens_per_block
        full, rem = divmod(cache.num_committed_tokens, tpb)
        parent_key = parent.key if parent is not None else cache.record.root_key
        key = block_keys(tail, rem, parent_key, first_block=full, extra_keys=cache.record.extra_keys,
                         algo=self.state.key_algo, scope=cache.reuse_scope, digests=self.state.digests)[0]
        priority = cache.record.block_priority.get(full, DEFAULT_PRIORITY)
        node = self.state.tree.insert(cache.record.root_key, parent, key, tail, pages,
                                      has_extra_key=full in cache.record.extra_keys, priority=priority)
        node.tiers[:] = tiers
        live = np.flatnonzero(pages >= 0).tolist()
        self.mark_tree_pages(node, live)
        scope = cache.reuse_scope
        media = {int(tiers[lg]) for lg in live}
        groups = None if len(live) == pages.size else tuple(live)
        medium = self.state.media[media.pop()] if len(media) == 1 else self.state.node_medium(node)
        self.state.events.put(Stored(None if parent is None else parent.key, (key,), tuple(tail.tolist()), tpb,
                                     scope.lora_id, medium,
                                     stored_extra_keys(full, 1, scope.salt, cache.record.extra_keys), groups))
        return node

    def tail_siblings(self, root_key: bytes, parent: BlockNode | None, tokens: TokenArray,
                      extra: bool) -> tuple[BlockNode | None, BlockNode | None]:
        """Among the blocks under ``parent`` (None: the scope's root): (one beginning with ``tokens``,
        so it covers them; a shorter tail block ``tokens`` begin with, so a block of ``tokens`` replaces
        it). Blocks with an extra key only pair with blocks that have one."""
        siblings = parent if parent is not None else self.state.tree.root(root_key)
        covering = shorter = None
        for child in ([] if siblings is None else siblings.children.values()):
            if child.has_extra_key != extra:
                continue
            k = child.num_tokens
            if k >= tokens.size and np.array_equal(child.tokens[:tokens.size], tokens):
                covering = child
            elif k < tokens.size and np.array_equal(tokens[:k], child.tokens):
                shorter = child
        return covering, shorter

    def install_page(self, node: BlockNode, layer_group: int, page: int, tier: int, coverage: int,
                     cache: KVCache) -> bool:
        """Make ``page`` (of ``tier``, holding ``coverage`` tokens of the block) ``node``'s page of
        ``layer_group`` when the node's own holds fewer tokens or it has none: a block keeps only the
        widest page. The page it replaces is no tree page any more (a request holding it keeps it, as a
        private page). False, changing nothing, when the node's page is at least as wide."""
        if node.removed or node.page_coverage(layer_group) >= coverage:
            return False
        self.unlink_page(node, layer_group)
        node.pages[layer_group] = page
        node.tiers[layer_group] = tier
        node.coverage[layer_group] = coverage
        self.mark_tree_pages(node, [layer_group])
        parent = node.parent
        n_lg = len(self.state.layout.layer_groups)
        self.state.events.put(Stored(None if parent is None or parent.is_root else parent.key, (node.key,),
                                     tuple(node.tokens.tolist()), self.state.layout.tokens_per_block,
                                     cache.reuse_scope.lora_id, self.state.media[tier],
                                     stored_extra_keys(node.depth, 1, cache.reuse_scope.salt, cache.record.extra_keys),
                                     layer_group_subset([i == layer_group for i in range(n_lg)])))
        return True

    def unlink_page(self, node: BlockNode, layer_group: int) -> None:
        """Take ``node``'s page of ``layer_group`` off the tree (the tree's reference goes; the node keeps -1)."""
        page, tier = int(node.pages[layer_group]), int(node.tiers[layer_group])
        if page < 0:
            return
        pg = self.state.lg_pool_group[layer_group]
        if self.state.tree_owner[tier][pg].get(page, (None, -1))[0] is node:
            self.state.unmark_tree_page(tier, pg, page)
            self.state.alloc_of(tier, pg).decref_each(np.array([page], dtype=np.int32))
        node.pages[layer_group] = -1

    def absorb(self, node: BlockNode, shorter: BlockNode, lora_id: int | None) -> None:
        """``node`` continues the tail block ``shorter`` (a sibling whose tokens it begins with): move
        each of ``shorter``'s pages into ``node`` where ``node``'s own holds fewer tokens (or it has
        none: a sliding window's page released before the commit), keeping the tokens each holds, so
        the shorter endpoint stays reusable; the rest go, and ``shorter`` leaves the tree (Removed)."""
        n_lg = len(self.state.layout.layer_groups)
        medium = self.state.node_medium(shorter)
        moved: list[int] = []
        for lg in range(n_lg):
            page, tier, cov = int(shorter.pages[lg]), int(shorter.tiers[lg]), shorter.page_coverage(lg)
            if page < 0:
                continue
            if node.page_coverage(lg) >= cov:
                self.unlink_page(shorter, lg)
                continue
            self.unlink_page(node, lg)
            pg = self.state.lg_pool_group[lg]
            node.pages[lg], node.tiers[lg], node.coverage[lg] = page, tier, cov
            shorter.pages[lg] = -1
            if self.state.in_tree_t[tier][pg][page]:
                self.state.tree_owner[tier][pg][page] = (node, lg)
            moved.append(lg)
        self.state.tree.remove(shorter)
        self.state.events.put(Removed((shorter.key,), medium))
        if moved:
            parent = node.parent
            self.state.events.put(Stored(None if parent is None or parent.is_root else parent.key, (node.key,),
                                         tuple(node.tokens.tolist()), self.state.layout.tokens_per_block, lora_id,
                                         self.state.node_medium(node), None,
                                         layer_group_subset([i in moved for i in range(n_lg)])))
        self.state.tree.touch(node)

    def enter_chain(self, cache: KVCache, first: int, keys: list[bytes], pages: IntArray, priority: int) -> None:
        """Enter the cache's blocks ``first, first + 1, ...`` (keys ``keys``, primary pages ``pages[i]``
        per layer group, -1: none) into the tree as a chain of new blocks, give the tree its references
        and emit their Stored events (one per run of consecutive blocks holding the same layer groups,
        as the queue would have merged them)."""
        tpb = self.state.layout.tokens_per_block
        n = len(keys)
        stop = first + n
        parent = cache.record.tree_nodes[first - 1] if first > 0 else None
        toks = cache.record.tokens
        live = [np.flatnonzero(pages[:, lg] >= 0) for lg in range(pages.shape[1])]
        _, shorter = self.tail_siblings(cache.record.root_key, parent, toks[first * tpb:(first + 1) * tpb],
                                        first in cache.record.extra_keys)
        if shorter is not None:     # the cache's own earlier endpoint in this block: its pages come along
            for lg in range(pages.shape[1]):
                if pages[0, lg] >= 0 and int(shorter.pages[lg]) == int(pages[0, lg]) and shorter.tiers[lg] == 0:
                    self.unlink_page(shorter, lg)
        for lg, rows in enumerate(live):       # a new block's page cannot be a tree page already
            pg = self.state.lg_pool_group[lg]
            taken = pages[rows, lg][self.state.in_tree_t[0][pg][pages[rows, lg]]]
            if taken.size:
                raise KVCacheError(f"pool group {pg}: slot {int(taken[0])} of tier 0 is already a tree page")
        nodes = self.state.tree.insert_chain(cache.record.root_key, parent, keys, toks[first * tpb:stop * tpb].reshape(n, tpb),
                                        pages, [b in cache.record.extra_keys for b in range(first, stop)], priority=priority)
        cache.record.tree_nodes.extend(nodes)
        by_pg: dict[int, list[IntArray]] = {}
        for lg, rows in enumerate(live):
            pg = self.state.lg_pool_group[lg]
            slots = pages[rows, lg]
            self.state.in_tree_t[0][pg][slots] = True
            self.state.tree_owner[0][pg].update(zip(slots.tolist(), [(nodes[i], lg) for i in rows.tolist()], strict=True))
            by_pg.setdefault(pg, []).append(slots)
        for pg, parts in by_pg.items():
            self.state.allocators[pg].incref(np.concatenate(parts))
        present = pages >= 0
        starts = [0, *(np.flatnonzero((present[1:] != present[:-1]).any(axis=1)) + 1).tolist()]
        scope = cache.reuse_scope
        for s, e in zip(starts, [*starts[1:], n], strict=True):
            row = present[s]
            groups = None if row.all() else tuple(np.flatnonzero(row).tolist())
            parent_hash = (None if parent is None else parent.key) if s == 0 else keys[s - 1]
            self.state.events.put(Stored(parent_hash, tuple(keys[s:e]),
                                    tuple(toks[(first + s) * tpb:(first + e) * tpb].tolist()), tpb, scope.lora_id,
                                    self.state.medium, stored_extra_keys(first + s, e - s, scope.salt, cache.record.extra_keys),
                                    groups))
        if shorter is not None:      # the first new block continues a tail block: it takes that block's place
            self.absorb(nodes[0], shorter, scope.lora_id)

    def mark_tree_pages(self, node: BlockNode, layer_groups: Sequence[int] | range) -> None:
        """Give the tree its reference on ``node``'s page of each listed layer group."""
        for lg in layer_groups:
            page, tier = int(node.pages[lg]), int(node.tiers[lg])
            if page >= 0:
                pg = self.state.lg_pool_group[lg]
                if self.state.in_tree_t[tier][pg][page]:
                    raise KVCacheError(f"pool group {pg}: slot {page} of tier {tier} is already a tree page")
                self.state.alloc_of(tier, pg).incref(np.array([page], dtype=np.int32))
                self.state.in_tree_t[tier][pg][page] = True
                self.state.tree_owner[tier][pg][page] = (node, lg)

    def adopt(self, cache: KVCache, block: int, node: BlockNode, swaps: dict[int, tuple[list[int], list[int]]]) -> None:
        """A committed block duplicating ``node``: use the tree's pages and free the cache's own;
        a page the tree lacks (sliding window), or has only for part of the block, is taken from the
        cache. A tree page in a colder tier is not adopted (an active request's pages stay primary):
        the cache keeps its own. The reference swaps are left in ``swaps`` (pool group -> (tree pages
        to take, own pages to let go, in order)) for the caller to apply in one step."""
        for lg, blocks in enumerate(cache.record.blocks):
            if lg in self.state.recurrent_groups:   # snapshots: see adopt_snapshot
                continue
            mine, theirs = int(blocks[block]), int(node.pages[lg])
            pg = self.state.lg_pool_group[lg]
            if mine >= 0 and node.page_coverage(lg) < node.num_tokens:    # none, or one holding part of it
                self.install_page(node, lg, mine, int(cache.record.tiers[lg][block]), node.num_tokens, cache)
                continue
            if theirs >= 0 and node.tiers[lg] != 0:
                continue
            if theirs >= 0 and mine >= 0 and mine != theirs:
                take, drop = swaps.setdefault(pg, ([], []))
                take.append(theirs)
                drop.append(mine)
                blocks[block] = theirs

    def drop_window_pages(self, cache: KVCache, layer_group: int, start: int, released: IntArray,
                           tiers: TierArray) -> None:
        """The tree lets go of the sliding-window pages a request just released for blocks
        [start, start + len(released)) once no other request holds them (the node keeps -1 there),
        so window memory is not pinned by the tree; a node left without pages is requeued. Blocks the
        request reused from the tree keep their pages unless ``drops_reused_window_pages``: they are
        what earlier requests entered, and other endpoints may need them. One reference drop per tier,
        one Removed per run of blocks of one medium."""
        pg = self.state.lg_pool_group[layer_group]
        reused = 0 if self.state.drops_reused_window_pages else \
            cache.num_reused_tokens // self.state.layout.tokens_per_block
        if start + released.size <= reused:
            return
        skip = max(0, reused - start)
        nodes = [None] * skip + cache.record.tree_nodes[start + skip:start + released.size]
        drops: dict[int, list[int]] = {}
        run: list[bytes]
        groups = layer_group_subset([i == layer_group for i in range(len(self.state.layout.layer_groups))])
        run_tier, run = -1, []    # the Removed being built: its tier and block keys
        touched: list[BlockNode | None] = []
        for node, page, tier in zip(nodes, released.tolist(), tiers.tolist(), strict=False):
            if node is None or node.removed or page < 0 or int(node.pages[layer_group]) != page \
                    or int(node.tiers[layer_group]) != tier:
                continue
            if self.state.in_tree_t[tier][pg][page] and self.state.alloc_of(tier, pg).refcount[page] == 1:
                drops.setdefault(tier, []).append(page)
                self.state.unmark_tree_page(tier, pg, page)
                node.pages[layer_group] = -1
                if tier != run_tier and run:
                    self.state.events.put(Removed(tuple(run), self.state.media[run_tier], groups))
                    run = []
                run_tier = tier
                run.append(node.key)
            touched.append(node)
        if run:
            self.state.events.put(Removed(tuple(run), self.state.media[run_tier], groups))
        for tier, pages in drops.items():
            self.state.alloc_of(tier, pg).decref_each(np.array(pages, dtype=np.int32))
        self.state.tree.touch_all(touched)

    def window_nodes(self, cache: KVCache) -> list[tuple[BlockNode, int]]:
        """(tree block, sliding-window layer group) of every page a request continuing exactly where
        ``cache`` ends would need from the tree: the window (and sinks) before its committed length, the
        partial last block's included, and the recurrent snapshot where it ends."""
        n = cache.num_committed_tokens
        nodes = self.endpoint_nodes(cache)
        out: list[tuple[BlockNode, int]] = []
        tpb = self.state.layout.tokens_per_block
        for lg, group in enumerate(self.state.layout.layer_groups):
            if group.recurrent:     # the snapshot where the cache ends
                if n and -(-n // tpb) <= len(nodes) and (node := nodes[-(-n // tpb) - 1]) is not None:
                    out.append((node, lg))
                continue
            if group.window is None:
                continue
            lo, sink = self.window_start(lg, np.array([n], dtype=np.int64))
            needed = [*range(min(sink, len(nodes))), *range(max(int(lo[0]), sink), len(nodes))]
            out.extend((node, lg) for b in needed if (node := nodes[b]) is not None)
        return out

    def endpoint_nodes(self, cache: KVCache) -> list[BlockNode | None]:
        """The tree blocks of the cache's committed tokens: one per full block, and the block holding
        its partial last block's pages when it ends inside one (None where a block is not in the tree)."""
        nodes: list[BlockNode | None] = list(cache.record.tree_nodes)
        if cache.num_committed_tokens % self.state.layout.tokens_per_block:
            tail = cache.record.tail_node
            nodes.append(tail if tail is not None and not tail.removed else None)
        return nodes

    def endpoint_cut_short(self, cache: KVCache) -> bool:
        """Whether a match of the cache's committed tokens, all of whose blocks are in the tree, would
        now stop early: a page some layer group needs there holds fewer tokens than the match reaches,
        or is gone (``prune``)."""
        nodes = self.endpoint_nodes(cache)
        if not nodes or any(node is None or node.removed for node in nodes):
            return False
        tpb = self.state.layout.tokens_per_block
        n = cache.num_committed_tokens
        cov = np.stack([np.where(node.pages >= 0, node.coverage, 0) for node in nodes if node is not None])
        nb, last = self.prune(cov, n - (len(nodes) - 1) * tpb, self.state.recurrent_groups)
        return nb == 0 or (nb - 1) * tpb + last != n

    def drop_node_pages(self, pairs: list[tuple[BlockNode, int]]) -> None:
        """The tree lets go of layer group ``lg``'s page of each ``(node, lg)`` that only the tree holds
        (the node keeps -1 there; a page a request shares stays). One Removed per block and layer group."""
        drops: dict[tuple[int, int], list[int]] = {}
        touched: list[BlockNode | None] = []
        n_lg = len(self.state.layout.layer_groups)
        for node, lg in pairs:
            page, tier = int(node.pages[lg]), int(node.tiers[lg])
            pg = self.state.lg_pool_group[lg]
            if node.removed or page < 0 or not self.state.in_tree_t[tier][pg][page] \
                    or self.state.alloc_of(tier, pg).refcount[page] != 1:
                continue
            drops.setdefault((tier, pg), []).append(page)
            self.state.unmark_tree_page(tier, pg, page)
            node.pages[lg] = -1
            self.state.events.put(Removed((node.key,), self.state.media[tier],
                                          layer_group_subset([i == lg for i in range(n_lg)])))
            touched.append(node)
        for (tier, pg), pages in drops.items():
            self.state.alloc_of(tier, pg).decref_each(np.array(pages, dtype=np.int32))
        self.state.tree.touch_all(touched)

    def set_priority(self, cache: KVCache, priority: int) -> None:
        """Set the eviction priority of every tree block of the cache's committed blocks."""
        with self.state.lock:
            for node in cache.record.tree_nodes:
                if node is not None:
                    self.set_node_priority(node, priority)

    def set_node_priority(self, node: BlockNode, priority: int) -> None:
        """Set one tree block's eviction priority (an ``Updated`` event when it changes)."""
        with self.state.lock:
            old = node.priority
            if self.state.tree.set_priority(node, priority):
                self.state.events.put(Updated((node.key,), self.state.node_medium(node), priority, old_priority=old))

    def touch_blocks(self, cache: KVCache, start: int, stop: int) -> None:
        """Requeue the tree blocks tied to the cache's blocks [start, stop) for eviction."""
        self.state.tree.touch_all(cache.record.tree_nodes[start:stop])

    def reset_prefix_tree(self) -> bool:
        """Drop every block of the prefix tree (one AllCleared event); False, changing nothing, while
        a request still shares one of its pages."""
        with self.state.lock:
            nodes = list(self.state.tree.nodes())
            if any(not self.parts.eviction.tree_only(n) for n in nodes):
                return False
            self.clear_tree(nodes)
            return True

    def clear_tree(self, nodes: list[BlockNode]) -> None:
        """Take every block out of the tree and let go of the tree's references to their pages."""
        self.state.tree.clear()
        if not nodes:
            return
        pages = np.stack([n.pages for n in nodes])
        tiers = np.stack([n.tiers for n in nodes])
        for lg in range(pages.shape[1]):
            pg = self.state.lg_pool_group[lg]
            for tier in range(len(self.state.tiers)):
                col = pages[:, lg][(pages[:, lg] >= 0) & (tiers[:, lg] == tier)]
                self.state.alloc_of(tier, pg).decref(col)
                self.state.in_tree_t[tier][pg][col] = False
        for per_tier in self.state.tree_owner:
            for owners in per_tier:
                owners.clear()
        self.state.events.put(AllCleared())
