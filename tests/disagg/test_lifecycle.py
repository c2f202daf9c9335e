"""Worker lifecycle in one process: ``drain`` stops taking requests and lets those in flight finish (or
leaves them to ``close``, which fails them with WorkerShuttingDown), and a request whose prefill stops or
goes away before its KV reached decode is sent to another prefill without the caller seeing it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.errors import PeerUnreachable, TransferFailed, WorkerShuttingDown
from tests.disagg.test_xpyd import close_all, prefills, wait_idle
from tests.e2e.test_loopback import (  # noqa: F401 (_one_thread: autouse leak check)
    KV,
    NEW,
    SECRET,
    _one_thread,
    assert_matches_reference,
    name,
    prompts,
)


def long_prompt(seed: int, length: int = 900) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, length)


def test_decode_drain_finishes_requests_in_flight_and_refuses_new_ones() -> None:
    """A request in flight when the drain starts completes with exact tokens; one submitted during the
    drain fails at once with WorkerShuttingDown naming the worker; the drain reports success."""
    pre = prefills(1)
    try:
        decode = DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET, prefill=pre[0].address)
        try:
            tokens = long_prompt(1)
            fut = decode.submit(tokens, NEW, return_kv=KV)
            drained: list[bool] = []
            drainer = threading.Thread(target=lambda: drained.append(decode.drain(60.0)))
            drainer.start()
            deadline = time.monotonic() + 10
            while not decode.status()["draining"] and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = decode.submit(prompts(2)[0], NEW)
            with pytest.raises(WorkerShuttingDown, match=f"decode worker {decode.config.name} shutting down"):
                refused.result(timeout=10)
            drainer.join(60)
            assert drained == [True]
            assert_matches_reference(fut.result(timeout=1), tokens, NEW)
            assert decode.status()["jobs"] == 0
            wait_idle(decode, *pre)
        finally:
            decode.close()
    finally:
        close_all(*pre)


def test_decode_drain_timeout_leaves_requests_to_close_which_fails_them_with_the_shutdown() -> None:
    """A zero drain deadline with a request in flight: ``drain`` says so (False), and ``close`` fails the
    request with WorkerShuttingDown; nothing stays held on prefill."""
    pre = prefills(1)
    try:
        decode = DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET, prefill=pre[0].address)
        fut = decode.submit(long_prompt(3, 1500), NEW)
        deadline = time.monotonic() + 10
        while decode.status()["jobs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert decode.drain(0.0) is False
        decode.close()
        with pytest.raises(WorkerShuttingDown, match="shutting down"):
            fut.result(timeout=10)
        wait_idle(*pre)
    finally:
        close_all(*pre)


def test_a_draining_prefill_sends_new_requests_to_another_without_an_error() -> None:
    """Prefill A drains: a request naming A is refused there (a shutdown reason) and completes on B with
    exact tokens; decode counts the failover and sends the next request to B directly."""
    pre = prefills(2)
    a, b = pre
    try:
        with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET,
                          prefill=[a.address, b.address]) as decode:
            assert a.drain(5.0) is True
            tokens = prompts(5)[0]
            res = decode.generate(tokens, NEW, timeout=60, return_kv=KV, prefill=a.address)
            assert res.prefill == b.address
            assert_matches_reference(res, tokens, NEW)
            assert decode.status()["failovers"] == 1
            other = prompts(6)[1]
            res = decode.generate(other, NEW, timeout=60, return_kv=KV)
            assert res.prefill == b.address and decode.status()["failovers"] == 1
            assert a.status()["completed"] == 0
            wait_idle(decode, *pre)
    finally:
        close_all(*pre)


def test_closing_prefill_sends_its_requests_in_flight_to_another() -> None:
    """Long requests in flight on A when A closes (its open requests fail with the shutdown reason, or the
    connection drops first): each completes on B with exact tokens; nothing stays held."""
    pre = prefills(2)
    a, b = pre
    try:
        with DecodeWorker(WorkerConfig(name("decode"), num_blocks=512, lease_s=1.0), SECRET,
                          prefill=[a.address, b.address], connect_timeout=1.0) as decode:
            batch = [long_prompt(10 + i) for i in range(3)]
            futures = [decode.submit(t, NEW, return_kv=KV, prefill=a.address) for t in batch]
            deadline = time.monotonic() + 10
            while a.status()["jobs"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            a.close()
            for fut, tokens in zip(futures, batch, strict=True):
                res = fut.result(timeout=60)
                assert_matches_reference(res, tokens, NEW)
            assert decode.status()["failovers"] >= 1
            assert decode.status()["failed"] == 0
            wait_idle(decode, b, timeout=20.0)
    finally:
        close_all(*pre)


def test_without_another_prefill_the_request_fails() -> None:
    """One prefill, closed with a request in flight: no other prefill can take it, so the caller gets the
    error (the shutdown reason, or the lost connection)."""
    pre = prefills(1)
    try:
        with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256, lease_s=1.0), SECRET,
                          prefill=pre[0].address, connect_timeout=1.0) as decode:
            fut = decode.submit(long_prompt(20, 1500), NEW)
            deadline = time.monotonic() + 10
            while pre[0].status()["jobs"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            pre[0].close()
            with pytest.raises((PeerUnreachable, TransferFailed), match=r"shutting down|lost"):
                fut.result(timeout=60)
            assert decode.status()["failovers"] == 0
    finally:
        close_all(*pre)


def test_a_draining_decode_still_fails_over_its_requests_in_flight() -> None:
    """Decode drains with a request in flight on A, and A closes: the request completes on B with exact
    tokens and the drain ends with nothing left."""
    pre = prefills(2)
    a, b = pre
    try:
        with DecodeWorker(WorkerConfig(name("decode"), num_blocks=512, lease_s=1.0), SECRET,
                          prefill=[a.address, b.address], connect_timeout=1.0) as decode:
            tokens = long_prompt(30, 1500)
            fut = decode.submit(tokens, NEW, return_kv=KV, prefill=a.address)
            deadline = time.monotonic() + 10
            while a.status()["jobs"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            drained: list[bool] = []
            drainer = threading.Thread(target=lambda: drained.append(decode.drain(60.0)))
            drainer.start()
            a.close()
            res = fut.result(timeout=60)
            drainer.join(60)
            assert drained == [True]
            assert res.prefill == b.address and decode.status()["failovers"] == 1
            assert_matches_reference(res, tokens, NEW)
    finally:
        close_all(*pre)


def test_a_failover_waits_for_the_pages_its_lost_attempt_still_holds() -> None:
    """Decode has room for one long request only; its prefill is removed mid-push, so the attempt's pages
    stay quarantined (the prefill might still write there) for about two leases: the failover attempt waits
    for them instead of failing, then completes on B with exact tokens; nothing stays held."""
    pre = prefills(2)
    a, b = pre
    try:
        with DecodeWorker(WorkerConfig(name("decode"), num_blocks=150, lease_s=1.0), SECRET,
                          prefill=[a.address, b.address], connect_timeout=1.0) as decode:
            tokens = long_prompt(40, 1500)   # 94 of the 150 blocks: a second copy does not fit
            fut = decode.submit(tokens, NEW, return_kv=KV, prefill=a.address)
            deadline = time.monotonic() + 10
            while a.status()["jobs"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            t0 = time.monotonic()
            assert decode.remove_prefill(a.address)
            res = fut.result(timeout=60)
            assert res.prefill == b.address and decode.status()["failovers"] == 1
            assert time.monotonic() - t0 >= 1.0   # it waited for the quarantine (lease 1 s, plus one more)
            assert_matches_reference(res, tokens, NEW)
            wait_idle(decode, b, timeout=20.0)
    finally:
        close_all(*pre)
