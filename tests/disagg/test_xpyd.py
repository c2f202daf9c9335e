"""Many-to-many workers (xPyD) in one process: a decode worker spreads requests over several prefill
workers (the caller's choice first, else the least loaded), a prefill serves several decodes at once, a
lost prefill fails only its own requests, and a prefill added while serving takes requests at once."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future

import numpy as np
import pytest

from kvxfer.cli.serve import parse_prefills
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import ConfigError, KvxferError, PeerUnreachable
from tests.e2e.test_loopback import (  # noqa: F401 (_one_thread: autouse leak check)
    KV,
    NEW,
    SECRET,
    _one_thread,
    assert_idle,
    assert_matches_reference,
    name,
    prompts,
)


def prefills(count: int) -> list[PrefillWorker]:
    return [PrefillWorker(WorkerConfig(name("prefill"), num_blocks=128), SECRET) for _ in range(count)]


def close_all(*workers: PrefillWorker | DecodeWorker) -> None:
    for w in workers:
        w.close()


def wait_idle(*workers: PrefillWorker | DecodeWorker, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(w.held_slots() or w.num_open_caches() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_idle(*workers)


def test_requests_spread_over_prefills_and_the_named_one_is_used() -> None:
    """Concurrent requests go to the least loaded prefill (so all three serve), each result matches the
    reference by the KV oracle, and a request naming a prefill goes there."""
    pre = prefills(3)
    try:
        with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET,
                          prefill=[p.address for p in pre]) as decode:
            assert decode.prefills == [p.address for p in pre]
            assert decode.status()["prefills_connected"] == 3
            batch = prompts(31, prefix=0, count=6)
            futures = [decode.submit(t, NEW, return_kv=KV) for t in batch]
            results = [f.result(timeout=60) for f in futures]
            for res, tokens in zip(results, batch, strict=True):
                assert_matches_reference(res, tokens, NEW)
            assert {r.prefill for r in results} == {p.address for p in pre}
            assert [p.status()["requests"] for p in pre] == [2, 2, 2]
            chosen = pre[2].address
            named = [decode.generate(t, NEW, timeout=60, return_kv=KV, prefill=chosen)
                     for t in prompts(32, prefix=0, count=3)]
            assert {r.prefill for r in named} == {chosen}
            assert pre[2].status()["requests"] == 5
            wait_idle(decode, *pre)
    finally:
        close_all(*pre)


def test_one_prefill_serves_two_decodes_at_once() -> None:
    (pre,) = prefills(1)
    try:
        with DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=pre.address) as a, \
                DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=[pre.address]) as b:
            batch = prompts(33, prefix=20, count=4)
            futures = [(w.submit(t, NEW, return_kv=KV), t) for w, t in zip([a, b, a, b], batch, strict=True)]
            for fut, tokens in futures:
                assert_matches_reference(fut.result(timeout=60), tokens, NEW)
            assert pre.status()["peers"] == 2 and pre.status()["completed"] == 4
            wait_idle(a, b, pre)
    finally:
        pre.close()


def test_a_lost_prefill_fails_only_its_requests_and_an_added_one_serves_at_once() -> None:
    """Close one of two prefills with requests in flight on both: only its requests fail (PeerUnreachable, or
    TransferFailed naming the shutdown when its kv_failed came first),
    the other's complete, later requests avoid it; ``add_prefill`` brings a new one that the next
    requests use; nothing stays held."""
    pre = prefills(2)
    added: PrefillWorker | None = None
    try:
        # A short lease: blocks the lost prefill may still have been writing are quarantined for two leases.
        with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256, lease_s=1.0), SECRET,
                          prefill=[p.address for p in pre], connect_timeout=1.0) as decode:
            long = [np.random.default_rng(40 + i).integers(0, 512, 900) for i in range(4)]
            futures: list[tuple[Future[GenerationResult], str]] = []
            for i, tokens in enumerate(long):
                target = pre[i % 2].address
                futures.append((decode.submit(tokens, NEW, return_kv=KV, prefill=target), target))
            pre[0].close()
            for (fut, target), tokens in zip(futures, long, strict=True):
                try:
                    res = fut.result(timeout=60)
                except KvxferError as exc:
                    assert target == pre[0].address, f"a request to the surviving prefill failed: {exc!r}"
                    # Lost (PeerUnreachable), or told first: a closing prefill fails its requests in flight.
                    assert isinstance(exc, PeerUnreachable) or "prefill worker shutting down" in str(exc), exc
                    continue
                # A request still waiting to start when the loss was seen goes to the survivor instead.
                assert res.prefill in (target, pre[1].address)
                assert_matches_reference(res, tokens, NEW)
            assert all(f.result(timeout=1).prefill == pre[1].address for f, t in futures if t == pre[1].address)
            after = [decode.generate(t, NEW, timeout=60, return_kv=KV) for t in prompts(34, prefix=0, count=2)]
            assert {r.prefill for r in after} == {pre[1].address}
            added = PrefillWorker(WorkerConfig(name("prefill"), num_blocks=128), SECRET)
            decode.add_prefill(added.address)
            assert decode.prefills == [p.address for p in pre] + [added.address]
            batch = prompts(35, prefix=0, count=4)
            results = [f.result(timeout=60) for f in [decode.submit(t, NEW, return_kv=KV) for t in batch]]
            assert added.address in {r.prefill for r in results}
            for res, tokens in zip(results, batch, strict=True):
                assert_matches_reference(res, tokens, NEW)
            assert decode.remove_prefill(pre[0].address) and not decode.remove_prefill(pre[0].address)
            wait_idle(decode, pre[1], added, timeout=20.0)
    finally:
        close_all(*pre, *([added] if added is not None else []))


def test_bad_prefill_lists_are_refused() -> None:
    (pre,) = prefills(1)
    try:
        with pytest.raises(ConfigError, match="duplicate"):
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=[pre.address] * 2)
        with pytest.raises(ConfigError, match="empty"):
            DecodeWorker(WorkerConfig(name("decode")), SECRET, prefill=[])
    finally:
        pre.close()
    assert parse_prefills("a") == "a" and parse_prefills("a, b") == ["a", "b"]
    with pytest.raises(argparse.ArgumentTypeError, match="empty address"):
        parse_prefills("a,,b")
    with pytest.raises(argparse.ArgumentTypeError, match="duplicate address"):
        parse_prefills("a,b,a")
