"""Position-keyed checksums in the real workers over loopback: layer-wise pushes whose last block prefill's
commit swaps for its prefix tree's copy pass ``--checksum full`` and still catch corruption, and the page
a delayed layer-wise write reads stays pinned (not freed, not reused) until the write completed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.cache import KVCacheManager
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import BlockIdError, IntegrityError
from kvxfer.model import preset
from kvxfer.transport import LoopbackFaults, available_backends
from kvxfer.transport.integrity import ChecksumPolicy
from tests.e2e.test_loopback import SECRET, _one_thread, name, reference  # noqa: F401  (autouse fixture)
from tests.faults.conftest import assert_settled

NEW = 8


def prompt(seed: int, length: int) -> npt.NDArray[np.int64]:
    return np.random.default_rng(500 + seed).integers(0, 512, length).astype(np.int64)


@pytest.fixture
def faults() -> LoopbackFaults:
    return LoopbackFaults()


@pytest.fixture
def layerwise_pair(faults: LoopbackFaults) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    with PrefillWorker(WorkerConfig(name("prefill"), num_blocks=256), SECRET,
                       transport_options={"faults": faults}) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), num_blocks=256, checksum=ChecksumPolicy()), SECRET,
                         prefill=prefill.address, mode="push", layerwise=True, layers_per_send=1) as decode:
        yield prefill, decode


def test_layerwise_full_checksum_passes_healthy_requests_with_prefix_hits_and_catches_corruption(
        layerwise_pair: tuple[PrefillWorker, DecodeWorker], faults: LoopbackFaults) -> None:
    """24 requests: exact repeats (prefill recomputes the last token into a copy of its last block, then
    adopts the tree's block at commit), shared prefixes, concurrent duplicates; all verify and match."""
    prefill, decode = layerwise_pair
    bases = [prompt(1, 32), prompt(2, 48), prompt(3, 45)]
    requests = []
    for i, base in enumerate(bases):
        requests += [base, base, np.concatenate([base, prompt(10 + i, 7)]), np.concatenate([base[:20], prompt(20 + i, 19)])]
    requests += [*bases, prompt(30, 33)] * 3    # in flight together: duplicates computed concurrently
    assert len(requests) == 24
    results = [decode.generate(t, NEW, timeout=60) for t in requests[:12]]
    futures = [decode.submit(t, NEW) for t in requests[12:]]
    results += [f.result(60) for f in futures]
    for tokens, res in zip(requests, results, strict=True):
        assert res.tokens == reference(tokens, NEW)
        assert res.verify_s > 0.0
    assert any(r.reused_tokens_prefill == r.prompt_tokens - 1 and r.prompt_tokens % 16 == 0 for r in results)
    assert any(r.reused_tokens_decode > 0 for r in results)
    assert decode.status()["integrity_failures"] == 0
    faults.corrupt = (300, 1)                   # one byte of the first layer's write
    # Which tokens that write starts with depends on whether decode's destinations (kv_blocks) arrived
    # before prefill's first chunk [0, 32) finished layer 0 (else the first write is the last chunk's).
    with pytest.raises(IntegrityError, match=r"KV differs from the source at layer 0 role 'key' head \d "
                                             r"tokens \[(0, 32|32, 40)\)"):
        decode.generate(prompt(4, 40), NEW, timeout=60)
    assert decode.status()["integrity_failures"] == 1
    assert_settled(prefill, decode)


def _in_flight(prefill: PrefillWorker, rid: str, other: str) -> dict[str, Any] | None:
    """On prefill's engine: the slots request ``rid``'s pending write reads vs. its cache's, and ``other``'s."""
    jobs = {job.request_id: job for job in prefill._jobs.values()}
    job, later = jobs.get(rid), jobs.get(other)
    if job is None or later is None or not later.handles or not job.handles or any(h.done() for h in job.handles):
        return None
    manager = prefill.managers[0]
    return {"sent": job.src_ids[0][0].tolist(), "now": job.caches[0].block_ids(0).tolist(),
            "refcount": manager.allocator(0).refcount.copy(), "other": later.caches[0].block_ids(0).tolist()}


def test_a_delayed_layerwise_write_keeps_its_source_page_after_commit_adopts_the_trees(
        layerwise_pair: tuple[PrefillWorker, DecodeWorker], faults: LoopbackFaults) -> None:
    """Request 2 repeats request 1's 32 tokens: prefill writes its last block from a private copy, and the
    commit at the end of the prompt swaps in the tree's identical block. With the write still pending,
    the copy must stay held and request 3 (allocating right after) must not get it."""
    prefill, decode = layerwise_pair
    first, other = prompt(5, 32), prompt(6, 48)
    assert decode.generate(first, NEW, timeout=60).tokens == reference(first, NEW)
    decode.engine.call(lambda: [m.reset_prefix_tree() for m in decode.managers], 10.0)   # decode needs it all
    faults.delay_s = 2.0
    a = decode.submit(first, NEW, request_id="again")
    b = decode.submit(other, NEW, request_id="other")
    seen = None
    deadline = time.monotonic() + 20.0
    while seen is None and time.monotonic() < deadline:
        seen = prefill.engine.call(lambda: _in_flight(prefill, "again", "other"), 10.0)
        time.sleep(0.01)
    assert seen is not None, "the delayed writes were not observed in flight"
    copy = seen["sent"][1]
    assert seen["now"][1] != copy                # the commit adopted the tree's block ...
    assert seen["refcount"][copy] >= 1           # ... yet the page being written from is still held
    assert copy not in seen["other"]             # and was not handed to the next request
    faults.delay_s = 0.0
    assert a.result(60).tokens == reference(first, NEW)
    assert b.result(60).tokens == reference(other, NEW)
    assert decode.status()["integrity_failures"] == 0
    assert_settled(prefill, decode)


@pytest.mark.parametrize(("mode", "layerwise"), [("push", False), ("push", True), ("pull", False)])
def test_checksum_across_tp_block_size_order_and_sliding_windows(mode: str, layerwise: bool) -> None:
    """Two prefill ranks (16 tokens/block, HND, prefill releasing old window blocks) against one decode
    rank (8 tokens/block, NHD): each side digests its own layout; repeats hit both prefix trees."""
    model = preset("tiny-swa")
    with PrefillWorker(WorkerConfig(name("prefill"), model=model, tp_size=2, chunk_size=32), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), model=model, tokens_per_block=8, head_order="NHD",
                                      checksum=ChecksumPolicy()), SECRET, prefill=prefill.address, mode=mode,
                         layerwise=layerwise) as decode:
        long_prompts = [prompt(40, 100), prompt(41, 77)]
        for tokens in [*long_prompts, *long_prompts]:
            res = decode.generate(tokens, NEW, timeout=60)
            assert res.tokens == reference(tokens, NEW, model) and res.verify_s > 0.0
        assert decode.status()["integrity_failures"] == 0
        assert_settled(prefill, decode)


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=pytest.mark.skipif(available_backends()[b] is not None, reason=str(available_backends()[b])))
    for b in ("nixl", "ucx")])
def test_layerwise_full_checksum_over_ucx_with_repeated_prompts(backend: str) -> None:
    """The issue's case over a real UCX transport: layer-wise pushes of repeated prompts (prefill adopts
    its tree's copy of the last block at commit) with ``--checksum full`` used to fail on a healthy pair
    (32 of 52 requests over NIXL before the fix); every request now verifies and matches."""
    bases = [prompt(60 + i, n) for i, n in enumerate((32, 48, 64))]
    with PrefillWorker(WorkerConfig(name("prefill"), backend=backend, num_blocks=256), SECRET) as prefill, \
            DecodeWorker(WorkerConfig(name("decode"), backend=backend, num_blocks=256, checksum=ChecksumPolicy()),
                         SECRET, prefill=prefill.address, layerwise=True, layers_per_send=1) as decode:
        for i in range(24):
            if i % 6 == 0:                # decode forgets: the whole prompt travels again
                decode.engine.call(lambda: [m.reset_prefix_tree() for m in decode.managers], 10.0)
            tokens = bases[i % 3]
            assert decode.generate(tokens, NEW, timeout=60).tokens == reference(tokens, NEW)
        assert decode.status()["integrity_failures"] == 0
        assert_settled(prefill, decode)


def test_pinned_pages_outlive_their_request_until_released() -> None:
    manager = KVCacheManager(preset("tiny").cache_config(16, 8))
    free = manager.num_free_slots()
    cache = manager.create_kv_cache(id="r")
    cache.resume()
    cache.resize(40)
    pin = manager.pin_pages({0: np.append(cache.block_ids(0), -1)})
    assert pin.num_pages == 3
    cache.close()
    assert manager.num_free_slots() == free - 3          # the request let go; the pin holds them
    pin.release()
    pin.release()                                         # once only
    assert manager.num_free_slots() == free
    with pytest.raises(BlockIdError, match="incref of free slot"):
        manager.pin_pages({0: [0]})
    manager.shutdown()
