"""KV events: sequences for store / reuse / evict / update / clear, the bounded queue, and the
ZeroMQ publisher's vLLM-compatible wire format received by a real SUB socket."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq
from reuse_support import TPB, make_manager, prefill, write_kv

from kvxfer.cache import AllCleared, KVEventPublisher, Removed, ReuseScope, Stored, Updated, block_keys
from kvxfer.cache.events import EventQueue, encode_batch
from kvxfer.errors import ConfigError


def test_store_reuse_evict_sequence() -> None:
    mgr = make_manager(8)
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

    kv = mgr.create_kv_cache(q, reuse_scope=scope)           # reuse alone stores nothing
    kv.set_priority(90)
    assert mgr.drain_events() == [Updated(tuple(qkeys[:4]), "CPU", 90)]
    kv.close()

    big = mgr.create_kv_cache()                              # 3 free: 3 evictions needed
    assert big.resume() and big.resize(6 * TPB)              # priority 35 first, then leaves of the 90s
    assert mgr.drain_events() == [Removed((keys[2], qkeys[3], qkeys[2]), "CPU")]
    assert big.resize(8 * TPB)
    assert mgr.drain_events() == [Removed((keys[1], keys[0]), "CPU")]
    big.close()
    assert mgr.drain_events() == []


def test_consecutive_chains_coalesce_only_when_they_continue() -> None:
    q = EventQueue(8)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    q.put(Stored(None, (a,), (1, 2), 2, None, "CPU"))
    q.put(Stored(a, (b,), (3, 4), 2, None, "CPU"))
    q.put(Stored(None, (c,), (5, 6), 2, None, "CPU"))         # a new chain: not merged
    q.put(Stored(c, (a,), (7, 8), 2, 1, "CPU"))               # other LoRA: not merged
    q.put(Removed((a,), "CPU"))
    q.put(Removed((b,), "CPU"))
    assert q.drain() == [Stored(None, (a, b), (1, 2, 3, 4), 2, None, "CPU"), Stored(None, (c,), (5, 6), 2, None, "CPU"),
                         Stored(c, (a,), (7, 8), 2, 1, "CPU"), Removed((a, b), "CPU")]
    assert len(q) == 0


def test_bounded_queue_drops_the_oldest_and_counts() -> None:
    mgr = make_manager(64, event_queue_capacity=2)
    for i in range(4):                                       # four unrelated chains: four events
        prefill(mgr, np.arange(100 * i, 100 * i + 5))
    events = mgr.drain_events()
    assert mgr.events_dropped == 2
    assert [e.token_ids[0] for e in events if isinstance(e, Stored)] == [200, 300]
    with pytest.raises(ConfigError, match="capacity"):
        EventQueue(0)


def test_clear_emits_one_event() -> None:
    mgr = make_manager(16)
    prefill(mgr, np.arange(9))
    mgr.drain_events()
    assert mgr.reset_prefix_tree()
    assert mgr.drain_events() == [AllCleared()]


def _subscribe(ctx: zmq.Context, endpoint: str, topic: bytes) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _sync(pub: KVEventPublisher, sub: zmq.Socket) -> int:
    """Publish AllCleared probes until the subscription is live (PUB drops messages before it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish([AllCleared()])
        if sub.poll(50):
            _, seq, _ = sub.recv_multipart()
            while sub.poll(20):
                _, seq, _ = sub.recv_multipart()
            return int.from_bytes(seq, "big")
    raise AssertionError("SUB never received a probe")


@pytest.mark.parametrize("hash_name", ["v2_blake3_64", "v2_blake3"])
def test_publisher_speaks_the_vllm_batch_format(hash_name: str) -> None:
    mgr = make_manager(8)
    p = np.arange(40, 49)
    kv = mgr.create_kv_cache(p)
    assert kv.resume() and kv.resize(9)
    write_kv(mgr, kv, p, 0, 9)
    kv.commit(p)
    kv.close()
    big = mgr.create_kv_cache()
    assert big.resume() and big.resize(7 * TPB)              # evicts one block
    events = mgr.drain_events()
    keys = block_keys(p, TPB, ReuseScope().root_key)
    ctx = zmq.Context()
    try:
        with KVEventPublisher("tcp://127.0.0.1:*", hash_name=hash_name, context=ctx) as pub:
            sub = _subscribe(ctx, pub.endpoint, b"kv-events")
            last = _sync(pub, sub)
            assert pub.publish(events) == last + 1
            assert pub.publish([]) is None and pub.publish([Updated((keys[0],), "CPU", 3)]) is None
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            sub.close()
    finally:
        ctx.term()
    assert topic == b"kv-events" and int.from_bytes(seq, "big") == last + 1 and len(seq) == 8
    ts, wire = msgpack.unpackb(payload, raw=False)
    assert abs(ts - time.time()) < 60
    ext = [int.from_bytes(k[:8], "big") for k in keys] if hash_name == "v2_blake3_64" else keys
    assert wire == [["BlockStored", ext, None, list(range(40, 48)), TPB, None, "CPU"],
                    ["BlockRemoved", [ext[1]], "CPU"]]


def test_batch_encoding_with_rank_and_clear() -> None:
    body = msgpack.unpackb(encode_batch([AllCleared()], 12.5, data_parallel_rank=3), raw=False)
    assert body == [12.5, [["AllBlocksCleared"]], 3]
    with pytest.raises(ConfigError, match="unknown hash name"):
        KVEventPublisher("tcp://127.0.0.1:*", hash_name="md5")
