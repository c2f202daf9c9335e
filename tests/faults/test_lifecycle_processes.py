"""Worker lifecycle with real processes over UCX on 127.0.0.1, under steady load.

Two prefill processes and one decode: SIGKILL or SIGTERM to one prefill loses no request (failover sends
what it had not delivered to the other; every token is exact by the KV oracle; decode holds nothing
afterwards). SIGTERM to a decode process: every request in flight completes with exact tokens or fails
with the shutdown error within the drain deadline, the process exits 0 and prefill holds nothing; a
second signal ends the drain at once, still with exit status 0.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from kvxfer.cli.demo import WorkerProcess
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_client import ClientResult, GenerateClient, query_status
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.disagg.worker_prefill import PrefillWorker
from kvxfer.errors import KvxferError
from tests.e2e.test_loopback import KV, NEW, assert_matches_reference
from tests.faults.conftest import wait_until
from tests.faults.test_process_faults import (  # noqa: F401 (fixtures: backend, autouse child check)
    HEARTBEAT_LIMIT,
    LEASE_S,
    MARGIN,
    RECONNECT_S,
    SECRET,
    _no_child_left,
    assert_holds_nothing,
    backend,
    name,
    reap,
    spawn,
)

Outcome = tuple[np.ndarray, GenerationResult | KvxferError]


def _outcome(fut: Future[GenerationResult], timeout: float) -> GenerationResult | KvxferError:
    try:
        return fut.result(timeout=timeout)
    except KvxferError as exc:
        return exc


def _load(decode: DecodeWorker, clients: int, per_client: int, seed: int) -> tuple[list[Outcome], list[threading.Thread]]:
    """``clients`` threads, each sending ``per_client`` requests one after the other (200 to 900 tokens)."""
    done: list[Outcome] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        rng = np.random.default_rng(seed + k)
        for _ in range(per_client):
            tokens = rng.integers(0, 512, int(rng.integers(200, 900)))
            got = _outcome(decode.submit(tokens, NEW, return_kv=KV), 120)
            with lock:
                done.append((tokens, got))

    threads = [threading.Thread(target=client, args=(k,), name=f"load-{k}") for k in range(clients)]
    for t in threads:
        t.start()
    return done, threads


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_one_of_two_prefills_stopped_under_load_loses_no_request(backend: str, sig: signal.Signals) -> None:  # noqa: F811
    """2P x 1D under steady load; ``sig`` to one prefill while requests are in flight on it: 0 failed
    requests, every token exact, at least one request moved to the survivor, 0 held slots at the end; a
    SIGTERMed prefill drains and exits 0."""
    victim, survivor = spawn("prefill", backend), spawn("prefill", backend)
    try:
        cfg = WorkerConfig(name("decode"), backend=backend, num_blocks=1024, lease_s=LEASE_S)
        with DecodeWorker(cfg, SECRET, prefill=[victim.address, survivor.address],
                          connect_timeout=RECONNECT_S) as decode:
            done, threads = _load(decode, clients=3, per_client=6, seed=100)
            wait_until(lambda: len(done) >= 3, 120, "the load is running")
            rng = np.random.default_rng(7)
            named = [rng.integers(0, 512, 1500) for _ in range(2)]
            futures = [decode.submit(t, NEW, return_kv=KV, prefill=victim.address) for t in named]
            wait_until(lambda: int(query_status(victim.address, SECRET)["jobs"]) > 0, 30, "the victim computes")
            victim.proc.send_signal(sig)
            stopped_at = time.monotonic()
            outcomes = [(t, _outcome(f, 120)) for f, t in zip(futures, named, strict=True)]
            for t in threads:
                t.join(180)
            assert not any(t.is_alive() for t in threads), "a load client hangs"
            outcomes += done
            failed = [got for _, got in outcomes if not isinstance(got, GenerationResult)]
            assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:3]}"
            for tokens, got in outcomes:
                assert isinstance(got, GenerationResult)
                assert_matches_reference(got, tokens, NEW)
            status = decode.status()
            assert status["failed"] == 0 and status["completed"] == len(outcomes), status
            if sig is signal.SIGKILL:   # a drained prefill may finish its requests itself
                assert status["failovers"] >= 1, status
            assert victim.proc.wait(60) == (0 if sig is signal.SIGTERM else -signal.SIGKILL)
            assert time.monotonic() - stopped_at < HEARTBEAT_LIMIT + MARGIN + 60
            assert_holds_nothing(decode)
            wait_until(lambda: int(query_status(survivor.address, SECRET)["held_slots"]) == 0, MARGIN,
                       "the survivor frees every block")
    finally:
        reap(victim, survivor)


def _client_load(address: str, clients: int, stop: threading.Event, seed: int,
                 ) -> tuple[list[tuple[np.ndarray, ClientResult | KvxferError]], list[threading.Thread]]:
    """``clients`` GenerateClient threads sending requests one after the other until ``stop`` is set."""
    done: list[tuple[np.ndarray, ClientResult | KvxferError]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        rng = np.random.default_rng(seed + k)
        conn = GenerateClient(address, SECRET, timeout=30.0)
        try:
            while not stop.is_set():
                tokens = rng.integers(0, 512, int(rng.integers(200, 900)))
                rid = conn.submit(tokens, NEW, return_kv=KV)
                got: ClientResult | KvxferError
                try:
                    got = conn.recv(90.0)
                    assert got.request_id == rid
                except KvxferError as exc:
                    got = exc
                with lock:
                    done.append((tokens, got))
                if isinstance(got, KvxferError) or not got.ok:
                    return
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(k,), name=f"client-{k}") for k in range(clients)]
    for t in threads:
        t.start()
    return done, threads


@pytest.mark.slow
@pytest.mark.parametrize("drain", [5.0, 0.0], ids=["drain-5s", "drain-0s"])
def test_decode_sigterm_under_load_completes_or_fails_with_the_shutdown(backend: str, drain: float) -> None:  # noqa: F811
    """A ``kvxfer serve decode`` process under steady client load gets SIGTERM: each request in flight
    completes with exact tokens or fails with WorkerShuttingDown (one still on its way when decode closes
    sees the connection end with the shutdown as its reason); none hangs; the process exits 0 within the
    drain deadline plus its release; prefill holds nothing afterwards."""
    with PrefillWorker(WorkerConfig(name("prefill"), backend=backend, num_blocks=1024), SECRET) as prefill:
        assert prefill.address is not None
        decode = spawn("decode", backend, "--prefill", prefill.address, "--drain-timeout", str(drain))
        stop = threading.Event()
        try:
            done, threads = _client_load(decode.address, 3, stop, seed=200)
            wait_until(lambda: len(done) >= 3, 120, "the load is running")
            stop.set()   # requests already sent stay in flight; no client sends another
            decode.proc.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            status = decode.proc.wait(drain + 30)
            took = time.monotonic() - stopped_at
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "a client hangs"
            assert status == 0, "".join(decode.stderr[-20:])
            assert took < drain + 30
            for tokens, got in done:
                if isinstance(got, KvxferError):   # sent as decode closed: its connection ends, naming why
                    assert "decode worker shutting down" in str(got), got
                    continue
                if got.ok:
                    assert_matches_reference(got, tokens, NEW)
                else:
                    assert got.error.startswith("WorkerShuttingDown: decode worker"), got.error
            assert any("drained in" in line or "drain timeout ended the drain" in line for line in decode.stderr)
            wait_until(lambda: prefill.held_slots() == 0 and prefill.num_open_caches() == 0, LEASE_S * 10 + MARGIN,
                       "prefill frees every block")
        finally:
            stop.set()
            reap(decode)


def test_a_second_signal_ends_the_drain_at_once_with_status_zero(backend: str) -> None:  # noqa: F811
    """Decode's requests wait on a frozen prefill; the first SIGTERM starts a 120 s drain, the second ends
    it: the process exits 0 within seconds and the waiting request fails with WorkerShuttingDown."""
    prefill = spawn("prefill", backend)
    decode: WorkerProcess | None = None
    try:
        decode = spawn("decode", backend, "--prefill", prefill.address, "--drain-timeout", "120")
        client = GenerateClient(decode.address, SECRET, timeout=30.0)
        try:
            warm = np.random.default_rng(300).integers(0, 512, 100)
            assert client.generate(warm, NEW, timeout=60).ok
            prefill.proc.send_signal(signal.SIGSTOP)
            client.submit(np.random.default_rng(301).integers(0, 512, 200), NEW)
            time.sleep(0.5)
            decode.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: any("SIGTERM: draining" in line for line in decode.stderr), 30, "decode drains")
            decode.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            try:
                status = decode.proc.wait(20)
            except subprocess.TimeoutExpired:
                raise AssertionError("decode did not exit within 20 s of the second signal") from None
            assert status == 0, "".join(decode.stderr[-20:])
            assert time.monotonic() - t0 < 20
            assert any("a second signal ended the drain" in line for line in decode.stderr), decode.stderr[-5:]
            got = client.recv(10.0)
            assert not got.ok and got.error.startswith("WorkerShuttingDown"), got
        finally:
            client.close()
    finally:
        reap(prefill, decode)
