"""Failover and drain figures: two ``kvxfer serve prefill`` processes feed one decode worker (in this
process, so its slot accounting is read directly) under steady load from ``--clients`` threads for
``--seconds``; a third of the way in, one prefill gets ``--signal`` (KILL: a crash; TERM: a drain).

    python benchmarks/bench_failover.py [--backend auto] [--signal KILL|TERM] [--clients 3] [--seconds 12]
                                        [--repeats 3] [--json]

Per repeat it reports the requests completed and failed, how many decode sent to the surviving prefill
(failovers), every request checked against a single-process reference (tokens and sampled prompt KV,
``kvxfer.disagg.oracle``), the slowest request that crossed the signal next to the median of the others,
decode's held slots once its quarantine has passed, and the signalled prefill's exit status. Exit
status 1 when a request failed or differs from the reference, or a slot stays held.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from kvxfer.cli.demo import WorkerProcess
from kvxfer.cli.serve import best_backend
from kvxfer.disagg.auth import SECRET_ENV
from kvxfer.disagg.oracle import DEFAULT_POSITIONS, KVOracle
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.errors import KvxferError
from kvxfer.model import preset

NEW = 8
LEASE_S = 1.0


def one_run(backend: str, sig: signal.Signals, clients: int, seconds: float, seed: int,
            oracle: KVOracle) -> dict[str, Any]:
    """One repeat: start the workers, load them, signal one prefill, check every request."""
    secret = secrets.token_hex(32)
    env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [WorkerProcess(["prefill", "--backend", backend, "--name", f"failover-prefill-{seed}-{i}"], env, 120.0)
             for i in range(2)]
    records: list[tuple[np.ndarray, float, float, GenerationResult | KvxferError]] = []
    lock = threading.Lock()
    stop = threading.Event()
    try:
        cfg = WorkerConfig(f"failover-decode-{seed}", backend=backend, num_blocks=2048, lease_s=LEASE_S)
        with DecodeWorker(cfg, secret, prefill=[p.address for p in procs], connect_timeout=1.0) as decode:
            def client(k: int) -> None:
                rng = np.random.default_rng(seed * 100 + k)
                while not stop.is_set():
                    tokens = rng.integers(0, 512, int(rng.integers(200, 900)))
                    t0 = time.monotonic()
                    got: GenerationResult | KvxferError
                    try:
                        got = decode.submit(tokens, NEW, return_kv=DEFAULT_POSITIONS).result(120)
                    except KvxferError as exc:
                        got = exc
                    with lock:
                        records.append((tokens, t0, time.monotonic(), got))

            threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
            for t in threads:
                t.start()
            time.sleep(seconds / 3)
            victim = procs[0]
            victim.proc.send_signal(sig)
            signalled = time.monotonic()
            time.sleep(seconds * 2 / 3)
            stop.set()
            for t in threads:
                t.join(180)
            status = decode.status()
            print(f"run {seed}: load stopped; {status['failovers']} failovers", file=sys.stderr, flush=True)
            settle = time.monotonic() + 3 * LEASE_S + 10
            while (decode.held_slots() or decode.status()["zombies"]) and time.monotonic() < settle:
                time.sleep(0.05)
            held = decode.held_slots()
            exit_status = victim.proc.wait(60)
    finally:
        stop.set()
        for p in procs:
            p.stop()
    print(f"run {seed}: {len(records)} requests served; checking them against the reference", file=sys.stderr,
          flush=True)
    failed = [r for r in records if not isinstance(r[3], GenerationResult)]
    wrong = 0
    for tokens, _, _, got in records:
        if isinstance(got, GenerationResult) and not oracle.check_request(tokens, NEW, got.tokens, got.prompt_kv).ok:
            wrong += 1
    crossing = [end - start for _, start, end, _ in records if start <= signalled <= end]
    others = [end - start for _, start, end, _ in records if not start <= signalled <= end]
    return {"signal": sig.name, "requests": len(records), "failed": len(failed), "wrong": wrong,
            "failovers": int(status["failovers"]), "held_slots_after": held,
            "victim_exit_status": exit_status,
            "crossing_max_s": max(crossing) if crossing else 0.0,
            "others_median_s": statistics.median(others) if others else 0.0,
            "failure_examples": [repr(r[3])[:200] for r in failed[:3]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--signal", choices=("KILL", "TERM"), default="KILL")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    backend = best_backend() if a.backend == "auto" else a.backend
    sig = signal.Signals[f"SIG{a.signal}"]
    oracle = KVOracle(preset("tiny"))
    runs = [one_run(backend, sig, a.clients, a.seconds, seed, oracle) for seed in range(a.repeats)]
    out = {"backend": backend, "clients": a.clients, "seconds": a.seconds, "runs": runs}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for r in runs:
            print(f"{r['signal']}: {r['requests']} requests, {r['failed']} failed, {r['wrong']} wrong, "
                  f"{r['failovers']} failovers, {r['held_slots_after']} slots held after, victim exit "
                  f"{r['victim_exit_status']}, slowest crossing request {r['crossing_max_s']:.2f} s "
                  f"(others median {r['others_median_s']:.2f} s)")
    bad = any(r["failed"] or r["wrong"] or r["held_slots_after"] for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
