"""KVCacheEventManager (TensorRT-LLM's v2 event contract): records, the pending/published queues, merging
and ordering, hash algorithms, prefix-tree blocks with life cycles and partial pages, multimodal keys,
attention-DP gathering and the JSON form.

Blocks here are small stand-ins of the ``EventSourceBlock`` protocol keyed with
``sequence_to_blockchain_keys``; expected hashes are computed independently (hashlib, the v1 oracle of
test_hashing.py).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvxfer.cache import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheEventManager,
    KVCacheEventSerializer,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    MmItemContext,
    UniqueToken,
)
from kvxfer.cache.event_manager import EventSourceBlock, event_to_json
from kvxfer.cache.hashing import ReuseScope, pack_key_tokens, reuse_scope_to_bytes
from kvxfer.errors import ConfigError
from tests.cache.test_hashing import v1_oracle

IMG = bytes(range(32))
IMG2 = bytes(range(32, 64))


@dataclass
class Page:
    cache_level: int = 0
    priority: int = 35
    num_tokens: int | None = None


@dataclass
class Root:
    reuse_scope: ReuseScope


@dataclass
class Block:
    tokens: list[Any]
    prev: Any
    storage: list[Any] = field(default_factory=list)
    key: bytes = b""


def root_key(node: Any) -> bytes:
    return node.key if isinstance(node, Block) else hashlib.sha256(reuse_scope_to_bytes(node.reuse_scope)).digest()


def block(tokens: Sequence[Any], parent: Any = None, pages: Sequence[Page | None] = (Page(),),
          scope: ReuseScope | None = None, by_ref: bool = True) -> Block:
    prev = parent if parent is not None else Root(scope or ReuseScope())
    storage = [p if p is None or not by_ref else (lambda p=p: p) for p in pages]
    b = Block(list(tokens), prev, storage)
    b.key = hashlib.sha256(root_key(prev) + pack_key_tokens(b.tokens)).digest()
    return b


def drain(em: KVCacheEventManager) -> list[dict[str, Any]]:
    em.flush_iteration_events()
    out = KVCacheEventSerializer.serialize(em.get_latest_events(0))
    assert isinstance(out, list)
    return out


def sbd(h: str, *tokens: int) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(h, [UniqueToken(t) for t in tokens], cache_level=0, priority=35)


# --- records ---------------------------------------------------------------------------------------------
def test_records_are_frozen_picklable_values() -> None:
    stored = KVCacheStoredData("p", [KVCacheStoredBlockData("b", [UniqueToken("ab", 2)], 1, 50,
                                                            [(IMG, 0, "u"), (IMG2, 3)], "tenant")])
    event = KVCacheEvent(9, stored, 64, "v2_sha256", 3, 1)
    for value in (event, stored, KVCacheUpdatedData("b", None, KVCacheEventDiff(1, 2)), KVCacheRemovedData([1, 2])):
        assert pickle.loads(pickle.dumps(value)) == value
    with pytest.raises(AttributeError):
        event.event_id = 10  # type: ignore[misc]
    with pytest.raises(TypeError):
        KVCacheUpdatedData("b", None)  # type: ignore[call-arg]
    assert KVCacheEventDiff(4, 6) == KVCacheEventDiff(old_value=4, new_value=6)


def test_exports_and_protocol() -> None:
    assert isinstance(block([1]), EventSourceBlock)
    assert not isinstance(Root(ReuseScope()), EventSourceBlock)


# --- queue ---------------------------------------------------------------------------------------------
def test_ids_and_stored_chains_merge_per_layer_group() -> None:
    em = KVCacheEventManager(16, window_size=32)
    em.add_created_event([5])
    em.add_stored_event(None, [sbd("a", 1)])
    em.add_stored_event("a", [sbd("b", 2)])                 # continues "a": merged, keeps id 1
    em.add_stored_event("x", [sbd("c", 3)])                 # does not continue: new event
    em.add_stored_event("b", [sbd("d", 4)], layer_group_id=2)  # another group: new event
    events = drain(em)
    assert [e["event_id"] for e in events] == [0, 1, 2, 3]
    assert [b["block_hash"] for b in events[1]["data"]["blocks"]] == ["a", "b"]
    assert events[2]["data"]["parent_hash"] == "x"
    assert events[3]["layer_group_id"] == 2 and "layer_group_id" not in events[1]


def test_no_merge_across_a_flush_or_another_event() -> None:
    em = KVCacheEventManager(16)
    em.add_stored_event(None, [sbd("a", 1)])
    first = drain(em)
    em.add_stored_event("a", [sbd("b", 2)])
    em.add_created_event([1])
    em.add_stored_event("b", [sbd("c", 3)])
    events = first + drain(em)
    assert [e["data"]["type"] for e in events] == ["stored", "stored", "created", "stored"]
    assert [len(e["data"].get("blocks", [])) for e in events] == [1, 1, 0, 1]


def test_removals_batch_and_precede_the_next_other_event() -> None:
    em = KVCacheEventManager(16)
    em.add_removed_event("r1")
    em.add_removed_event(["r2", 7])
    em.add_updated_event("u", priority=KVCacheEventDiff(35, 80))
    em.add_removed_event("r3")
    events = drain(em)
    assert [e["data"]["type"] for e in events] == ["removed", "updated", "removed"]
    assert events[0]["data"]["block_hashes"] == ["r1", "r2", 7]
    assert events[1]["data"]["cache_level"] is None
    assert events[1]["data"]["priority"] == {"type": "event_diff", "new_value": 80, "old_value": 35}
    assert [e["event_id"] for e in events] == [0, 1, 2]


def test_removal_breaks_a_stored_merge() -> None:
    em = KVCacheEventManager(16)
    em.add_stored_event(None, [sbd("a", 1)])
    em.add_removed_event("z")
    em.add_stored_event("a", [sbd("b", 2)])
    assert [e["data"]["type"] for e in drain(em)] == ["stored", "removed", "stored"]


def test_bounded_queue_drops_oldest_and_zero_disables() -> None:
    em = KVCacheEventManager(3)
    for n in range(5):
        em.add_created_event([n])
    em.flush_iteration_events()
    assert [e.event_id for e in em.get_latest_events(0)] == [2, 3, 4]
    off = KVCacheEventManager(0)
    off.add_created_event([1])
    off.add_stored_event(None, [sbd("a", 1)])
    off.add_removed_event("a")
    assert drain(off) == []


def test_updates_without_change_or_for_unknown_keys_are_ignored() -> None:
    em = KVCacheEventManager(8)
    em.add_updated_event("h")
    em.add_updated_event(b"\x00" * 32, cache_level=KVCacheEventDiff(0, 1))
    em.add_removed_event([b"\x01" * 32])
    em.add_removed_life_cycle_event(b"\x02" * 32, 0)
    assert drain(em) == []


def test_get_latest_events_timeouts() -> None:
    em = KVCacheEventManager(4)
    start = time.monotonic()
    assert em.get_latest_events(30) == []
    assert time.monotonic() - start >= 0.025
    assert em.get_latest_events(0) == [] and em.get_latest_events(-5) == []
    got: list[KVCacheEvent] = []
    reader = threading.Thread(target=lambda: got.extend(em.get_latest_events(None)))
    reader.start()
    time.sleep(0.05)
    assert reader.is_alive()
    em.add_created_event([2])
    assert reader.is_alive()                               # pending events are not published yet
    em.flush_iteration_events()
    reader.join(2)
    assert not reader.is_alive() and [e.data for e in got] == [KVCacheCreatedData([2])]


def test_window_sizes_per_layer_group() -> None:
    em = KVCacheEventManager(8, window_size=1024, window_size_by_layer_group={1: 64})
    em.add_created_event([1], layer_group_ids=[0, 1])
    em.set_layer_group_window_sizes({0: 16})
    em.add_created_event([1], layer_group_ids=[0, 1])
    em.add_created_event([1])
    assert [(e.get("layer_group_id"), e["window_size"]) for e in drain(em)] == [
        (0, 1024), (1, 64), (0, 16), (1, 1024), (None, 1024)]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="Unsupported V2 KV cache event hash algorithm: 'v2_md5'"):
        KVCacheEventManager(4, hash_algo="v2_md5")
    with pytest.raises(ConfigError, match="max_kv_event_entries"):
        KVCacheEventManager(-1)
    with pytest.raises(ConfigError, match="window size of layer group 0"):
        KVCacheEventManager(4, window_size_by_layer_group={0: -8})
    assert KVCacheEventManager(4, hash_algo="auto").hash_algo == "v1_block_key"


# --- blocks ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("by_ref", [True, False])
def test_block_hashes_under_each_algorithm(by_ref: bool) -> None:
    b0 = block([1, 2, 3], by_ref=by_ref)
    b1 = block([4, 5, 6], b0, by_ref=by_ref)
    expected = {
        "v2_sha256": [b0.key.hex(), b1.key.hex()],
        "v2_sha256_64": [int.from_bytes(b0.key[:8], "big"), int.from_bytes(b1.key[:8], "big")],
        "v2_blake3": [b0.key.hex(), b1.key.hex()],
        "v2_blake3_64": [int.from_bytes(b0.key[:8], "big"), int.from_bytes(b1.key[:8], "big")],
        "v1_block_key": [v1_oracle([1, 2, 3], 0, None, None),
                         v1_oracle([4, 5, 6], v1_oracle([1, 2, 3], 0, None, None), None, None)],
    }
    for algo, hashes in expected.items():
        em = KVCacheEventManager(8, hash_algo=algo)
        em.add_stored_block_event_from_block(b0)
        em.add_stored_block_event_from_block(b1)
        em.add_removed_event(b1.key)
        events = drain(em)
        assert [b["block_hash"] for b in events[0]["data"]["blocks"]] == hashes, algo
        assert events[0]["data"]["parent_hash"] is None and events[0]["hash_algo"] == algo
        assert events[1]["data"]["block_hashes"] == hashes[1:]


def test_v1_hashes_take_lora_and_salt_from_the_chain_root() -> None:
    scope = ReuseScope(lora_id=8, salt=99)
    b0 = block([1, 2], scope=scope)
    b1 = block([3, 4], b0)
    em = KVCacheEventManager(8, hash_algo="v1_block_key")
    em.add_stored_block_event_from_block(b1)                # parent first seen through its child
    em.add_stored_block_event_from_block(b0)
    h0 = v1_oracle([1, 2], 0, 8, 99)
    h1 = v1_oracle([3, 4], h0, 8, 99)
    events = drain(em)
    assert [(e["data"]["parent_hash"], e["data"]["blocks"][0]["block_hash"]) for e in events] == [(h0, h1),
                                                                                                  (None, h0)]


def test_a_root_carrying_a_key_and_no_tokens_is_still_the_root() -> None:
    @dataclass
    class KeyedRoot:
        reuse_scope: ReuseScope
        key: bytes = b"\x05" * 32
        tokens: tuple[int, ...] = ()

    b0 = block([1, 2], KeyedRoot(ReuseScope(salt=4)))
    b1 = block([3], None)
    b1.prev = None                                             # no root object at all: empty scope
    em = KVCacheEventManager(8, hash_algo="v1_block_key")
    em.add_stored_block_event_from_block(b0)
    em.add_stored_block_event_from_block(b1)
    events = drain(em)
    assert [e["data"]["parent_hash"] for e in events] == [None, None]
    assert [e["data"]["blocks"][0]["block_hash"] for e in events] == [v1_oracle([1, 2], 0, None, 4),
                                                                      v1_oracle([3], 0, None, None)]


def test_v1_chain_with_a_multimodal_digest_falls_back_to_truncated_keys() -> None:
    b0 = block([1, 2])
    b1 = block([3, IMG], b0)
    b2 = block([5, 6], b1)
    em = KVCacheEventManager(8, hash_algo="v1_block_key")
    for b in (b0, b1, b2):
        em.add_stored_block_event_from_block(b)
    hashes = [b["block_hash"] for e in drain(em) for b in e["data"]["blocks"]]
    assert hashes == [v1_oracle([1, 2], 0, None, None), int.from_bytes(b1.key[:8], "big"),
                      int.from_bytes(b2.key[:8], "big")]


def test_life_cycles_publish_only_whole_pages_and_are_removed_one_by_one() -> None:
    b = block([1, 2, 3], pages=[Page(), Page(num_tokens=2), Page(cache_level=1, priority=60)])
    em = KVCacheEventManager(16)
    em.add_stored_block_event_from_block(b)
    events = drain(em)
    assert [(e["layer_group_id"], e["data"]["blocks"][0]["cache_level"], e["data"]["blocks"][0]["priority"])
            for e in events] == [(0, 0, 35), (2, 1, 60)]
    em.add_stored_life_cycle_event_from_block(b, 1)           # still partial: nothing
    em.add_stored_life_cycle_event_from_block(b, 2)           # already published: nothing
    assert drain(em) == []
    em.add_removed_life_cycle_event(b.key, 2)
    em.add_removed_life_cycle_event(b.key, 2)
    em.add_updated_event(b.key, cache_level=KVCacheEventDiff(0, 1), layer_group_id=0)
    events = drain(em)
    assert [(e["data"]["type"], e["layer_group_id"]) for e in events] == [("removed", 2), ("updated", 0)]
    assert events[1]["data"]["block_hash"] == b.key.hex()
    em.add_removed_event(b.key)                               # only life cycle 0 is left
    assert [(e["data"]["type"], e["layer_group_id"]) for e in drain(em)] == [("removed", 0)]
    em.add_stored_life_cycle_event_from_block(b, 2)           # forgotten block: stored again in full
    assert [e["layer_group_id"] for e in drain(em)] == [0, 2]


def test_blocks_without_whole_pages_publish_nothing() -> None:
    em = KVCacheEventManager(8)
    em.add_stored_block_event_from_block(block([1, 2], pages=[None, Page(num_tokens=1)]))
    em.add_stored_block_event_from_block(block([1, 2], pages=[lambda: None], by_ref=False))  # type: ignore[list-item]
    assert drain(em) == []


def test_tokens_in_events() -> None:
    em = KVCacheEventManager(8)
    em.add_stored_block_event_from_block(block([4, IMG, MmItemContext(IMG2, "u")]))
    tokens = drain(em)[0]["data"]["blocks"][0]["tokens"]
    assert [t["token_id"] for t in tokens] == [4, IMG.hex(), IMG2.hex()]
    assert {t["token_extra_id"] for t in tokens} == {0}


# --- multimodal keys ----------------------------------------------------------------------------------------
def mm_keys(tokens_per_block: list[list[Any]], offset: int | None = 500,
            pages: Sequence[Page] = (Page(),)) -> list[list[dict[str, Any]]]:
    em = KVCacheEventManager(32, mm_token_id_offset=offset)
    parent = None
    for tokens in tokens_per_block:
        parent = block(tokens, parent, pages=pages)
        em.add_stored_block_event_from_block(parent)
    return [b["mm_keys"] for e in drain(em) for b in e["data"]["blocks"]]


def test_mm_item_spanning_blocks_gets_one_entry_per_run() -> None:
    item = MmItemContext(IMG, "pic")
    got = mm_keys([[7, item, 501], [502, 503, 504], [505, 8, 506]])
    entry = {"type": "mm_key", "hash": IMG.hex(), "uuid": "pic"}
    assert got == [[{**entry, "start_offset": 0}], [{**entry, "start_offset": 2}],
                   [{**entry, "start_offset": 5}, {**entry, "start_offset": 6}]]


def test_mm_items_switch_on_a_new_digest_and_gaps_split_runs() -> None:
    got = mm_keys([[IMG, 501, 503], [IMG2, 501, 9]])
    assert got == [
        [{"type": "mm_key", "hash": IMG.hex(), "start_offset": 0},
         {"type": "mm_key", "hash": IMG.hex(), "start_offset": 3}],
        [{"type": "mm_key", "hash": IMG2.hex(), "start_offset": 0}],
    ]


def test_mm_item_is_found_through_unpublished_ancestors() -> None:
    em = KVCacheEventManager(8, mm_token_id_offset=500)
    b0 = block([1, IMG], pages=[Page(num_tokens=1)])         # never published
    b1 = block([2, 3], b0, pages=[Page(num_tokens=1)])       # never published
    b2 = block([504, 505], b1)
    for b in (b0, b1, b2):
        em.add_stored_block_event_from_block(b)
    events = drain(em)
    assert len(events) == 1
    assert events[0]["data"]["parent_hash"] == b1.key.hex()
    assert events[0]["data"]["blocks"][0]["mm_keys"] == [{"type": "mm_key", "hash": IMG.hex(), "start_offset": 4}]


def test_no_mm_keys_without_an_offset_or_an_item() -> None:
    assert mm_keys([[IMG, 501]], offset=None) == [[]]
    assert mm_keys([[501, 502]]) == [[]]                     # synthetic-looking ids with no item before


# --- attention DP and JSON ---------------------------------------------------------------------------------
def test_attention_dp_rank_zero_publishes_every_rank() -> None:
    sent: list[list[KVCacheEvent]] = []
    other = [KVCacheEvent(0, KVCacheCreatedData([7]), 0, "v2_sha256", 1)] * 3

    def gather(local: list[KVCacheEvent]) -> list[list[KVCacheEvent]]:
        sent.append(local)
        return [local, other]

    em = KVCacheEventManager(2, attention_dp_rank=0, attention_dp_gather=gather)
    for n in range(3):
        em.add_created_event([n])
    events = drain(em)
    assert [e.data.num_blocks_per_cache_level for e in sent[0]] == [[1], [2]]     # trimmed to capacity
    assert [(e["attention_dp_rank"], e["data"]["num_blocks_per_cache_level"]) for e in events] == [
        (0, [1]), (0, [2]), (1, [7]), (1, [7])]


def test_attention_dp_other_ranks_only_send() -> None:
    sent: list[list[KVCacheEvent]] = []
    em = KVCacheEventManager(4, attention_dp_rank=3, attention_dp_gather=lambda local: sent.append(local) or [])
    em.add_created_event([1])
    assert drain(em) == [] and [e.attention_dp_rank for e in sent[0]] == [3]


def test_json_form() -> None:
    stored = KVCacheStoredData(None, [KVCacheStoredBlockData(5, [UniqueToken(3)], 1, 20, [(IMG, 2, None)], "t")])
    out = event_to_json(KVCacheEvent(4, stored, 128))
    assert out == {"event_id": 4, "window_size": 128, "data": {"type": "stored", "parent_hash": None, "blocks": [{
        "type": "stored_block", "block_hash": 5, "cache_level": 1, "priority": 20, "cache_salt": "t",
        "tokens": [{"type": "unique_token", "token_id": 3, "token_extra_id": 0}],
        "mm_keys": [{"type": "mm_key", "hash": IMG.hex(), "start_offset": 2}]}]}}
    assert json.loads(json.dumps(out)) == out
    assert KVCacheEventSerializer.serialize(None) is None
    single = KVCacheEventSerializer.serialize(KVCacheEvent(1, KVCacheRemovedData(["a"]), 8, None, 2, 0))
    assert single == {"event_id": 1, "window_size": 8, "attention_dp_rank": 2, "layer_group_id": 0,
                      "data": {"type": "removed", "block_hashes": ["a"]}}
