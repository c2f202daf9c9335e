"""KV-aware routing: the router's block hashes equal what a prefill's cache publishes, it follows stores
and removals, and requests sharing a prefix go to the prefill that computed it (over ZeroMQ, with the
events of real prefill workers), with load as the tie-breaker."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import numpy as np
import pytest
import zmq

from kvxfer.cache.event_publisher import KVEventPublisher
from kvxfer.cache.event_wire import WireContext, decode_batch, encode_batch
from kvxfer.cache.hashing import HASH_ALGOS, ReuseScope
from kvxfer.disagg.router import KVRouter, WorkerIndex, request_block_hashes
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import ConfigError
from kvxfer.ops.events import EventPump
from tests.e2e.test_loopback import (  # noqa: F401 (_one_thread: autouse leak check)
    KV,
    NEW,
    SECRET,
    _one_thread,
    assert_matches_reference,
    name,
)
from tests.support.reuse_support import make_manager

TPB = 16


def wait_for(cond: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@contextmanager
def prefills_with_events(count: int, zctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[list[tuple[PrefillWorker, str, str]]]:
    """``count`` prefill workers, each publishing its rank-0 cache's KV events as ``kvxfer serve --kv-events
    --kv-events-replay``: (worker, events endpoint, replay endpoint)."""
    with ExitStack() as stack:
        out = []
        for _ in range(count):
            worker = stack.enter_context(PrefillWorker(WorkerConfig(name("prefill"), num_blocks=128), SECRET))
            manager = worker.managers[0]
            publisher = stack.enter_context(KVEventPublisher("tcp://127.0.0.1:*", zmq_context=zctx,
                                                             context=WireContext.for_manager(manager),
                                                             replay_endpoint="tcp://127.0.0.1:*"))
            pump = EventPump(publisher, manager, worker.engine, 0.01)
            stack.callback(pump.close)
            out.append((worker, publisher.endpoint, publisher.replay_endpoint or ""))
        yield out


@pytest.mark.parametrize("algo", [a for a in HASH_ALGOS if a != "auto"])
def test_request_hashes_equal_the_published_ones(algo: str) -> None:
    """Under every hash option, the router's hashes of a prompt are the hashes its cache publishes on
    storing it (full blocks only), and a WorkerIndex fed that batch holds the whole prefix."""
    mgr = make_manager(hash_algo=algo)
    mgr.drain_events()
    tpb = mgr.layout.tokens_per_block
    tokens = np.arange(3 * tpb + tpb // 2 + 1) % 97
    cache = mgr.create_kv_cache_for_prompt(tokens)
    assert cache.resume() and cache.resize(tokens.size)
    cache.commit(tokens)
    cache.close()
    batch = decode_batch(encode_batch(mgr.drain_events(), 0.0, WireContext.for_manager(mgr)) or b"")
    hashes = request_block_hashes(tokens, tpb, hash_algo=algo)
    assert len(hashes) == 3
    index = WorkerIndex()
    index.apply(batch)
    assert index.prefix_blocks(hashes) == 3
    # Mutations: another scope, block size or first token changes every hash, so nothing matches.
    assert index.prefix_blocks(request_block_hashes(tokens, tpb, hash_algo=algo,
                                                    scope=ReuseScope(salt=1))) == 0
    assert index.prefix_blocks(request_block_hashes(tokens, tpb // 2, hash_algo=algo)) == 0
    other = tokens.copy()
    other[0] += 1
    assert index.prefix_blocks(request_block_hashes(other, tpb, hash_algo=algo)) == 0
    changed = tokens.copy()
    changed[tpb + 1] += 1       # a change in block 1: block 0 still matches, nothing after it
    assert index.prefix_blocks(request_block_hashes(changed, tpb, hash_algo=algo)) == 1


def test_requests_follow_their_prefix_and_ties_go_to_the_least_loaded() -> None:
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with prefills_with_events(2, zctx) as workers, \
                KVRouter({w.address: ep for w, ep, _ in workers}, tokens_per_block=TPB, zmq_context=zctx) as router, \
                DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET,
                             prefill=[w.address for w, _, _ in workers]) as decode:
            addresses = [w.address for w, _, _ in workers]
            rng = np.random.default_rng(5)
            system = [rng.integers(0, 512, 6 * TPB) for _ in range(2)]
            # Nothing cached: equal matches, so the load decides (the first request is still in flight).
            first = router.route(np.concatenate([system[0], rng.integers(0, 512, 7)]))
            second = router.route(np.concatenate([system[1], rng.integers(0, 512, 7)]))
            assert first.cached_blocks == second.cached_blocks == 0 and first.address != second.address
            assert second.load == 0
            router.finished(first)
            router.finished(second)
            # Serve one request per prefix on the chosen prefill; the events then route their followers there.
            homes = {}
            for i, route in enumerate((first, second)):
                tokens = np.concatenate([system[i], rng.integers(0, 512, 9)])
                res = decode.generate(tokens, NEW, timeout=60, return_kv=KV, prefill=route.address)
                assert res.prefill == route.address
                homes[i] = route.address
            wait_for(lambda: all(router.cached_blocks(a) >= 6 for a in addresses), "both prefixes are announced")
            for k in range(4):
                i = k % 2
                tokens = np.concatenate([system[i], rng.integers(0, 512, 11)])
                route = router.route(tokens)
                assert route.address == homes[i] and route.cached_blocks == 6 and route.total_blocks == 6
                res = decode.generate(tokens, NEW, timeout=60, return_kv=KV, prefill=route.address)
                router.finished(route)
                assert res.prefill == homes[i] and res.reused_tokens_prefill == 6 * TPB
                assert_matches_reference(res, tokens, NEW)
            stats = router.stats()
            assert all(s["gaps"] == 0 and s["in_flight"] == 0 for s in stats.values()), stats
            assert router.error is None
            assert router.remove_worker(homes[0]) and not router.remove_worker(homes[0])
            assert router.route(np.concatenate([system[0], [1, 2]])).address == homes[1]
    finally:
        zctx.term()


def test_router_refuses_bad_settings() -> None:
    with pytest.raises(ConfigError, match="tokens_per_block"):
        KVRouter({}, tokens_per_block=0)
    with KVRouter({"tcp://127.0.0.1:1": "tcp://127.0.0.1:2"}) as router:
        with pytest.raises(ConfigError, match="already"):
            router.add_worker("tcp://127.0.0.1:1", "tcp://127.0.0.1:3")
        router.remove_worker("tcp://127.0.0.1:1")
        with pytest.raises(ConfigError, match="no prefill worker"):
            router.route([1, 2, 3])


def test_a_decode_worker_with_a_router_sends_requests_to_their_prefix() -> None:
    """``DecodeWorker(router=...)`` (what ``kvxfer serve decode --prefill-events`` builds): requests naming no
    prefill follow the router, so every request of one prefix after the first hits that prefill's cache."""
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with prefills_with_events(2, zctx) as workers:
            router = KVRouter({w.address: ep for w, ep, _ in workers}, tokens_per_block=TPB, zmq_context=zctx)
            with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET,
                              prefill=[w.address for w, _, _ in workers], router=router) as decode:
                rng = np.random.default_rng(9)
                system = rng.integers(0, 512, 4 * TPB)
                first = decode.generate(np.concatenate([system, [7]]), NEW, timeout=60)
                wait_for(lambda: router.cached_blocks(first.prefill) >= 4, "the prefix is announced")
                for k in range(3):
                    tokens = np.concatenate([system, rng.integers(0, 512, 5 + k)])
                    res = decode.generate(tokens, NEW, timeout=60, return_kv=KV)
                    assert res.prefill == first.prefill and res.reused_tokens_prefill == 4 * TPB
                    assert_matches_reference(res, tokens, NEW)
                assert all(s["in_flight"] == 0 for s in router.stats().values())
            assert not router.running   # the worker closed its router
    finally:
        zctx.term()


def test_serve_checks_prefill_events_against_prefills() -> None:
    from kvxfer.cli.serve import kv_router, parse_prefills

    args = argparse.Namespace(prefill=parse_prefills("tcp://a:1,tcp://b:2"), prefill_events=parse_prefills("tcp://a:3"),
                              etcd=None, kv_route=False)
    with pytest.raises(ConfigError, match="1 endpoint"):
        kv_router(args, WorkerConfig("x"))
    args.prefill_events = None
    assert kv_router(args, WorkerConfig("x")) is None


def test_a_router_joining_late_learns_earlier_blocks_by_replay() -> None:
    """Blocks stored before the router subscribed reach it only through the publisher's replay endpoint:
    a router given it knows the prefix at once; one without it (the control) never hears of it."""
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with prefills_with_events(1, zctx) as workers:
            (worker, events, replay), = workers
            with DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=worker.address) as decode:
                tokens = np.random.default_rng(4).integers(0, 512, 5 * TPB + 3)
                decode.generate(tokens, 2, timeout=60)
                wait_for(lambda: worker.status()["jobs"] == 0, "prefill is done with the request")
                time.sleep(0.1)   # the event pump (every 0.01 s) has published the stores
                with KVRouter({worker.address: events}, tokens_per_block=TPB, zmq_context=zctx) as blind, \
                        KVRouter({}, tokens_per_block=TPB, zmq_context=zctx) as late:
                    late.add_worker(worker.address, events, replay)
                    wait_for(lambda: late.cached_blocks(worker.address) >= 5, "the replay brings the stored blocks")
                    assert late.route(tokens).cached_blocks == 5
                    assert blind.cached_blocks(worker.address) == 0 and blind.route(tokens).cached_blocks == 0
                    assert late.stats()[worker.address]["gaps"] == 0
    finally:
        zctx.term()
