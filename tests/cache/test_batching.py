"""The batched bookkeeping of commit and eviction equals the one-by-one steps it replaced: ``decref_each``
against per-id ``decref``, the queue's deferred merging against merging each event as it comes,
``insert_chain`` against one ``insert`` per block, and a whole request's commit / eviction against its
block-by-block form on a larger tree than the golden workload's."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.cache.allocator import SlotAllocator
from kvxfer.cache.events import EventQueue, KVEvent, Removed, Stored, Updated
from kvxfer.cache.radix_tree import PrefixTree
from kvxfer.errors import BlockIdError, KVCacheError
from tests.support.reuse_support import make_manager

KEYS = [bytes([i]) * 4 for i in range(12)]


# --- SlotAllocator.decref_each ----------------------------------------------------------------------
@given(st.data())
def test_decref_each_equals_one_decref_per_id(data: st.DataObject) -> None:
    one, batch = SlotAllocator(24), SlotAllocator(24)
    held = one.alloc(20)
    batch.alloc(20)
    extra = data.draw(st.lists(st.sampled_from(held.tolist()), max_size=12))
    if extra:
        one.incref(np.array(extra, dtype=np.int32))
        batch.incref(np.array(extra, dtype=np.int32))
    pool = held.tolist() + extra        # every reference may be dropped once
    order = data.draw(st.permutations(pool))
    ids = order[:data.draw(st.integers(0, len(order)))]
    freed_one = [int(f) for i in ids for f in one.decref(np.array([i], dtype=np.int32)).tolist()]
    freed_batch = batch.decref_each(np.array(ids, dtype=np.int32)).tolist()
    assert freed_batch == freed_one
    np.testing.assert_array_equal(batch.refcount, one.refcount)
    assert batch._free[:batch._top].tolist() == one._free[:one._top].tolist()
    assert batch.alloc(batch.num_free).tolist() == one.alloc(one.num_free).tolist()


def test_decref_each_refuses_a_release_beyond_the_references_changing_nothing() -> None:
    alloc = SlotAllocator(8)
    ids = alloc.alloc(3)
    with pytest.raises(BlockIdError, match="released more often"):
        alloc.decref_each(np.array([ids[0], ids[1], ids[1]], dtype=np.int32))
    assert alloc.refcount[ids].tolist() == [1, 1, 1] and alloc.num_free == 5
    with pytest.raises(BlockIdError, match="outside"):
        alloc.decref_each(np.array([8], dtype=np.int32))


# --- EventQueue: deferred merging -----------------------------------------------------------------
def _reference_merge(last: KVEvent, new: KVEvent) -> KVEvent | None:
    """The queue's merge rule applied one event at a time (how the queue worked before it deferred)."""
    if isinstance(last, Stored) and isinstance(new, Stored):
        if new.parent_hash is not None and new.parent_hash == last.block_hashes[-1] and (
                new.block_size, new.lora_id, new.medium, new.layer_groups) == (
                last.block_size, last.lora_id, last.medium, last.layer_groups):
            extra = None
            if last.extra_keys is not None or new.extra_keys is not None:
                extra = ((last.extra_keys or (None,) * len(last.block_hashes))
                         + (new.extra_keys or (None,) * len(new.block_hashes)))
            return dataclasses.replace(last, block_hashes=last.block_hashes + new.block_hashes,
                                       token_ids=last.token_ids + new.token_ids, extra_keys=extra)
        return None
    if isinstance(last, Removed) and isinstance(new, Removed) and (last.medium, last.layer_groups) == (
            new.medium, new.layer_groups):
        return dataclasses.replace(last, block_hashes=last.block_hashes + new.block_hashes)
    if isinstance(last, Updated) and isinstance(new, Updated) and (
            last.medium, last.priority, last.old_medium, last.old_priority, last.layer_groups) == (
            new.medium, new.priority, new.old_medium, new.old_priority, new.layer_groups):
        return dataclasses.replace(last, block_hashes=last.block_hashes + new.block_hashes)
    return None


def _reference_queue(capacity: int, script: list[KVEvent | None]) -> list[list[Any]]:
    """Drained batches (``None`` in ``script`` drains) of a queue merging each event as it comes."""
    queue: list[KVEvent] = []
    dropped = next_id = 0
    out: list[list[Any]] = []
    for event in script:
        if event is None:
            batch: list[Any] = [("dropped", dropped, (queue[0].event_id if queue else next_id) - 1)] if dropped else []
            out.append(batch + [(e, e.event_id) for e in queue])
            queue, dropped = [], 0
            continue
        merged = _reference_merge(queue[-1], event) if queue else None
        if merged is not None:
            queue[-1] = merged
            continue
        if len(queue) >= capacity:
            queue.pop(0)
            dropped += 1
        queue.append(dataclasses.replace(event, event_id=next_id))
        next_id += 1
    return out


def _events() -> st.SearchStrategy[KVEvent]:
    key = st.sampled_from(KEYS[:5])
    layer_groups = st.sampled_from([None, (0,), (1,)])
    medium = st.sampled_from(["GPU", "CPU"])
    stored = st.builds(
        lambda parent, keys, lg, med, lora, extra: Stored(
            parent, tuple(keys), tuple(range(2 * len(keys))), 2, lora, med,
            None if not extra else tuple((("mm", "ab"),) if i % 2 else None for i in range(len(keys))), lg),
        st.one_of(st.none(), key), st.lists(key, min_size=1, max_size=3), layer_groups, medium,
        st.sampled_from([None, 1]), st.booleans())
    removed = st.builds(lambda keys, lg, med: Removed(tuple(keys), med, lg), st.lists(key, min_size=1, max_size=3),
                        layer_groups, medium)
    updated = st.builds(lambda keys, pr, old: Updated(tuple(keys), "GPU", pr, old_priority=old),
                        st.lists(key, min_size=1, max_size=2), st.sampled_from([None, 10]), st.sampled_from([None, 35]))
    return st.one_of(stored, removed, updated)


@given(st.integers(1, 4), st.lists(st.one_of(st.none(), _events()), max_size=40))
def test_queue_drains_what_merging_one_event_at_a_time_drains(capacity: int, script: list[KVEvent | None]) -> None:
    queue = EventQueue(capacity)
    got: list[list[Any]] = []
    for event in [*script, None]:
        if event is None:
            got.append([("dropped", e.count, e.event_id) if type(e).__name__ == "EventsDropped" else (e, e.event_id)
                        for e in queue.drain()])
        else:
            queue.put(event)
    assert got == _reference_queue(capacity, [*script, None])


# --- PrefixTree.insert_chain -------------------------------------------------------------------------
def _tree_state(tree: PrefixTree) -> list[Any]:
    nodes = sorted(([n.key, n.parent.key if n.parent else None, n.depth, n.tokens.tolist(), n.pages.tolist(),
                     n.tiers.tolist(), n.has_extra_key, n.priority, n.last_used] for n in tree.nodes()),
                   key=lambda r: r[0])
    order = []
    while (leaf := tree.pop_leaf()) is not None:     # the eviction order, leaves freed as they go
        order.append(leaf.key)
        tree.remove(leaf)
    return [nodes, order]


def test_insert_chain_equals_one_insert_per_block() -> None:
    one, chain = PrefixTree(2, 2), PrefixTree(2, 2)
    for tree in (one, chain):
        first = tree.insert(b"root", None, KEYS[0], np.array([1, 2]), np.array([0, 1]))
        tree.insert(b"root", first, KEYS[9], np.array([3, 3]), np.array([7, 8]), priority=20)
    tokens = np.arange(12).reshape(6, 2)
    pages = np.arange(12, 24).reshape(6, 2)
    pages[2, 1] = -1
    extra = [False, True, False, False, False, True]
    parent = one.child(b"root", None, KEYS[0])
    for i in range(6):
        parent = one.insert(b"root", parent, KEYS[1 + i], tokens[i], pages[i], has_extra_key=extra[i], priority=50)
    nodes = chain.insert_chain(b"root", chain.child(b"root", None, KEYS[0]), KEYS[1:7], tokens, pages, extra,
                               priority=50)
    assert [n.key for n in nodes] == KEYS[1:7]
    assert nodes[3].tokens.base is None or nodes[3].tokens.base is not nodes[4].tokens.base   # no shared rows
    assert _tree_state(chain) == _tree_state(one)


def test_insert_chain_under_a_new_root_and_its_refusals() -> None:
    tree = PrefixTree(1, 2)
    nodes = tree.insert_chain(b"r", None, KEYS[:2], np.zeros((2, 2)), np.zeros((2, 1)), [False, False])
    assert tree.root(b"r") is nodes[0].parent and nodes[1].depth == 1 and tree.num_blocks == 2
    with pytest.raises(KVCacheError, match="already in the tree"):
        tree.insert_chain(b"r", None, KEYS[:1], np.zeros((1, 2)), np.zeros((1, 1)), [False])
    with pytest.raises(KVCacheError, match="expected 2 x 2 tokens"):
        tree.insert_chain(b"r", nodes[1], KEYS[5:7], np.zeros((2, 3)), np.zeros((2, 1)), [False, False])
    tree.remove(nodes[1])
    with pytest.raises(KVCacheError, match="was removed"):
        tree.insert_chain(b"r", nodes[1], KEYS[5:6], np.zeros((1, 2)), np.zeros((1, 1)), [False])
    assert tree.num_blocks == 1


def test_touch_all_equals_one_touch_per_node_across_heap_rebuilds() -> None:
    """Enough touches to rebuild the eviction queue several times: same stamps, same eviction order."""
    one, batch = PrefixTree(1, 2), PrefixTree(1, 2)
    for tree in (one, batch):
        tree.insert_chain(b"r", None, KEYS, np.zeros((12, 2)), np.arange(12).reshape(12, 1), [False] * 12)
    order = [KEYS[i * 7 % 12] for i in range(2500)]
    for key in order:
        one.touch(next(n for n in one.nodes() if n.key == key))
    by_key = {n.key: n for n in batch.nodes()}
    batch.touch_all([by_key[k] for k in order] + [None])
    assert _tree_state(batch) == _tree_state(one)


# --- the manager: commit chunk size does not show ---------------------------------------------------------
def _drive(mgr: Any, chunk: int) -> list[Any]:
    """Commit two 40-block prompts sharing 10 blocks (the second in ``chunk``-token commits, with a
    priority), then a third that evicts; returns what a consumer and the allocator see after each."""
    out: list[Any] = []
    base = np.arange(160) * 7 % 1000
    for i, prompt in enumerate([base, np.concatenate([base[:40], base[40:] + 1]), base + 5000]):
        kv = mgr.create_kv_cache_for_prompt(prompt)
        kv.resume()
        assert kv.resize(prompt.size)
        step = prompt.size if i == 0 else chunk
        for s in range(kv.num_committed_tokens, prompt.size, step):
            kv.commit(prompt[s:s + step], priority=60 if i == 1 else None)
        kv.close()
        alloc = mgr._state.allocators[0]
        out.append([[(type(e).__name__, e.event_id, dataclasses.astuple(e)) for e in mgr.drain_events()],
                    alloc.refcount.tolist(), alloc._free[:alloc._top].tolist(), mgr.tier_traffic(),
                    sorted((n.key, n.pages.tolist(), n.priority, n.last_used) for n in mgr._state.tree.nodes())])
    return out


def test_commit_chunk_size_changes_nothing_a_consumer_or_the_allocator_sees() -> None:
    """Events of separate commits merge as one commit's do, and the tree gets the same blocks, pages,
    priorities and LRU stamps, whether a prompt is committed whole or in chunks of any size."""
    whole = _drive(make_manager(90), 160)
    assert [e[0] for e in whole[1][0]] == ["Stored"] and len(whole[1][0][0][2][1]) == 30
    assert [e[0] for e in whole[2][0]] == ["Removed", "Stored"] and whole[2][3].dropped_blocks == 20
    for chunk in (4, 13, 61):
        assert _drive(make_manager(90), chunk) == whole


def test_commit_refuses_a_page_that_is_already_a_tree_page_before_entering_anything() -> None:
    """Mutation of the tree-page check: a new block whose page the tree already holds is an error,
    raised before any block of the chain enters the tree."""
    mgr = make_manager(16)
    kv = mgr.create_kv_cache_for_prompt(np.arange(12))
    kv.resume()
    assert kv.resize(12)
    mgr._state.in_tree_t[0][0][kv.block_ids(0)[1]] = True
    with pytest.raises(KVCacheError, match=f"slot {kv.block_ids(0)[1]} of tier 0 is already a tree page"):
        kv.commit(np.arange(12))
    assert mgr._state.tree.num_blocks == 0 and mgr._state.allocators[0].refcount.max() == 1
