"""Decode sends the prompt (``kv_request``) before it allocates its destination blocks, which follow in
``kv_blocks``: prefill computes while decode matches its prefix tree and evicts. Proven by order, not by
time: decode's allocation waits until prefill's model has started (or finished) computing, which a
decode that allocated first would wait for in vain. The KV oracle checks every request by position, and
the failure paths (decode cannot allocate, ``kv_blocks`` missing, repeated or malformed) free every block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.disagg.messages import KvFailed, KvPull, KvRelease
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import OutOfSlotsError, PeerUnreachable
from tests.e2e.test_loopback import (  # noqa: F401 (_one_thread: autouse leak check)
    KV,
    NEW,
    SECRET,
    HandDecode,
    _one_thread,
    assert_idle,
    assert_matches_reference,
    name,
    prompts,
)
from tests.faults.test_loopback_faults import wait_for


@pytest.fixture
def prefill() -> Iterator[PrefillWorker]:
    with PrefillWorker(WorkerConfig(name("prefill"), num_blocks=256), SECRET) as worker:
        yield worker


def wait_idle(prefill: PrefillWorker) -> None:
    """Until prefill holds no slot and no open cache (a request ended while computing is freed when its
    compute is done)."""
    wait_for("prefill to free every request", lambda: prefill.held_slots() == 0 and prefill.num_open_caches() == 0)


class ComputeWatch:
    """Wraps a prefill worker's model: ``started`` / ``finished`` are set around each prefill compute."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.started, self.finished = threading.Event(), threading.Event()
        model, original = worker.model, worker.model.prefill

        def watched(*args: Any, **kwargs: Any) -> Any:
            self.started.set()
            try:
                return original(*args, **kwargs)
            finally:
                self.finished.set()

        model.prefill = watched   # type: ignore[method-assign]


@pytest.mark.parametrize("until", ["started", "finished"])
@pytest.mark.parametrize(("mode", "layerwise"), [("push", False), ("pull", False), ("push", True)])
def test_prefill_computes_while_decode_allocates(prefill: PrefillWorker, mode: str, layerwise: bool,
                                                 until: str) -> None:
    """Decode's allocation of each request waits until prefill's compute has ``until`` (at most 10 s):
    only a decode that sent the prompt first sees it. With ``finished``, every layer group (layer-wise)
    and the whole compute wait for ``kv_blocks`` on prefill's side; the KV is right either way."""
    watch = ComputeWatch(prefill)
    seen: list[bool] = []
    with DecodeWorker(WorkerConfig(name("decode"), num_blocks=256), SECRET, prefill=prefill.address, mode=mode,
                      layerwise=layerwise) as decode:
        manager = decode.managers[0]
        create_kv_cache = manager.create_kv_cache_for_prompt

        def allocate_after_prefill_computes(*args: Any, **kwargs: Any) -> Any:
            seen.append(getattr(watch, until).wait(10.0))
            return create_kv_cache(*args, **kwargs)

        manager.create_kv_cache_for_prompt = allocate_after_prefill_computes   # type: ignore[method-assign]
        for tokens in prompts(11):
            watch.started.clear()
            watch.finished.clear()
            res = decode.generate(tokens, NEW, timeout=60, return_kv=KV)
            assert_matches_reference(res, tokens, NEW)
            assert res.allocate_s > 0 and res.mode == mode and res.layerwise == layerwise
            assert res.ttft_s == res.arrival_s and res.commit_s > 0   # the commit follows the first token
        assert seen == [True, True, True], "decode allocated before prefill had the prompt"
        assert_idle(prefill, decode)


def test_decode_that_cannot_allocate_cancels_the_computing_prefill(prefill: PrefillWorker) -> None:
    """Decode holds 4 blocks (64 tokens): a 100-token prompt fails there with OutOfSlotsError after prefill
    already has it; prefill is told (``kv_cancel``), frees the request's blocks once its compute is done,
    and both workers then serve a prompt that fits."""
    with DecodeWorker(WorkerConfig(name("decode"), num_blocks=4), SECRET, prefill=prefill.address) as decode:
        big = np.random.default_rng(12).integers(0, 512, 100)
        with pytest.raises(OutOfSlotsError, match="no free slots for 100 tokens"):
            decode.generate(big, NEW, timeout=30)
        wait_for("prefill to end the request", lambda: any("cancelled by decode: decode could not allocate" in r
                                                           for r in prefill.stats.reasons))
        wait_idle(prefill)
        assert_idle(decode)
        small = prompts(13, prefix=20, count=1)[0]
        assert_matches_reference(decode.generate(small, NEW, timeout=30, return_kv=KV), small, NEW)
        assert_idle(prefill, decode)


@pytest.fixture
def hand(prefill: PrefillWorker) -> Iterator[HandDecode]:
    peer = HandDecode(prefill)
    try:
        yield peer
    finally:
        peer.close()


def test_prefill_waits_for_kv_blocks_only_as_long_as_the_lease(prefill: PrefillWorker, hand: HandDecode) -> None:
    """A decode that sends the prompt and never its blocks: prefill computes, holds the blocks until the
    0.5 s lease runs out (nothing renews it), then frees them all and says why."""
    tokens = prompts(14)[0]
    hand.request("q1", tokens, lease_s=0.5)
    failed = hand.conn.recv(10)
    assert isinstance(failed, KvFailed) and failed.request_id == "q1" and "lease expired" in failed.reason
    wait_idle(prefill)


def test_kv_blocks_out_of_range_skip_fails_the_request(prefill: PrefillWorker, hand: HandDecode) -> None:
    tokens = prompts(15)[0]
    hand.request("q2", tokens)
    cache = hand.blocks("q2", tokens, skip=int(tokens.size))
    failed = hand.conn.recv(10)
    assert isinstance(failed, KvFailed) and f"kv_blocks.skip={tokens.size} outside [0, {tokens.size})" in \
        failed.reason
    wait_idle(prefill)
    cache.close()


def test_kv_blocks_for_an_unknown_request_is_ignored(prefill: PrefillWorker, hand: HandDecode) -> None:
    """A ``kv_blocks`` crossing prefill's ``kv_failed`` (or for an id never asked) changes nothing: the
    connection stays up and the next request is served."""
    tokens = prompts(16)[0]
    stray = hand.blocks("never-asked", tokens)
    hand.request("q3", tokens)
    cache = hand.blocks("q3", tokens)
    pull = hand.conn.recv(10)
    assert isinstance(pull, KvPull) and pull.request_id == "q3"
    hand.conn.send(KvRelease(request_id="q3"))
    wait_idle(prefill)
    cache.close()
    stray.close()


def test_a_second_kv_blocks_is_a_protocol_error(prefill: PrefillWorker, hand: HandDecode) -> None:
    """Destinations are set once: a second ``kv_blocks`` for the same request ends the connection (a peer
    that breaks the protocol), and every block of its requests is freed."""
    tokens = prompts(17)[0]
    hand.request("q4", tokens)
    first = hand.blocks("q4", tokens)
    assert isinstance(hand.conn.recv(10), KvPull)
    second = hand.blocks("q4", tokens)
    with pytest.raises(PeerUnreachable, match="kv_blocks: a second one for request 'q4'"):
        for _ in range(50):
            hand.conn.recv(0.2)
    wait_for("prefill to drop the peer", lambda: prefill.status()["peers"] == 0)
    wait_idle(prefill)
    first.close()
    second.close()
