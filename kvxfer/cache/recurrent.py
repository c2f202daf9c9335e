"""The manager's recurrent (SSM) states: one state slot per request in the recurrent layer group, and
snapshots of it in the prefix tree.

A recurrent layer group's block-id list holds one entry, the request's live state slot, whatever the
request's length. It is taken at the first ``resume``, kept (offloaded like any held page) while the
request is suspended, and let go at ``close``.

Reuse: a commit whose committed length ends on a block boundary copies the live state into a new slot,
the recurrent layer group's page of the tree block where the committed prefix ends (a block that already
has one keeps it). A commit ending inside a block gives that partial block (a tail block of the tree) a
snapshot recorded after that many of its tokens (prefix_reuse.enter_tail). A prefix match then ends at the
last snapshot it reaches (the attention layer groups' pages must exist too). The new request holds that snapshot
until its first ``resume`` copies it into a private slot (an intra-device copy), so that its own
computation never writes the tree's page. Under ``commit_min_snapshot`` (required with recurrent layers)
a commit must start or end at ``history_length``: then the state the request holds is the state after
its committed tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.cache.kv_cache import KVCache
from kvxfer.cache.manager_state import ManagerState
from kvxfer.cache.stats import SsmSnapshotIterationStatsDelta
from kvxfer.errors import ContractError, OutOfSlotsError

IntArray = npt.NDArray[np.int32]


class RecurrentStates:
    """The recurrent layer group's state slots and snapshots."""

    def __init__(self, state: ManagerState, parts: Any) -> None:
        """``parts``: the manager's ``ManagerParts``, through which this part reaches the others."""
        self.state = state
        self.parts = parts

    @property
    def groups(self) -> list[int]:
        """The recurrent layer groups (none, or one)."""
        return [lg.layer_group_id for lg in self.state.layout.layer_groups if lg.recurrent]

    def is_recurrent(self, layer_group: int) -> bool:
        """Whether ``layer_group`` is a recurrent layer group."""
        return bool(self.state.layout.layer_groups[layer_group].recurrent)

    # --- the live state slot ----------------------------------------------------------------------------
    def resume_needs(self, cache: KVCache) -> dict[int, int]:
        """Primary slots ``activate`` will take, per pool group: a state slot for a request that has
        none yet or still holds the tree's snapshot."""
        needs: dict[int, int] = {}
        for lg in self.groups:
            if cache.record.blocks[lg].size == 0 or lg in cache.record.ssm_shared:
                pg = self.state.lg_pool_group[lg]
                needs[pg] = needs.get(pg, 0) + 1
        return needs

    def activate(self, cache: KVCache, stream: Any) -> bool:
        """Give the cache its own state slot in every recurrent layer group (at resume): a fresh one,
        or a private copy of the snapshot it reused. False, changing nothing, when no slot can be had."""
        needs = self.resume_needs(cache)
        if not needs:
            return True
        try:
            self.parts.eviction.reserve(needs)
        except OutOfSlotsError:
            return False
        for lg in self.groups:
            if cache.record.blocks[lg].size and lg not in cache.record.ssm_shared:
                continue
            pg = self.state.lg_pool_group[lg]
            dst = self.state.allocators[pg].alloc(1)
            self.parts.streams.wait_slots(lg, dst, stream)
            if cache.record.blocks[lg].size:                 # the reused snapshot: copy, then let it go
                src = cache.record.blocks[lg][:1].copy()
                self.copy(pg, src, dst, stream)
                self.state.allocators[pg].decref(src)
                self.parts.movement.count_copies(pg, "intra", 1, np.array([lg], dtype=np.int64))
                cache.record.ssm_shared.discard(lg)
            cache.record.blocks[lg] = dst.astype(np.int32)
            cache.record.tiers[lg] = np.zeros(1, dtype=np.int8)
        return True

    def copy(self, pool_group: int, src: IntArray, dst: IntArray, stream: Any) -> None:
        """Copy whole state slots ``src -> dst`` on ``stream``, after their last users."""
        target = self.parts.streams.stream_of(stream)
        with torch.cuda.stream(target) if target is not None else contextlib.nullcontext():
            if self.state.readiness is not None:
                self.state.readiness.wait_for(pool_group, np.concatenate([src, dst]), target)
            self.state.copy_slots(pool_group, src, dst)
            if self.state.readiness is not None:
                self.state.readiness.stamp(pool_group, np.concatenate([src, dst]), target)

    # --- commits and snapshots --------------------------------------------------------------------------
    def check_commit(self, cache: KVCache, num_new: int) -> None:
        """ContractError unless a commit of ``num_new`` tokens starts or ends at ``history_length``
        (with recurrent layers: the state the request holds is then the one after the commit)."""
        if not self.groups:
            return
        start = cache.num_committed_tokens
        history = cache.history_length
        if start != history and start + num_new != history:
            raise ContractError(f"KVCache {cache.id}.commit: with recurrent layers a commit must start or end at "
                                f"history_length={history}; it covers tokens [{start}, {start + num_new})")

    def snapshot_row(self, cache: KVCache, first: int, stop: int) -> int | None:
        """The block among ``[first, stop)`` that gets a snapshot on this commit: the last one when the
        committed prefix ends exactly there (None otherwise)."""
        tpb = self.state.layout.tokens_per_block
        n = cache.num_committed_tokens
        if not self.groups or n == 0 or n % tpb or not first < n // tpb <= stop:
            return None
        return n // tpb - 1

    def take_snapshot(self, cache: KVCache, layer_group: int) -> int:
        """A new primary slot holding a copy of the cache's live state of ``layer_group`` (reference
        count 1, which the caller hands to the tree); -1 when the cache has no live state or no slot can
        be had (the commit then leaves no snapshot)."""
        live = cache.record.blocks[layer_group]
        if live.size == 0 or layer_group in cache.record.ssm_shared or int(cache.record.tiers[layer_group][0]) != 0:
            return -1
        pg = self.state.lg_pool_group[layer_group]
        try:
            self.parts.eviction.reserve({pg: 1})
        except OutOfSlotsError:
            return -1
        dst = self.state.allocators[pg].alloc(1)
        self.copy(pg, live[:1].copy(), dst.astype(np.int32), cache.record.stream)
        return int(dst[0])

    # --- statistics --------------------------------------------------------------------------------------
    def count_lookup(self, cache: KVCache, num_tokens: int, reused: int) -> None:
        """Pending snapshot counters of a prefix lookup of ``num_tokens`` tokens that reused ``reused``."""
        if not self.groups or not self.state.stats.records(cache.id):
            return
        tpb = self.state.layout.tokens_per_block
        for lg in self.groups:
            delta = cache.record.pending.ssm.setdefault(lg, SsmSnapshotIterationStatsDelta())
            delta.iter_snapshot_lookups += 1
            if reused:
                delta.iter_snapshot_hits += 1
                if reused % tpb:
                    delta.iter_unaligned_snapshot_hits += 1
                else:
                    delta.iter_aligned_snapshot_hits += 1
            else:
                delta.iter_snapshot_misses += 1
            delta.iter_reused_tokens += reused
            delta.iter_unreused_tokens += max(0, num_tokens - reused)
        self.parts.usage.mark_pending(cache)
