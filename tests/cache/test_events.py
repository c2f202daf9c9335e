"""KV events: sequences for store / reuse / evict / update / clear, ids and drop markers of the bounded
queue, sliding-window drops, and each of vLLM's wire forms decoded by a subscriber built on that
version's struct options (tests/data/vllm_kv_events_schema.py) over real ZeroMQ PUB and replay ROUTER
sockets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvxfer.cache import (
    AllCleared,
    Created,
    EventsDropped,
    KVCacheManager,
    KVEventPublisher,
    Removed,
    ReuseScope,
    Stored,
    Updated,
    WireContext,
    block_hash_for_event,
    block_keys,
)
from kvxfer.cache.event_publisher import END_SEQ
from kvxfer.cache.event_wire import (
    WIRE_ARRAY,
    WIRE_MAP,
    WIRE_RELEASE,
    decode_batch,
    encode_batch,
    reference_events,
)
from kvxfer.cache.events import EventQueue, stored_extra_keys
from kvxfer.cache.hashing import HASH_ALGOS
from kvxfer.errors import ConfigError
from tests.data import vllm_kv_events_schema as VLLM
from tests.support.reuse_support import TPB, make_manager, prefill, write_kv


def drained(mgr: KVCacheManager) -> KVCacheManager:
    mgr.drain_events()          # the Created event of construction
    return mgr


# --- in-process events ----------------------------------------------------------------------------
def test_store_reuse_evict_sequence() -> None:
    mgr = make_manager(8)
    assert mgr.drain_events() == [Created(("CPU",), (8,))]
    scope = ReuseScope(lora_id=4)
    root = scope.root_key
    p = np.arange(10, 23)                                   # 13 tokens: 3 full blocks
    prefill(mgr, p, reuse_scope=scope)
    keys = block_keys(p, TPB, root)
    assert mgr.drain_events() == [Stored(None, tuple(keys), tuple(range(10, 22)), TPB, 4, "CPU")]

    q = np.concatenate([p[:8], np.arange(500, 509)])        # reuses 2 blocks, stores 2 more
    prefill(mgr, q, reuse_scope=scope)
    qkeys = block_keys(q, TPB, root)
    assert qkeys[:2] == keys[:2]
    assert mgr.drain_events() == [Stored(keys[1], (qkeys[2], qkeys[3]), tuple(range(500, 508)), TPB, 4, "CPU")]

    kv = mgr.create_kv_cache_for_prompt(q, reuse_scope=scope)           # reuse alone stores nothing
    kv.set_priority(90)
    events = mgr.drain_events()
    assert events == [Updated(tuple(qkeys[:4]), "CPU", 90, old_priority=35)]
    kv.close()

    big = mgr.create_kv_cache()                              # 3 free: 3 evictions needed
    assert big.resume() and big.resize(6 * TPB)              # priority 35 first, then leaves of the 90s
    assert mgr.drain_events() == [Removed((keys[2], qkeys[3], qkeys[2]), "CPU")]
    assert big.resize(8 * TPB)
    assert mgr.drain_events() == [Removed((keys[1], keys[0]), "CPU")]
    big.close()
    assert mgr.drain_events() == []


def test_event_ids_are_consecutive_and_merges_keep_the_first() -> None:
    q = EventQueue(8)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    q.put(Stored(None, (a,), (1, 2), 2, None, "CPU"))
    q.put(Stored(a, (b,), (3, 4), 2, None, "CPU"))           # continues: merged, keeps id 0
    q.put(Stored(None, (c,), (5, 6), 2, None, "CPU"))         # a new chain: not merged
    q.put(Stored(c, (a,), (7, 8), 2, 1, "CPU"))               # other LoRA: not merged
    q.put(Removed((a,), "CPU"))
    q.put(Removed((b,), "CPU"))
    q.put(Removed((c,), "CPU", (1,)))                         # another layer group: not merged
    out = q.drain()
    assert out == [Stored(None, (a, b), (1, 2, 3, 4), 2, None, "CPU"), Stored(None, (c,), (5, 6), 2, None, "CPU"),
                   Stored(c, (a,), (7, 8), 2, 1, "CPU"), Removed((a, b), "CPU"), Removed((c,), "CPU", (1,))]
    assert [e.event_id for e in out] == [0, 1, 2, 3, 4]      # a merge takes no id: ids skip only at drops
    assert len(q) == 0 and q.next_event_id == 5


def test_bounded_queue_drops_the_oldest_and_says_so() -> None:
    mgr = drained(make_manager(64, event_queue_capacity=2))
    for i in range(4):                                       # four unrelated chains: four events
        prefill(mgr, np.arange(100 * i, 100 * i + 5))
    events = mgr.drain_events()
    assert mgr.events_dropped == 2
    marker, *kept = events
    assert marker == EventsDropped(2)
    assert [e.token_ids[0] for e in kept if isinstance(e, Stored)] == [200, 300]
    ids = [e.event_id for e in kept]
    assert ids[1] == ids[0] + 1 and marker.event_id == ids[0] - 1
    assert mgr.drain_events() == []                          # the marker is reported once
    with pytest.raises(ConfigError, match="capacity"):
        EventQueue(0)


def test_clear_emits_one_event() -> None:
    mgr = drained(make_manager(16))
    prefill(mgr, np.arange(9))
    mgr.drain_events()
    assert mgr.reset_prefix_tree()
    assert mgr.drain_events() == [AllCleared()]


def test_salt_and_extra_keys_are_published_per_block() -> None:
    mgr = drained(make_manager(16))
    prefill(mgr, np.arange(12), extra_keys={1: b"\x01\x02"})
    (ev,) = mgr.drain_events()
    assert isinstance(ev, Stored)
    assert ev.extra_keys == (None, (("mm", "0102"),), None)
    assert stored_extra_keys(0, 2, b"tenant", {}) == ((("salt", b"tenant".hex()),), None)
    assert stored_extra_keys(0, 1, "acme", {0: b"\xff"}) == ((("salt", "acme"), ("mm", "ff")),)
    assert stored_extra_keys(3, 1, 12345, {}) is None         # the salt goes on a scope's first block only
    assert stored_extra_keys(0, 1, 12345, {}) == ((("salt", "12345"),),)


def test_sliding_window_drops_are_announced_for_their_layer_group() -> None:
    """A window group letting go of a block's pages says so: the block is not reusable there any more."""
    mgr = drained(make_manager(64, windows=[None, 2 * TPB]))
    p = np.arange(6 * TPB)
    kv = mgr.create_kv_cache_for_prompt(p)
    assert kv.resume() and kv.resize(p.size)
    write_kv(mgr, kv, p, 0, p.size)
    kv.commit(p)
    keys = block_keys(p, TPB, ReuseScope().root_key)
    events = mgr.drain_events()
    removed = [e for e in events if isinstance(e, Removed)]
    assert removed, events
    assert all(e.layer_groups == (1,) for e in removed)
    gone = {h for e in removed for h in e.block_hashes}
    assert gone and gone < set(keys[:-1])
    in_tree = {n.key: n.pages.tolist() for n in mgr.prefix_tree.nodes()}
    for h in gone:                                            # exactly the blocks without a window page
        assert in_tree[h][1] == -1 and in_tree[h][0] >= 0
    kv.close()


# --- the wire: vLLM's schema decodes what kvxfer sends --------------------------------------------
class VllmSubscriber:
    """A router's view of one worker, built only on one vLLM version's structs: per (medium, group) the
    hashes stored there; every removal must name a stored hash unless a clear (a drop marker) came
    since; every store carries its blocks' tokens (``block_size`` each, the same tokens whenever a
    block is stored again, e.g. on a tier move) and a parent already stored."""

    def __init__(self, wire: str = WIRE_RELEASE) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=VLLM.BATCH_OF_WIRE[wire])
        self.blocks: dict[tuple[str | None, int | None], set[Any]] = {}
        self.tokens: dict[Any, list[int]] = {}
        self.unexplained: list[str] = []
        self.cleared_since_start = False
        self.next_seq = 0

    def feed(self, seq: int, payload: bytes) -> Any:
        if seq != self.next_seq:
            self.unexplained.append(f"sequence gap {self.next_seq} -> {seq}")
        self.next_seq = seq + 1
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            group = getattr(ev, "group_idx", 0)
            if isinstance(ev, VLLM.STORED):
                self._check_tokens(ev)
                self.blocks.setdefault((ev.medium, group), set()).update(ev.block_hashes)
            elif isinstance(ev, VLLM.REMOVED):
                have = self.blocks.setdefault((ev.medium, group), set())
                missing = set(ev.block_hashes) - have
                if missing and not self.cleared_since_start:
                    self.unexplained.append(f"removal of {len(missing)} unknown hashes on {ev.medium}")
                have.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, VLLM.CLEARED)
                self.blocks.clear()
                self.cleared_since_start = True
        return batch

    def _check_tokens(self, ev: Any) -> None:
        if ev.block_size != TPB or len(ev.token_ids) != TPB * len(ev.block_hashes):
            self.unexplained.append(f"store of {len(ev.block_hashes)} blocks with block_size {ev.block_size} and "
                                    f"{len(ev.token_ids)} tokens")
            return
        if ev.parent_block_hash is not None and ev.parent_block_hash not in self.tokens and not self.cleared_since_start:
            self.unexplained.append("store under a parent never stored")
        for i, h in enumerate(ev.block_hashes):
            toks = ev.token_ids[i * TPB:(i + 1) * TPB]
            if self.tokens.setdefault(h, toks) != toks:
                self.unexplained.append("a block stored again with other tokens")

    def state(self) -> dict[tuple[str | None, int | None], set[Any]]:
        return {k: v for k, v in self.blocks.items() if v}


def tree_state(mgr: KVCacheManager, ctx: WireContext) -> dict[tuple[str | None, int | None], set[Any]]:
    """What the subscriber must believe: each tree block's page per layer group, on its tier's medium
    as vLLM names it."""
    media = {0: "CPU", 1: "CPU", 2: "STORAGE"}
    out: dict[tuple[str | None, int | None], set[Any]] = {}
    for node in mgr.prefix_tree.nodes():
        for lg, (page, tier) in enumerate(zip(node.pages.tolist(), node.tiers.tolist(), strict=True)):
            if page >= 0:
                out.setdefault((media[tier], lg), set()).add(ctx.ext(node.key))
    return out


def replay_all(endpoint: str, ctx: zmq.Context[Any], start: int = 0) -> list[tuple[int, bytes]]:
    """Ask the replay ROUTER for every batch from ``start`` (vLLM's framing) until the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            assert sock.poll(5000), "replay did not answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


@pytest.mark.parametrize(("hash_name", "windows", "wire"), [
    ("v2_blake3_64", None, WIRE_RELEASE), ("v2_blake3", None, WIRE_RELEASE),
    ("v2_blake3_64", [None, 2 * TPB], WIRE_RELEASE), ("v2_blake3_64", [None, 2 * TPB], WIRE_MAP),
    ("v2_blake3", None, WIRE_ARRAY)])
def test_vllm_subscriber_follows_store_reuse_tier_moves_evict_and_reset(tmp_path: Path, hash_name: str,
                                                                        windows: list[int | None] | None,
                                                                        wire: str) -> None:
    """Every batch of a run decodes with one vLLM version's structs; the subscriber's picture equals the
    tree after every step (tier moves published as stored-at-new with their tokens / removed-at-old;
    with a sliding-window group, its dropped pages too), with no unexplained gap."""
    mgr = drained(make_manager(4, host_blocks=2, disk_blocks=2, disk_path=str(tmp_path), windows=windows))
    zctx = zmq.Context()
    wctx = WireContext.for_layout(mgr.layout, hash_name=hash_name, wire=wire)
    sub = VllmSubscriber(wire)
    try:
        with KVEventPublisher("tcp://127.0.0.1:*", context=wctx, replay_endpoint="tcp://127.0.0.1:*",
                              zmq_context=zctx) as pub:
            steps = 0

            def step() -> None:
                nonlocal steps
                seq = pub.publish_from(mgr)
                if seq is not None:
                    (got,) = replay_all(pub.replay_endpoint or "", zctx, seq)
                    sub.feed(*got)
                assert sub.state() == tree_state(mgr, wctx), f"after step {steps}"
                steps += 1

            p1, p2, p3 = np.arange(0, 8), np.arange(50, 58), np.arange(90, 98)
            for p in (p1, p2):                                  # store
                prefill(mgr, p)
                step()
            prefill(mgr, np.concatenate([p1, [7, 7, 7, 7]]))     # reuse p1, store one more block
            step()
            kv = mgr.create_kv_cache()                            # pressure: tree pages move to host, disk
            assert kv.resume() and kv.resize(4 * TPB)
            step()
            kv.close()
            prefill(mgr, p3)                                      # more pressure: the coldest tier drops
            step()
            kv = mgr.create_kv_cache()
            assert kv.resume() and kv.resize(4 * TPB)
            step()
            kv.close()
            prefill(mgr, p2)                                      # reuse from colder tiers (onboarding)
            step()
            assert mgr.reset_prefix_tree()                        # reset
            step()
            assert sub.state() == {} and steps == 8
            history = replay_all(pub.replay_endpoint or "", zctx)  # the replay buffer holds every batch
            assert [s for s, _ in history] == list(range(pub.next_sequence))
    finally:
        zctx.term()
    assert sub.unexplained == []
    replayed = VllmSubscriber(wire)
    for seq, payload in history:
        replayed.feed(seq, payload)
    assert replayed.unexplained == [] and replayed.state() == {}
    batch_type = VLLM.BATCH_OF_WIRE[wire]
    decoded = [e for _, p in history for e in msgspec.msgpack.decode(p, type=batch_type).events]
    kinds = {type(e).__name__.removeprefix("Legacy") for e in decoded}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    media = {(type(e).__name__.removeprefix("Legacy"), e.medium) for e in decoded if not isinstance(e, VLLM.CLEARED)}
    assert {("BlockStored", "STORAGE"), ("BlockRemoved", "STORAGE"), ("BlockRemoved", "CPU")} <= media  # moves, drops
    assert all(e.medium != "DISK" for e in decoded if not isinstance(e, VLLM.CLEARED))
    for other, other_type in VLLM.BATCH_OF_WIRE.items():   # the forms are not interchangeable
        if other != wire:
            with pytest.raises(msgspec.ValidationError):
                msgspec.msgpack.decode(history[0][1], type=other_type)
    assert [len(decode_batch(p).events) for _, p in history] == [   # kvxfer's router reads every form
        len(msgspec.msgpack.decode(p, type=batch_type).events) for _, p in history]


def test_a_tier_move_is_stored_with_its_chain_tokens_and_block_size() -> None:
    """An Updated tier move becomes one BlockStored per chain of moved blocks (parent, tokens, block
    size) on the new medium as vLLM names it, then one BlockRemoved of every moved block at the old."""
    a, b, c = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32
    p = b"\x09" * 32
    ev = Updated((a, b, c), "DISK", old_medium="CPU", parent_hashes=(p, a, None),
                 block_tokens=((1, 2), (3, 4), (5, 6)), block_size=2)
    wctx = WireContext(hash_name="v2_blake3")
    payload = encode_batch([ev], 1.0, wctx)
    assert payload is not None
    s1, s2, rm = msgspec.msgpack.decode(payload, type=VLLM.ReleaseKVEventBatch).events
    assert (s1.block_hashes, s1.parent_block_hash, s1.token_ids, s1.block_size, s1.medium) == (
        [a, b], p, [1, 2, 3, 4], 2, "STORAGE")
    assert (s2.block_hashes, s2.parent_block_hash, s2.token_ids, s2.block_size) == ([c], None, [5, 6], 2)
    assert (rm.block_hashes, rm.medium) == ([a, b, c], "CPU")


def test_moves_merged_in_the_queue_keep_their_tokens() -> None:
    q = EventQueue(8)
    a, b = b"\x01" * 32, b"\x02" * 32
    q.put(Updated((a,), "DISK", old_medium="CPU", parent_hashes=(None,), block_tokens=((1, 2),), block_size=2))
    q.put(Updated((b,), "DISK", old_medium="CPU", parent_hashes=(a,), block_tokens=((3, 4),), block_size=2))
    (merged,) = q.drain()
    assert isinstance(merged, Updated)
    assert (merged.block_hashes, merged.parent_hashes, merged.block_tokens) == ((a, b), (None, a), ((1, 2), (3, 4)))


def test_dropped_events_become_a_clear_the_subscriber_can_explain() -> None:
    mgr = drained(make_manager(8, event_queue_capacity=2))
    wctx = WireContext.for_layout(mgr.layout)
    sub = VllmSubscriber()
    for i in range(4):
        prefill(mgr, np.arange(100 * i, 100 * i + 5))
    payload = encode_batch(mgr.drain_events(), 1.0, wctx)
    assert payload is not None
    batch = sub.feed(0, payload)
    assert type(batch.events[0]).__name__ == "AllBlocksCleared"
    big = mgr.create_kv_cache()                               # evicts blocks whose Stored was dropped
    assert big.resume() and big.resize(8 * TPB)
    payload = encode_batch(mgr.drain_events(), 2.0, wctx)
    assert payload is not None
    sub.feed(1, payload)
    assert sub.unexplained == [] and sub.state() == {}


def test_a_removal_nobody_stored_is_flagged_by_the_subscriber() -> None:
    """Mutation check of the subscriber: a Removed for a hash never stored is unexplained."""
    mgr = drained(make_manager(8))
    wctx = WireContext.for_layout(mgr.layout)
    sub = VllmSubscriber()
    payload = encode_batch([Removed((b"\x07" * 32,), "CPU")], 1.0, wctx)
    assert payload is not None
    sub.feed(3, payload)
    assert len(sub.unexplained) == 2        # the sequence gap and the unknown hash


def test_wire_fields_groups_and_windows() -> None:
    mgr = drained(make_manager(32, windows=[None, 2 * TPB]))
    wctx = WireContext.for_layout(mgr.layout, data_parallel_rank=3)
    prefill(mgr, np.arange(9), reuse_scope=ReuseScope(lora_id=5))
    payload = encode_batch(mgr.drain_events(), 12.5, wctx)
    assert payload is not None
    raw = msgspec.msgpack.decode(payload)       # the release form: [ts, events, rank], events maps
    assert raw[0] == 12.5 and raw[2] == 3
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockStored"]
    full, window = msgspec.msgpack.decode(payload, type=VLLM.ReleaseKVEventBatch).events
    assert (full.group_idx, full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == (0, "full_attention", None)
    assert (window.group_idx, window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == (
        1, "sliding_window", 2 * TPB)
    keys = block_keys(np.arange(9), TPB, ReuseScope(lora_id=5).root_key)
    assert full.block_hashes == [int.from_bytes(k[:8], "big") for k in keys]
    assert (full.lora_id, full.lora_name, full.medium, full.token_ids) == (5, "5", "CPU", list(range(8)))


def test_legacy_array_form_behind_the_flag() -> None:
    a = b"\x01" * 32
    events = [Stored(None, (a,), (1, 2), 2, None, "CPU"), Removed((a,), "CPU"), AllCleared()]
    payload = encode_batch(events, 2.0, WireContext(wire=WIRE_ARRAY, data_parallel_rank=1))
    assert payload is not None
    assert msgspec.msgpack.decode(payload) == [2.0, [["BlockStored", [int.from_bytes(a[:8], "big")], None, [1, 2], 2,
                                                       None, "CPU"], ["BlockRemoved", [int.from_bytes(a[:8], "big")],
                                                                      "CPU"], ["AllBlocksCleared"]], 1]
    batch = msgspec.msgpack.decode(payload, type=VLLM.LegacyKVEventBatch)
    assert len(batch.events) == 3
    with pytest.raises(msgspec.ValidationError):              # the forms are not interchangeable
        msgspec.msgpack.decode(payload, type=VLLM.ReleaseKVEventBatch)


def test_main_map_form_behind_the_flag() -> None:
    a = b"\x01" * 32
    payload = encode_batch([Stored(None, (a,), (1, 2), 2, None, "DISK")], 3.0, WireContext(wire=WIRE_MAP))
    assert payload is not None
    raw = msgspec.msgpack.decode(payload)
    assert raw["ts"] == 3.0 and raw["data_parallel_rank"] == 0 and raw["events"][0]["medium"] == "STORAGE"
    (ev,) = msgspec.msgpack.decode(payload, type=VLLM.MainKVEventBatch).events
    assert (ev.token_ids, ev.block_size) == ([1, 2], 2)


def test_priority_and_created_have_no_vllm_form_but_a_reference_record() -> None:
    a = b"\x02" * 32
    wctx = WireContext(hash_name="v2_blake3", groups=WireContext().groups)
    assert encode_batch([Updated((a,), "CPU", 90, old_priority=35), Created(("CPU",), (8,))], 1.0, wctx) is None
    (rec,) = reference_events(Updated((a,), "DISK", None, old_medium="CPU", event_id=7), wctx, ("CPU", "CPU", "DISK"))
    assert rec == {"event_id": 7, "data": {"type": "updated", "block_hash": a.hex(),
                                           "cache_level": {"old_value": 0, "new_value": 2}, "priority": None},
                   "window_size": 0, "hash_algo": "v2_blake3", "attention_dp_rank": 0, "layer_group_id": 0}
    (created,) = reference_events(Created(("CPU", "DISK"), (8, 4), event_id=0), wctx, ("CPU", "DISK"))
    assert created["data"] == {"type": "created", "num_blocks_per_cache_level": [8, 4]}


def test_live_sub_socket_receives_the_batches() -> None:
    mgr = drained(make_manager(8))
    prefill(mgr, np.arange(40, 49))
    zctx = zmq.Context()
    try:
        with KVEventPublisher("tcp://127.0.0.1:*", context=WireContext.for_layout(mgr.layout),
                              zmq_context=zctx) as pub:
            sub = zctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            sub.connect(pub.endpoint)
            deadline = time.monotonic() + 10                  # PUB drops messages until the SUB joined
            while not sub.poll(50):
                assert time.monotonic() < deadline, "SUB never received a probe"
                pub.publish([AllCleared()])
            while sub.poll(20):
                sub.recv_multipart()
            seq = pub.publish_from(mgr)
            assert sub.poll(5000)
            topic, seq_bytes, payload = sub.recv_multipart()
            sub.close()
    finally:
        zctx.term()
    assert topic == b"kv-events" and int.from_bytes(seq_bytes, "big") == seq and len(seq_bytes) == 8
    (ev,) = msgspec.msgpack.decode(payload, type=VLLM.ReleaseKVEventBatch).events
    assert isinstance(ev, VLLM.BlockStored) and ev.token_ids == list(range(40, 48))


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown hash name"):
        WireContext(hash_name="md5")
    with pytest.raises(ConfigError, match="wire format"):
        WireContext(wire="json")
    with pytest.raises(ConfigError, match="data_parallel_rank"):
        WireContext(data_parallel_rank=-1)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_published_hashes_follow_the_cache_hash_algorithm(algo: str) -> None:
    """Events go out under the manager's resolved algorithm: v1 (40-byte composite keys) and the _64
    options publish the 64-bit hash, the full-width ones the digest; both wires agree with
    ``block_hash_for_event``, and an override naming other keys is refused."""
    mgr = make_manager(16, hash_algo=algo)
    resolved = mgr.resolved_hash_algo
    vctx = WireContext.for_manager(mgr)
    rctx = WireContext.for_manager(mgr, wire="reference")
    assert vctx.hash_name == resolved == ("v1_block_key" if algo == "auto" else algo)
    prefill(mgr, np.arange(100, 117))
    events = mgr.drain_events()
    keys = [k for e in events if isinstance(e, Stored) for k in e.block_hashes]
    assert len(keys) == 17 // TPB
    expected = [block_hash_for_event(k, resolved) for k in keys]
    payload = encode_batch(events, 1.0, vctx)
    assert payload is not None
    stored = [e for e in msgspec.msgpack.decode(payload, type=VLLM.ReleaseKVEventBatch).events
              if isinstance(e, VLLM.BlockStored)]
    wire = [h for e in stored for h in e.block_hashes]
    assert wire == [bytes.fromhex(h) if isinstance(h, str) else h for h in expected]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in wire) if algo in ("v2_sha256", "v2_blake3", "v2_sha256_packed") \
        else all(isinstance(h, int) and 0 <= h < 2**64 for h in wire)
    ref = msgspec.msgpack.decode(encode_batch(events, 1.0, rctx) or b"")["events"]
    ref_stored = [r for r in ref if r["data"]["type"] == "stored"]
    assert [b["block_hash"] for r in ref_stored for b in r["data"]["blocks"]] == expected
    assert {r["hash_algo"] for r in ref} == {resolved}
    other = "v2_sha256" if resolved.startswith("v2_blake3") else "v2_blake3_64"
    with pytest.raises(ConfigError, match="names other keys than the cache's"):
        WireContext.for_manager(mgr, hash_name=other)
    with pytest.raises(ConfigError, match="unknown hash name"):
        WireContext.for_manager(mgr, hash_name="md5")


def test_reference_wire_publishes_every_event_with_ids_windows_and_rank() -> None:
    """The reference form carries what vLLM's cannot: Created, priority diffs, event ids, window sizes."""
    mgr = make_manager(16, windows=[None, 2 * TPB])
    wctx = WireContext.for_manager(mgr, wire="reference", data_parallel_rank=2, hash_name="v2_blake3")
    p = np.arange(9)
    kv = prefill(mgr, p, close=False)
    kv.set_priority(80)
    kv.close()
    payload = encode_batch(mgr.drain_events(), 3.0, wctx)
    assert payload is not None
    body = msgspec.msgpack.decode(payload)
    assert body["ts"] == 3.0 and body["data_parallel_rank"] == 2
    records = body["events"]
    kinds = [r["data"]["type"] for r in records]
    assert kinds[0] == "created" and "stored" in kinds and "updated" in kinds
    assert {r["layer_group_id"]: r["window_size"] for r in records if r["data"]["type"] == "stored"} == {0: 0, 1: 8}
    upd = [r for r in records if r["data"]["type"] == "updated"]
    assert all(r["data"]["priority"] == {"old_value": 35, "new_value": 80} and r["data"]["cache_level"] is None
               for r in upd)
    keys = block_keys(p, TPB, ReuseScope().root_key)
    assert {r["data"]["block_hash"] for r in upd} == {k.hex() for k in keys}
    ids = [r["event_id"] for r in records]
    assert ids == sorted(ids) and all(r["hash_algo"] == "v2_blake3" and r["attention_dp_rank"] == 2 for r in records)
