"""xPyD over UCX on 127.0.0.1: three prefill processes (``kvxfer serve prefill``) feed two decode workers
(in this process, so their slot accounting is read directly). Every request's KV is checked by the KV
oracle; one prefill is SIGKILLed with requests in flight and a new one joins while serving.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvxfer.cli.demo import WorkerProcess
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import query_status
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.errors import KvxferError
from tests.e2e.test_loopback import KV, NEW, assert_matches_reference, prompts
from tests.faults.conftest import assert_settled, wait_until
from tests.faults.test_process_faults import (  # noqa: F401 (fixtures: backend, autouse child check)
    HEARTBEAT_LIMIT,
    LEASE_S,
    MARGIN,
    RECONNECT_S,
    SECRET,
    _no_child_left,
    backend,
    name,
    reap,
    spawn,
)


def outcome(fut: Future[GenerationResult]) -> GenerationResult | KvxferError:
    try:
        return fut.result(timeout=90)
    except KvxferError as exc:
        return exc


def test_three_prefills_two_decodes_survive_a_kill_and_use_a_joining_prefill(backend: str) -> None:  # noqa: F811
    """3P x 2D: requests spread over all prefills; SIGKILL one with requests queued on it: none fails (those
    sent to it go to a survivor: failover), every result is right by the oracle, later requests avoid it;
    a new prefill added to both decodes serves the next requests; no worker holds a slot afterwards."""
    procs: list[WorkerProcess] = []
    joined: WorkerProcess | None = None
    decodes: list[DecodeWorker] = []
    try:
        with ThreadPoolExecutor(3) as pool:   # start the three prefill processes side by side
            procs = list(pool.map(lambda _: spawn("prefill", backend), range(3)))
        addresses = [p.address for p in procs]
        for _ in range(2):
            decodes.append(DecodeWorker(WorkerConfig(name("decode"), backend=backend, num_blocks=512, lease_s=LEASE_S),
                                        SECRET, prefill=addresses, connect_timeout=RECONNECT_S))
        checked = 0
        # Warm-up: least-loaded choice spreads concurrent requests over all three prefills.
        warm = [(d.submit(t, NEW, return_kv=KV), t) for d in decodes for t in prompts(50 + len(decodes), prefix=0, count=3)]
        for fut, tokens in warm:
            assert_matches_reference(fut.result(timeout=90), tokens, NEW)
            checked += 1
        assert {fut.result().prefill for fut, _ in warm} == set(addresses)

        # Long requests, named to each prefill in turn; the victim gets a queue of its own.
        victim = procs[0]
        rng = np.random.default_rng(77)
        sent: list[tuple[Future[GenerationResult], np.ndarray, str]] = []
        for i in range(12):
            target = addresses[i % 3]
            tokens = rng.integers(0, 512, 1500 if target == victim.address else 300)
            d = decodes[i % 2]
            sent.append((d.submit(tokens, NEW, return_kv=KV, prefill=target), tokens, target))
        wait_until(lambda: int(query_status(victim.address, SECRET)["jobs"]) > 0, 30, "the victim works on a request")
        victim.kill()
        killed_at = time.monotonic()
        for fut, tokens, target in sent:
            got = outcome(fut)
            assert isinstance(got, GenerationResult), f"a request sent to {target} failed: {got!r}"
            assert_matches_reference(got, tokens, NEW)
            checked += 1
        assert sum(int(d.status()["failovers"]) for d in decodes) >= 1, "no request was in flight on the killed prefill"
        assert all(got.prefill != victim.address for got in (f.result() for f, _, t in sent if t == victim.address)
                   if got.arrived_at > killed_at)
        assert time.monotonic() - killed_at < HEARTBEAT_LIMIT + MARGIN + 30

        # After the loss: requests (even those naming the dead prefill) go to the survivors.
        after = [(d.submit(t, NEW, return_kv=KV, prefill=victim.address), t) for d in decodes
                 for t in prompts(60, prefix=20, count=2)]
        for fut, tokens in after:
            res = fut.result(timeout=90)
            assert res.prefill in addresses[1:]
            assert_matches_reference(res, tokens, NEW)
            checked += 1

        # A new prefill joins both decodes while they serve; the next requests use it.
        joined = spawn("prefill", backend)
        for d in decodes:
            d.add_prefill(joined.address)
        fresh = [(d.submit(t, NEW, return_kv=KV), t) for d in decodes for t in prompts(70, prefix=0, count=3)]
        results = []
        for fut, tokens in fresh:
            results.append(fut.result(timeout=90))
            assert_matches_reference(results[-1], tokens, NEW)
            checked += 1
        assert joined.address in {r.prefill for r in results}
        assert victim.address not in {r.prefill for r in results}
        assert checked == len(warm) + len(sent) + len(after) + len(fresh)

        for d in decodes:
            assert d.status()["prefills_connected"] == 3
            wait_until(lambda d=d: d.held_slots() == 0, HEARTBEAT_LIMIT + 3 * LEASE_S + MARGIN,  # type: ignore[misc]
                       "decode frees the lost prefill's quarantined blocks")
            assert_settled(d, timeout=MARGIN)
        for p in [*procs[1:], joined]:
            status = query_status(p.address, SECRET)
            wait_until(lambda p=p: int(query_status(p.address, SECRET)["held_slots"]) == 0,  # type: ignore[misc]
                       MARGIN, f"prefill {p.address} frees every block")
            assert int(status["failed"]) == 0, status
    finally:
        for d in decodes:
            d.close()
        reap(*procs, joined)
