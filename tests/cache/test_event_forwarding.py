"""The manager's events as a ``KVCacheEventManager`` receives them (``ReferenceEventForwarder``): stored
blocks reach it as prefix-tree blocks, so multimodal digests are token ids as hex with ``mm_keys``,
never the manager's internal digest codes, and removals and updates find the blocks they name.

The expected events come from a second event manager fed the same chain of stand-in blocks directly,
the way a prefix tree hands its blocks over (tests/cache/test_event_manager.py's ``block``).
"""

from __future__ import annotations

from typing import Any

from kvxfer.cache import (
    AttentionLayerConfig,
    BufferConfig,
    DataRole,
    GpuCacheTierConfig,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    LayerConfig,
    LayerId,
    MmItemContext,
)
from kvxfer.cache.hashing import ReuseScope, hash_v1_block_key
from tests.cache.test_event_manager import IMG, IMG2, block, drain

TPB = 4


def manager(em: Any, *, windows: tuple[int | None, ...] = (None,), blocks: int = 64, **kw: Any) -> KVCacheManager:
    """One key buffer per layer (one layer per window), room for ``blocks`` blocks in every layer group."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(LayerId(i), [BufferConfig(DataRole("key"), TPB * 16)], sliding_window_size=w,
                             num_sink_tokens=0 if w is not None else None) for i, w in enumerate(windows)]
    quota = TPB * 16 * len(windows) * blocks
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, cache_tiers=[GpuCacheTierConfig(quota)],
                                               layers=layers, **kw), event_manager=em)


def commit(mgr: KVCacheManager, tokens: list[Any], scope: ReuseScope | None = None) -> None:
    kv = mgr.create_kv_cache(scope, tokens)
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens[kv.num_committed_tokens:])
    kv.close()


def stored_hashes(events: list[dict[str, Any]]) -> list[Any]:
    return [b["block_hash"] for e in events if e["data"]["type"] == "stored" for b in e["data"]["blocks"]]


def removed_hashes(events: list[dict[str, Any]]) -> list[Any]:
    return [h for e in events if e["data"]["type"] == "removed" for h in e["data"]["block_hashes"]]


def test_digest_tokens_are_published_as_digests_with_their_mm_keys() -> None:
    em = KVCacheEventManager(32, window_size=128, mm_token_id_offset=1000)
    mgr = manager(em)
    tokens: list[Any] = [0, MmItemContext(IMG, "img-1"), 1001, 1002, 1003, 5, 6, 7, 1004, 1005, IMG2, 1001]
    commit(mgr, tokens)
    got = drain(em)

    oracle = KVCacheEventManager(32, window_size=128, mm_token_id_offset=1000)
    b0 = block(tokens[0:4])
    b1 = block(tokens[4:8], b0)
    b2 = block(tokens[8:12], b1)
    for b in (b0, b1, b2):
        oracle.add_stored_block_event_from_block(b)
    assert got == drain(oracle)

    blocks = [b for e in got for b in e["data"]["blocks"]]
    assert [t["token_id"] for t in blocks[0]["tokens"]] == [0, IMG.hex(), 1001, 1002]
    assert all(not isinstance(t["token_id"], int) or t["token_id"] >= 0 for b in blocks for t in b["tokens"])
    img = {"type": "mm_key", "hash": IMG.hex(), "uuid": "img-1"}
    assert [b["mm_keys"] for b in blocks] == [
        [{**img, "start_offset": 0}],
        [{**img, "start_offset": 3}],                       # the item carries over from the parent block
        [{**img, "start_offset": 4}, {"type": "mm_key", "hash": IMG2.hex(), "start_offset": 0}]]
    assert [e["layer_group_id"] for e in got] == [0]


def test_a_continuing_request_finds_the_item_of_an_earlier_event() -> None:
    em = KVCacheEventManager(32, window_size=128, mm_token_id_offset=1000)
    mgr = manager(em)
    tokens: list[Any] = [7, IMG, 1001, 1002, 1003, 1004, 8, 9]
    commit(mgr, tokens[:4])
    drain(em)
    commit(mgr, tokens)                                    # reuses block 0, stores block 1 after it
    (event,) = drain(em)
    (stored,) = event["data"]["blocks"]
    assert [t["token_id"] for t in stored["tokens"]] == [1003, 1004, 8, 9]
    assert stored["mm_keys"] == [{"type": "mm_key", "hash": IMG.hex(), "start_offset": 3}]


def test_removed_blocks_are_published_with_their_stored_hashes() -> None:
    em = KVCacheEventManager(32, window_size=128)
    mgr = manager(em, blocks=4)
    commit(mgr, list(range(8)))
    first = stored_hashes(drain(em))
    assert len(first) == 2
    commit(mgr, list(range(100, 116)))                     # four more blocks: the first two are evicted
    events = drain(em)
    assert sorted(removed_hashes(events)) == sorted(first)
    mgr.clear_reusable_blocks()
    assert sorted(removed_hashes(drain(em))) == sorted(stored_hashes(events))


def test_layer_groups_and_v1_hashes_with_a_salt() -> None:
    em = KVCacheEventManager(32, window_size=128, hash_algo="v1_block_key")
    mgr = manager(em, windows=(8, None), commit_min_snapshot=True)
    tokens = list(range(1, 13))
    commit(mgr, tokens, ReuseScope(salt=123))
    events = drain(em)
    h0 = hash_v1_block_key(tokens[0:4], 0, None, 123)
    h1 = hash_v1_block_key(tokens[4:8], h0, None, 123)
    h2 = hash_v1_block_key(tokens[8:12], h1, None, 123)
    by_group: dict[int, list[Any]] = {}
    for e in events:
        if e["data"]["type"] == "stored":
            by_group.setdefault(e["layer_group_id"], []).extend(b["block_hash"] for b in e["data"]["blocks"])
    assert by_group[1] == [h0, h1, h2]                     # full attention keeps every block
    assert set(by_group[0]) <= {h0, h1, h2} and h2 in by_group[0]
    dropped = [(e["layer_group_id"], h) for e in events if e["data"]["type"] == "removed"
               for h in e["data"]["block_hashes"]]
    assert dropped and all(g == 0 for g, _ in dropped)     # only window pages went
    mgr.clear_reusable_blocks()
    gone = [(e["layer_group_id"], h) for e in drain(em) if e["data"]["type"] == "removed"
            for h in e["data"]["block_hashes"]]
    assert sorted(h for g, h in gone if g == 1) == sorted([h0, h1, h2])


class RecordsOnly:
    """An event manager with the record hooks only (no prefix-tree block hooks)."""

    def __init__(self) -> None:
        self.blocks: list[Any] = []

    def add_stored_event(self, parent: Any, blocks: Any, layer_group_id: Any = None) -> None:
        self.blocks.extend(blocks)

    def add_removed_event(self, hashes: Any) -> None:
        pass

    def add_updated_event(self, block_hash: Any, **kw: Any) -> None:
        pass


def test_record_hooks_get_digests_as_hex_token_ids() -> None:
    em = RecordsOnly()
    mgr = manager(em)
    commit(mgr, [3, IMG, 1001, 4])
    (stored,) = em.blocks
    assert [t.token_id for t in stored.tokens] == [3, IMG.hex(), 1001, 4]


def test_priority_updates_name_the_stored_blocks() -> None:
    em = KVCacheEventManager(32, window_size=128)
    mgr = manager(em)
    tokens = list(range(8))
    commit(mgr, tokens)
    stored = stored_hashes(drain(em))
    kv = mgr.create_kv_cache()                        # no reuse match: its commit duplicates the tree's blocks
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens, priority=80)
    kv.close()
    updated = [(e["layer_group_id"], e["data"]["block_hash"], e["data"]["priority"])
               for e in drain(em) if e["data"]["type"] == "updated"]
    diff = {"type": "event_diff", "old_value": 35, "new_value": 80}
    assert sorted(updated, key=str) == sorted([(0, h, diff) for h in stored], key=str)
