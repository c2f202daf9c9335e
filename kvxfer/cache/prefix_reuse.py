"""The manager's side of the radix tree: keying a request's blocks, planning and locking a prefix match
(sliding windows included), copy-on-write of a partially reused block, entering committed blocks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.events import AllCleared, Removed, Stored, Updated, layer_group_subset, stored_extra_keys
from kvxfer.cache.hashing import DEFAULT_SCOPE, ExtraKeys, ReuseScope, block_keys, check_extra_keys
from kvxfer.cache.kv_cache import KVCache, _as_tokens
from kvxfer.cache.radix_tree import DEFAULT_PRIORITY, BlockNode
from kvxfer.cache.tier_quotas import TierQuotas
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


def _check_scope(scope: ReuseScope | None, what: str) -> ReuseScope:
    if scope is None:
        return DEFAULT_SCOPE
    if not isinstance(scope, ReuseScope):
        raise ConfigError(f"{what}: reuse_scope must be a ReuseScope, got {type(scope).__name__}")
    return scope


class PrefixReuse(TierQuotas):
    """Prefix matching and the tree's pages."""

    def _keys(self, cache: KVCache, tokens: TokenArray, parent: bytes, first_block: int = 0) -> list[bytes]:
        """Block keys of ``tokens`` for a request, chained from ``parent``, under the manager's algorithm."""
        return block_keys(tokens, self._layout.tokens_per_block, parent, first_block=first_block,
                          extra_keys=cache._extra_keys, algo=self._hash_algo, scope=cache.reuse_scope)

    def _count_reuse(self, cache: KVCache, plan: _ReusePlan) -> None:
        """Pending counters of a prefix match, as the reference counts them: per layer group the pages
        reused (full blocks, and the partially reused one), not the stale sliding-window positions that
        need none; per request the positions reused in any layer group. Reuse allocates nothing."""
        if not self._stats.records(cache.id) or plan.num_tokens == 0:
            return
        has_page = plan.pages >= 0
        full = len(plan.nodes)
        cache._pending.request.reused_blocks += int(np.count_nonzero(has_page.any(axis=1)))
        for g in range(plan.pages.shape[1]):
            it = cache._pending.layer_group(g)
            full_pages = int(np.count_nonzero(has_page[:full, g]))
            partial_pages = int(np.count_nonzero(has_page[full:, g]))
            it.iter_reused_blocks += full_pages + partial_pages
            it.iter_full_reused_blocks += full_pages
            it.iter_partial_reused_blocks += partial_pages
        self._mark_pending(cache)

    def probe_prompt_reuse(self, tokens: Sequence[int] | npt.ArrayLike, scope: ReuseScope | None = None,
                           extra_keys: ExtraKeys | None = None) -> int:
        """How many tokens ``create_kv_cache_for_prompt(tokens, reuse_scope=scope)`` would reuse now
        (never the last prompt token); takes nothing (no page, no LRU update, no statistics)."""
        return self._probe(scope, tokens, extra_keys, holdback=1, what="probe_prompt_reuse")

    def _probe(self, scope: ReuseScope | None, tokens: Sequence[int] | npt.ArrayLike | None,
               extra_keys: ExtraKeys | None, holdback: int, what: str) -> int:
        with self._lock:
            scope = _check_scope(scope, what)
            extras = check_extra_keys(extra_keys, what)
            if tokens is None:
                return 0
            arr = _as_tokens(tokens, what)
            if not self.config.enable_prefix_reuse:
                return 0
            root = scope.root_key_for(self._hash_algo)
            keys = block_keys(arr, self._layout.tokens_per_block, root, extra_keys=extras, algo=self._hash_algo,
                              scope=scope)
            return self._plan_matching(root, keys, arr, extras, holdback).num_tokens

    def _plan_matching(self, root_key: bytes, keys: list[bytes], tokens: TokenArray, extras: dict[int, bytes],
                       holdback: int) -> _ReusePlan:
        """The reuse plan of the first ``len(tokens) - holdback`` tokens, trimmed by the configured
        ``reuse_match_backoff`` (the match then ends that many tokens earlier)."""
        plan = self._plan_reuse(root_key, keys, tokens, extras, tokens.size - holdback)
        backoff = self.reuse_match_backoff
        if backoff and plan.num_tokens:
            plan = self._plan_reuse(root_key, keys, tokens, extras, plan.num_tokens - backoff)
        return plan

    def _plan_reuse(self, root_key: bytes, keys: list[bytes], tokens: TokenArray,
                    extras: dict[int, bytes], max_tokens: int) -> _ReusePlan:
        """The longest prefix of at most ``max_tokens`` tokens whose pages exist for every layer group
        that needs them."""
        tpb = self._layout.tokens_per_block
        n_lg = len(self._layout.layer_groups)
        none = _ReusePlan(0, (), None, np.empty((0, n_lg), dtype=np.int32), np.empty((0, n_lg), dtype=np.int8))
        if max_tokens <= 0:
            return none
        match = self._tree.match(root_key, keys, tokens if self.config.enable_partial_reuse else None,
                                 max_tokens=max_tokens)
        nodes = match.nodes
        partial = match.partial if len(nodes) not in extras else None
        rows = [n.pages for n in nodes] + ([partial.pages] if partial is not None else [])
        if not rows:
            return none
        pages = np.concatenate(rows).reshape(len(rows), n_lg)
        tiers = np.concatenate([n.tiers for n in (*nodes, *(() if partial is None else (partial,)))]
                               ).reshape(len(rows), n_lg)
        full = len(nodes)
        if not self._has_windows:          # full attention keeps every page: the whole match holds
            return _ReusePlan(full * tpb + match.partial_tokens if partial is not None else full * tpb,
                              nodes, partial, pages, tiers)
        if partial is not None:
            n_tok = full * tpb + match.partial_tokens
            if self._window_pages_exist(pages, np.array([n_tok]), np.array([full + 1]))[0]:
                return _ReusePlan(n_tok, nodes, partial, self._needed_pages(pages[:full + 1], n_tok),
                                  tiers[:full + 1])
        b = np.arange(full + 1)
        ok = self._window_pages_exist(pages, b * tpb, b)
        best = int(np.flatnonzero(ok)[-1])
        if best == 0:
            return none
        return _ReusePlan(best * tpb, nodes[:best], None, self._needed_pages(pages[:best], best * tpb), tiers[:best])

    def _window_start(self, layer_group: int, num_tokens: npt.NDArray[np.int64]) -> tuple[
            npt.NDArray[np.int64], int]:
        """(first block a request of ``num_tokens`` still needs after its sinks, sink blocks) for a
        layer group; the same rule ``_release_out_of_window`` frees by."""
        lg = self._layout.layer_groups[layer_group]
        if lg.window is None:
            return np.zeros_like(num_tokens), 0
        tpb = self._layout.tokens_per_block
        sink = math.ceil(lg.sink_tokens / tpb)
        first = np.maximum(0, num_tokens - lg.window + 1) // tpb
        return np.where(first <= sink, 0, first), sink

    def _window_pages_exist(self, pages: IntArray, num_tokens: npt.NDArray[np.int64],
                            num_blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """For each candidate (num_tokens[i] in num_blocks[i] blocks): whether every page a layer
        group needs for it (sink blocks and the window before it) exists in ``pages``."""
        ok = np.ones(num_tokens.size, dtype=bool)
        for lg in range(pages.shape[1]):
            missing = np.concatenate([[0], np.cumsum(pages[:, lg] < 0)])
            lo, sink = self._window_start(lg, num_tokens.astype(np.int64))
            ok &= missing[num_blocks] - missing[np.minimum(lo, num_blocks)] == 0
            ok &= missing[np.minimum(sink, num_blocks)] == 0
        return ok

    def _needed_pages(self, pages: IntArray, num_tokens: int) -> IntArray:
        """``pages`` with -1 where a sliding-window group does not need the block."""
        out = pages.astype(np.int32, copy=True)
        idx = np.arange(pages.shape[0])
        for lg in range(pages.shape[1]):
            lo, sink = self._window_start(lg, np.array([num_tokens], dtype=np.int64))
            out[(idx >= sink) & (idx < int(lo[0])), lg] = -1
        return out

    def _lock_reuse(self, cache: KVCache, tokens: TokenArray, plan: _ReusePlan) -> None:
        """Take a reference on the planned pages and make them the cache's first blocks."""
        if plan.num_tokens == 0:
            return
        for lg in range(plan.pages.shape[1]):
            col, tiers = plan.pages[:, lg].copy(), plan.tiers[:, lg].copy()
            for tier in np.unique(tiers[col >= 0]).tolist():
                self._alloc_of(tier, self._lg_pool_group[lg]).incref(col[(col >= 0) & (tiers == tier)])
            cache._blocks[lg] = col
            cache._tiers[lg] = tiers
        cache._tokens = tokens[:plan.num_tokens].copy()
        cache._history = plan.num_tokens
        cache._capacity = plan.pages.shape[0] * self._layout.tokens_per_block
        cache.num_reused_tokens = plan.num_tokens
        cache._keys = cache._prompt_keys[:len(plan.nodes)]
        cache._tree_nodes = list(plan.nodes)
        cache._partial_src = plan.partial
        self._tree.touch_all((*plan.nodes, plan.partial))

    def _copy_on_write(self, cache: KVCache, stream: Any = None) -> bool:
        """Give the cache private copies of its partially reused block (shared with the tree) before
        it may write there (the copy runs on ``stream``); False, changing nothing, when no slot can be
        had."""
        src_node = cache._partial_src
        if src_node is None:
            return True
        b = cache.num_committed_tokens // self._layout.tokens_per_block
        srcs = [int(blocks[b]) for blocks in cache._blocks]
        needs: dict[int, int] = {}
        for lg, src in enumerate(srcs):
            if src >= 0:
                needs[self._lg_pool_group[lg]] = needs.get(self._lg_pool_group[lg], 0) + 1
        try:
            self._reserve(needs)
        except OutOfSlotsError:
            return False
        by_pg: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for lg, src in enumerate(srcs):
            if src < 0:
                continue
            pg = self._lg_pool_group[lg]
            dst = int(self._allocators[pg].alloc(1)[0])
            by_pg.setdefault(pg, ([], [], []))[0].append(src)
            by_pg[pg][1].append(dst)
            by_pg[pg][2].append(lg)
            cache._blocks[lg][b] = dst
        target = self._stream_of(stream)
        with torch.cuda.stream(target) if target is not None else contextlib.nullcontext():
            for pg, (src_ids, dst_ids, lgs) in by_pg.items():
                src_arr, dst_arr = np.array(src_ids, dtype=np.int32), np.array(dst_ids, dtype=np.int32)
                if self._readiness is not None:
                    self._readiness.wait_for(pg, np.concatenate([src_arr, dst_arr]), target)
                self.copy_slots(pg, src_arr, dst_arr)
                if self._readiness is not None:
                    self._readiness.stamp(pg, src_arr, target)
                self._allocators[pg].decref(src_arr)
                self._count_copies(pg, "intra", len(src_ids), np.array(lgs, dtype=np.int64))
        if by_pg and self._stats.records(cache.id):      # the private copy is a new block (as the reference)
            cache._pending.request.alloc_total_blocks += 1
            cache._pending.request.alloc_new_blocks += 1
            for _, _, lgs in by_pg.values():
                for lg in lgs:
                    cache._pending.layer_group(lg).iter_alloc_total_blocks += 1
                    cache._pending.layer_group(lg).iter_alloc_new_blocks += 1
            self._mark_pending(cache)
        cache._partial_src = None
        self._tree.touch(src_node)
        return True

    def _insert_committed(self, cache: KVCache, priority: int | None) -> None:
        """Key the cache's newly full blocks and enter them into the tree (adopting duplicates).

        The new blocks are, in order, some the tree already has (adopted one by one), then either a
        chain of blocks new to the tree (entered in one batch: one reference-count update per pool
        group, one Stored per run of blocks with the same layer groups) or, when the block before them
        left the tree, blocks that cannot be entered at all."""
        tpb = self._layout.tokens_per_block
        full = cache.num_committed_tokens // tpb
        have = len(cache._keys)
        if full <= have:
            return
        toks = cache._tokens
        known = min(full, len(cache._prompt_keys))
        upto = have
        if known > have and cache.input_tokens is not None:
            diff = np.flatnonzero(toks[have * tpb:known * tpb] != cache.input_tokens[have * tpb:known * tpb])
            upto = known if not diff.size else have + int(diff[0]) // tpb
        new_keys = cache._prompt_keys[have:upto]
        parent_key = cache._keys[-1] if cache._keys else cache._root_key
        if upto > have:
            parent_key = new_keys[-1]
        new_keys += self._keys(cache, toks[upto * tpb:full * tpb], parent_key, first_block=upto)
        pages = np.stack([blocks[have:full] for blocks in cache._blocks], axis=1)
        root_key = cache._root_key
        cache._keys.extend(new_keys)
        swaps: dict[int, tuple[list[int], list[int]]] = {}
        b = have
        try:
            while b < full:
                parent = cache._tree_nodes[b - 1] if b > 0 else None
                if b > 0 and (parent is None or parent.removed):
                    cache._tree_nodes.extend([None] * (full - b))    # the chain cannot continue in the tree
                    return
                node = self._tree.child(root_key, parent, new_keys[b - have])
                if node is None:
                    break
                self._adopt(cache, b, node, swaps)
                old = node.priority
                if priority is not None and self._tree.set_priority(node, priority):
                    self._events.put(Updated((node.key,), self._node_medium(node), priority, old_priority=old))
                self._tree.touch(node)
                cache._tree_nodes.append(node)
                b += 1
        finally:
            for pg, (theirs, mine) in swaps.items():
                self._allocators[pg].incref(np.array(theirs, dtype=np.int32))
                self._allocators[pg].decref_each(np.array(mine, dtype=np.int32))
        if b < full:
            self._enter_chain(cache, b, new_keys[b - have:], pages[b - have:],
                              DEFAULT_PRIORITY if priority is None else priority)

    def _enter_chain(self, cache: KVCache, first: int, keys: list[bytes], pages: IntArray, priority: int) -> None:
        """Enter the cache's blocks ``first, first + 1, ...`` (keys ``keys``, primary pages ``pages[i]``
        per layer group, -1: none) into the tree as a chain of new blocks, give the tree its references
        and emit their Stored events (one per run of consecutive blocks holding the same layer groups,
        as the queue would have merged them)."""
        tpb = self._layout.tokens_per_block
        n = len(keys)
        stop = first + n
        parent = cache._tree_nodes[first - 1] if first > 0 else None
        toks = cache._tokens
        live = [np.flatnonzero(pages[:, lg] >= 0) for lg in range(pages.shape[1])]
        for lg, rows in enumerate(live):       # a new block's page cannot be a tree page already
            pg = self._lg_pool_group[lg]
            taken = pages[rows, lg][self._in_tree_t[0][pg][pages[rows, lg]]]
            if taken.size:
                raise KVCacheError(f"pool group {pg}: slot {int(taken[0])} of tier 0 is already a tree page")
        nodes = self._tree.insert_chain(cache._root_key, parent, keys, toks[first * tpb:stop * tpb].reshape(n, tpb),
                                        pages, [b in cache._extra_keys for b in range(first, stop)], priority=priority)
        cache._tree_nodes.extend(nodes)
        by_pg: dict[int, list[IntArray]] = {}
        for lg, rows in enumerate(live):
            pg = self._lg_pool_group[lg]
            slots = pages[rows, lg]
            self._in_tree_t[0][pg][slots] = True
            self._tree_owner[0][pg].update(zip(slots.tolist(), [(nodes[i], lg) for i in rows.tolist()], strict=True))
            by_pg.setdefault(pg, []).append(slots)
        for pg, parts in by_pg.items():
            self._allocators[pg].incref(np.concatenate(parts))
        present = pages >= 0
        starts = [0, *(np.flatnonzero((present[1:] != present[:-1]).any(axis=1)) + 1).tolist()]
        scope = cache.reuse_scope
        for s, e in zip(starts, [*starts[1:], n], strict=True):
            row = present[s]
            groups = None if row.all() else tuple(np.flatnonzero(row).tolist())
            parent_hash = (None if parent is None else parent.key) if s == 0 else keys[s - 1]
            self._events.put(Stored(parent_hash, tuple(keys[s:e]),
                                    tuple(toks[(first + s) * tpb:(first + e) * tpb].tolist()), tpb, scope.lora_id,
                                    self._medium, stored_extra_keys(first + s, e - s, scope.salt, cache._extra_keys),
                                    groups))

    def _mark_tree_pages(self, node: BlockNode, layer_groups: Sequence[int] | range) -> None:
        """Give the tree its reference on ``node``'s page of each listed layer group."""
        for lg in layer_groups:
            page, tier = int(node.pages[lg]), int(node.tiers[lg])
            if page >= 0:
                pg = self._lg_pool_group[lg]
                if self._in_tree_t[tier][pg][page]:
                    raise KVCacheError(f"pool group {pg}: slot {page} of tier {tier} is already a tree page")
                self._alloc_of(tier, pg).incref(np.array([page], dtype=np.int32))
                self._in_tree_t[tier][pg][page] = True
                self._tree_owner[tier][pg][page] = (node, lg)

    def _adopt(self, cache: KVCache, block: int, node: BlockNode, swaps: dict[int, tuple[list[int], list[int]]]) -> None:
        """A committed block duplicating ``node``: use the tree's pages and free the cache's own;
        a page the tree lacks (sliding window) is taken from the cache. A tree page in a colder tier
        is not adopted (an active request's pages stay primary): the cache keeps its own. The reference
        swaps are left in ``swaps`` (pool group -> (tree pages to take, own pages to let go, in order))
        for the caller to apply in one step."""
        for lg, blocks in enumerate(cache._blocks):
            mine, theirs = int(blocks[block]), int(node.pages[lg])
            pg = self._lg_pool_group[lg]
            if theirs >= 0 and node.tiers[lg] != 0:
                continue
            if theirs >= 0 and mine >= 0 and mine != theirs:
                take, drop = swaps.setdefault(pg, ([], []))
                take.append(theirs)
                drop.append(mine)
                blocks[block] = theirs
            elif theirs < 0 <= mine:
                node.pages[lg] = mine
                node.tiers[lg] = cache._tiers[lg][block]
                self._mark_tree_pages(node, [lg])
                parent = node.parent
                self._events.put(Stored(None if parent is None or parent.is_root else parent.key, (node.key,),
                                        tuple(node.tokens.tolist()), self._layout.tokens_per_block,
                                        cache.reuse_scope.lora_id, self._media[int(node.tiers[lg])],
                                        stored_extra_keys(block, 1, cache.reuse_scope.salt, cache._extra_keys),
                                        layer_group_subset([i == lg for i in range(len(cache._blocks))])))

    def _drop_window_pages(self, cache: KVCache, layer_group: int, start: int, released: IntArray,
                           tiers: TierArray) -> None:
        """The tree lets go of the sliding-window pages a request just released for blocks
        [start, start + len(released)) once no other request holds them (the node keeps -1 there),
        so window memory is not pinned by the tree; a node left without pages is requeued. One
        reference drop per tier, one Removed per run of blocks of one medium."""
        pg = self._lg_pool_group[layer_group]
        nodes = cache._tree_nodes[start:start + released.size]
        drops: dict[int, list[int]] = {}
        run: list[bytes]
        groups = layer_group_subset([i == layer_group for i in range(len(self._layout.layer_groups))])
        run_tier, run = -1, []    # the Removed being built: its tier and block keys
        touched: list[BlockNode | None] = []
        for node, page, tier in zip(nodes, released.tolist(), tiers.tolist(), strict=False):
            if node is None or node.removed or page < 0 or int(node.pages[layer_group]) != page \
                    or int(node.tiers[layer_group]) != tier:
                continue
            if self._in_tree_t[tier][pg][page] and self._alloc_of(tier, pg).refcount[page] == 1:
                drops.setdefault(tier, []).append(page)
                self._unmark_tree_page(tier, pg, page)
                node.pages[layer_group] = -1
                if tier != run_tier and run:
                    self._events.put(Removed(tuple(run), self._media[run_tier], groups))
                    run = []
                run_tier = tier
                run.append(node.key)
            touched.append(node)
        if run:
            self._events.put(Removed(tuple(run), self._media[run_tier], groups))
        for tier, pages in drops.items():
            self._alloc_of(tier, pg).decref_each(np.array(pages, dtype=np.int32))
        self._tree.touch_all(touched)

    def _set_priority(self, cache: KVCache, priority: int) -> None:
        with self._lock:
            for node in cache._tree_nodes:
                old = None if node is None else node.priority
                if node is not None and self._tree.set_priority(node, priority):
                    self._events.put(Updated((node.key,), self._node_medium(node), priority, old_priority=old))

    def _touch_blocks(self, cache: KVCache, start: int, stop: int) -> None:
        """Requeue the tree blocks tied to the cache's blocks [start, stop) for eviction."""
        self._tree.touch_all(cache._tree_nodes[start:stop])

    def reset_prefix_tree(self) -> bool:
        """Drop every block of the prefix tree (one AllCleared event); False, changing nothing, while
        a request still shares one of its pages."""
        with self._lock:
            nodes = list(self._tree.nodes())
            if any(not self._tree_only(n) for n in nodes):
                return False
            self._clear_tree(nodes)
            return True

    def _clear_tree(self, nodes: list[BlockNode]) -> None:
        self._tree.clear()
        if not nodes:
            return
        pages = np.stack([n.pages for n in nodes])
        tiers = np.stack([n.tiers for n in nodes])
        for lg in range(pages.shape[1]):
            pg = self._lg_pool_group[lg]
            for tier in range(len(self._tiers)):
                col = pages[:, lg][(pages[:, lg] >= 0) & (tiers[:, lg] == tier)]
                self._alloc_of(tier, pg).decref(col)
                self._in_tree_t[tier][pg][col] = False
        for per_tier in self._tree_owner:
            for owners in per_tier:
                owners.clear()
        self._events.put(AllCleared())
