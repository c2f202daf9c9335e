"""Property test: random interleavings of create (with reuse) / resume / resize / commit / history /
suspend / close never leak a slot, never hand one slot to two writers, and never lose reused KV.

A *writer* is an ACTIVE cache; its writable blocks are those at positions >= num_committed_tokens //
tokens_per_block (the block holding the next token onward). Every writable page must be referenced
by that cache alone (refcount 1) and must not be a prefix-tree page; committed blocks are read-only
and may be shared.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvxfer.cache import CacheState, KVCache, ReuseScope
from tests.support.reuse_support import TPB, check_kv, check_references, make_manager, write_kv

BASES = [np.arange(100, 124), np.arange(200, 224), np.concatenate([np.arange(100, 110), np.arange(300, 314)])]
SCOPES = [None, ReuseScope(lora_id=7)]
MAX_OPEN = 4


class ReuseMachine(RuleBasedStateMachine):
    """Drives one small manager (a full and a sliding-window layer group sharing one pool group)."""

    @initialize(windowed=st.booleans(), partial=st.booleans())
    def setup(self, windowed: bool, partial: bool) -> None:
        self.mgr = make_manager(8, windows=[None, 8] if windowed else None, enable_partial_reuse=partial)
        self.tokens: dict[str, np.ndarray] = {}
        self.caches: dict[str, KVCache] = {}
        self.prompts: list[tuple[np.ndarray, int]] = []

    def _pick(self, i: int) -> KVCache:
        return list(self.caches.values())[i % len(self.caches)]

    def _create(self, tokens: np.ndarray, scope: int) -> KVCache:
        kv = self.mgr.create_kv_cache_for_prompt(tokens, reuse_scope=SCOPES[scope])
        assert kv.state is CacheState.SUSPENDED
        assert kv.num_committed_tokens == kv.history_length == kv.num_reused_tokens < tokens.size
        check_kv(self.mgr, kv, tokens, 0, kv.num_reused_tokens)
        event("reuse: " + ("none" if not kv.num_reused_tokens else "partial" if kv.num_reused_tokens % TPB else "full"))
        self.caches[kv.id] = kv
        self.tokens[kv.id] = np.concatenate([tokens, np.arange(900, 916)])   # prompt, then "generated"
        self.prompts.append((tokens, scope))
        return kv

    def _resume(self, kv: KVCache) -> bool:
        before = kv.block_id_map()
        if not kv.resume():
            event("resume refused")
            assert kv.state is CacheState.SUSPENDED
            for g, ids in kv.block_id_map().items():
                np.testing.assert_array_equal(ids, before[g])
            return False
        check_kv(self.mgr, kv, self.tokens[kv.id], 0, kv.num_committed_tokens)   # copies hold the KV
        return True

    def _prefill(self, kv: KVCache) -> bool:
        prompt = kv.input_tokens
        assert prompt is not None
        if not self._resume(kv) or not kv.resize(prompt.size):
            event("prefill refused")
            return False
        write_kv(self.mgr, kv, prompt, kv.num_committed_tokens, prompt.size)
        kv.commit(prompt[kv.num_committed_tokens:])
        return True

    def _close(self, kv: KVCache) -> None:
        check_kv(self.mgr, kv, self.tokens[kv.id], 0, kv.num_committed_tokens)
        kv.close()
        del self.caches[kv.id]

    @precondition(lambda self: len(self.caches) < MAX_OPEN)
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 24), scope=st.integers(0, 1),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def create(self, base: int, cut: int, scope: int, tail: list[int]) -> None:
        self._create(np.concatenate([BASES[base][:cut], np.asarray(tail, dtype=np.int64)]), scope)

    @precondition(lambda self: len(self.caches) < MAX_OPEN)
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 24), scope=st.integers(0, 1),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=12), keep_open=st.booleans())
    def prefill(self, base: int, cut: int, scope: int, tail: list[int], keep_open: bool) -> None:
        """A whole prefill in one step: create, resume, resize, write and commit the prompt."""
        kv = self._create(np.concatenate([BASES[base][:cut], np.asarray(tail, dtype=np.int64)]), scope)
        if self._prefill(kv) and not keep_open:
            self._close(kv)

    @precondition(lambda self: self.prompts and len(self.caches) <= MAX_OPEN - 2)
    @rule(j=st.integers(0, 64), twins=st.booleans())
    def prefill_again(self, j: int, twins: bool) -> None:
        """An earlier prompt again: alone (its whole prompt matches) or as two requests created before
        either commits (the second commit duplicates the first's blocks)."""
        tokens, scope = self.prompts[j % len(self.prompts)]
        group = [self._create(tokens, scope) for _ in range(2 if twins else 1)]
        for kv in group:
            self._prefill(kv)

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, MAX_OPEN))
    def resume(self, i: int) -> None:
        self._resume(self._pick(i))

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, MAX_OPEN), blocks=st.integers(-2, 4))
    def resize(self, i: int, blocks: int) -> None:
        kv = self._pick(i)
        if kv.state is not CacheState.ACTIVE:
            return
        target = max(kv.history_length, min(kv.capacity + blocks * TPB, self.tokens[kv.id].size))
        free = self.mgr.num_free_slots()
        blocks_before = self.mgr.prefix_tree.num_blocks
        if not kv.resize(target):
            event("resize refused")
            assert self.mgr.num_free_slots() >= free   # a refused resize takes nothing (eviction may free)
        if self.mgr.prefix_tree.num_blocks < blocks_before:
            event("evicted")

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, MAX_OPEN), n=st.integers(1, 9), priority=st.integers(0, 100))
    def commit(self, i: int, n: int, priority: int) -> None:
        kv = self._pick(i)
        if kv.state is not CacheState.ACTIVE:
            return
        start = kv.num_committed_tokens
        stop = min(start + n, kv.capacity)
        tokens = self.tokens[kv.id]
        write_kv(self.mgr, kv, tokens, start, stop)
        kv.commit(tokens[start:stop], priority=priority)

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, MAX_OPEN), n=st.integers(1, 9))
    def advance_history(self, i: int, n: int) -> None:
        kv = self._pick(i)
        if kv.state is not CacheState.ACTIVE:
            return
        start = kv.history_length
        stop = min(start + n, kv.capacity)
        write_kv(self.mgr, kv, self.tokens[kv.id], start, stop)
        kv.history_length = stop

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, MAX_OPEN))
    def suspend(self, i: int) -> None:
        self._pick(i).suspend()

    @precondition(lambda self: self.caches)
    @rule(i=st.integers(0, MAX_OPEN))
    def close(self, i: int) -> None:
        self._close(self._pick(i))

    @invariant()
    def references_are_exact(self) -> None:
        if hasattr(self, "mgr"):
            check_references(self.mgr)

    @invariant()
    def one_writer_per_slot(self) -> None:
        if not hasattr(self, "mgr"):
            return
        layout = self.mgr.layout
        tree = {(layout.layer_groups[lg].pool_group_index, p) for n in self.mgr.prefix_tree.nodes()
                for lg, p in enumerate(n.pages.tolist()) if p >= 0}
        for kv in self.caches.values():
            if kv.state is not CacheState.ACTIVE:
                continue
            first = kv.num_committed_tokens // TPB
            for lg, ids in kv.block_id_map().items():
                pg = layout.layer_groups[lg].pool_group_index
                writable = ids[first:][ids[first:] >= 0]
                assert (self.mgr.allocator(pg).refcount[writable] == 1).all(), (kv.id, lg, writable)
                assert not any((pg, int(p)) in tree for p in writable), (kv.id, lg, writable)

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for kv in list(self.caches.values()):
            kv.close()
        for pg in range(len(self.mgr.layout.pool_groups)):
            acc = self.mgr.slot_accounting(pg)
            assert acc.request_only == acc.shared == 0
            assert acc.free + acc.evictable == acc.total
        assert self.mgr.reset_prefix_tree()
        assert all(self.mgr.slot_accounting(pg).free == self.mgr.slot_accounting(pg).total
                   for pg in range(len(self.mgr.layout.pool_groups)))


ReuseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                                 derandomize=True, database=None)
TestReuseInterleavings = ReuseMachine.TestCase
