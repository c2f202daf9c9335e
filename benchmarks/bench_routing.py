"""xPyD routing: prefill prefix-hit rate and TTFT with KV-aware routing vs round-robin.

Setup per policy (fresh processes, so both start cold): P prefill processes (``kvxfer serve prefill``
over UCX, each publishing its KV events with ``--kv-events``) and one decode worker in this process
connected to all of them. Workload: G shared prefixes ("system prompts") of L tokens, each request one
of them (seeded random order) plus a unique S-token suffix, N requests kept C at a time in flight.
Each prefill's cache holds about ``--prefill-blocks`` blocks: less than all prefixes, more than its share
of them, which is where routing matters. Policies: ``round-robin`` (request i to prefill i mod P) and
``kv-aware`` (``kvxfer.disagg.router.KVRouter``: the prefill announcing the longest cached prefix, then
the least loaded). Figures: prefix-hit rate = prompt tokens prefill did not recompute / prompt tokens
(and the ideal: every prefix computed once), TTFT median and p90 (decode's submit to first token with
the KV in place), wall time. Every request's tokens and committed KV are checked by the KV oracle after
the run (not timed). Prints a table and writes JSON to benchmarks/results/bench_routing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from threading import Semaphore

import numpy as np

from kvxfer.cli.demo import WorkerProcess
from kvxfer.cli.serve import best_backend
from kvxfer.disagg.oracle import DEFAULT_POSITIONS, KVOracle
from kvxfer.disagg.router import KVRouter, Route
from kvxfer.disagg.worker import WorkerConfig
from kvxfer.disagg.worker_decode import DecodeWorker, GenerationResult
from kvxfer.model import preset

SECRET = "bench-routing-secret-0123456789ab"
TPB = 16


def events_endpoint(proc: WorkerProcess, timeout: float = 30.0) -> str:
    """The ``KV events on ENDPOINT`` line a prefill prints after ``listening on``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(proc.stderr):
            if "KV events on " in line:
                return line.split("KV events on ", 1)[1].split(",")[0].strip()
        time.sleep(0.02)
    raise RuntimeError(f"prefill {proc.address} did not print its KV events endpoint: {''.join(proc.stderr[-5:])}")


def start_prefills(count: int, backend: str, blocks: int) -> list[tuple[WorkerProcess, str]]:
    env = {**os.environ, "KVXFER_SECRET": SECRET, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    procs = [WorkerProcess(["prefill", "--backend", backend, "--name", f"route-prefill-{os.getpid()}-{i}-{time.time_ns()}",
                            "--blocks", str(blocks), "--kv-events", "tcp://127.0.0.1:*"], env, 120.0)
             for i in range(count)]
    return [(p, events_endpoint(p)) for p in procs]


def workload(groups: int, prefix: int, suffix: int, requests: int, seed: int) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 512, prefix) for _ in range(groups)]
    order = [int(g) for g in rng.integers(0, groups, requests)]
    return [np.concatenate([systems[g], rng.integers(0, 512, suffix)]) for g in order], order


def run_policy(policy: str, a: argparse.Namespace, backend: str, prompts: list[np.ndarray],
               oracle: KVOracle) -> dict[str, float | int | str]:
    prefills = start_prefills(a.prefills, backend, a.prefill_blocks)
    addresses = [p.address for p, _ in prefills]
    router = KVRouter({p.address: ep for p, ep in prefills}, tokens_per_block=TPB) if policy == "kv-aware" else None
    try:
        with DecodeWorker(WorkerConfig(f"route-decode-{os.getpid()}-{policy}", backend=backend,
                                       num_blocks=a.decode_blocks), SECRET, prefill=addresses) as decode:
            time.sleep(0.5)   # the router's subscriptions are up before the first request
            slots = Semaphore(a.concurrency)
            futures: list[Future[GenerationResult]] = []
            t0 = time.perf_counter()
            for i, tokens in enumerate(prompts):
                slots.acquire()
                route: Route | None = router.route(tokens) if router is not None else None
                target = route.address if route is not None else addresses[i % len(addresses)]
                fut = decode.submit(tokens, a.new_tokens, prefill=target, return_kv=DEFAULT_POSITIONS)
                fut.add_done_callback(done(slots, router, route))
                futures.append(fut)
            results = [f.result(timeout=300) for f in futures]
            wall = time.perf_counter() - t0
    finally:
        if router is not None:
            router.close()
        for p, _ in prefills:
            p.stop()
    wrong = sum(not oracle.check_request(t, a.new_tokens, r.tokens, r.prompt_kv).ok
                for t, r in zip(prompts, results, strict=True))
    ttft = np.array([r.ttft_s for r in results]) * 1e3
    prompt_tokens = sum(r.prompt_tokens for r in results)
    per_prefill = [sum(r.prefill == ad for r in results) for ad in addresses]
    return {"policy": policy, "requests": len(results), "wrong": int(wrong),
            "prefix_hit_rate": sum(r.reused_tokens_prefill for r in results) / prompt_tokens,
            "ttft_median_ms": float(np.median(ttft)), "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "wall_s": wall, "requests_per_prefill": "/".join(map(str, per_prefill))}


def done(slots: Semaphore, router: KVRouter | None, route: Route | None) -> Callable[[Future[GenerationResult]], None]:
    def release(_: Future[GenerationResult]) -> None:
        if router is not None and route is not None:
            router.finished(route)
        slots.release()
    return release


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefills", type=int, default=3)
    p.add_argument("--groups", type=int, default=12, help="shared prefixes")
    p.add_argument("--prefix", type=int, default=512, help="tokens of each shared prefix")
    p.add_argument("--suffix", type=int, default=32, help="unique tokens per request")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--prefill-blocks", type=int, default=176, help="blocks per prefill (fewer than all prefixes)")
    p.add_argument("--decode-blocks", type=int, default=4096)
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    backend = best_backend() if a.backend == "auto" else a.backend
    prompts, order = workload(a.groups, a.prefix, a.suffix, a.requests, a.seed)
    ideal = (a.requests - len(set(order))) * (a.prefix // TPB * TPB) / sum(t.size for t in prompts)
    oracle = KVOracle(preset("tiny"))
    rows = [run_policy(policy, a, backend, prompts, oracle) for policy in ("round-robin", "kv-aware")]
    print(f"xPyD routing: {a.prefills} prefills x 1 decode over {backend}, {a.requests} requests "
          f"({a.groups} prefixes of {a.prefix} + {a.suffix} tokens), {a.concurrency} in flight, "
          f"{a.prefill_blocks} blocks per prefill; ideal hit rate {ideal:.1%}")
    print(f"{'policy':<12} {'hit rate':>9} {'TTFT med ms':>12} {'TTFT p90 ms':>12} {'wall s':>7} "
          f"{'per prefill':>12} {'wrong':>6}")
    for r in rows:
        print(f"{r['policy']:<12} {r['prefix_hit_rate']:>9.1%} {r['ttft_median_ms']:>12.1f} {r['ttft_p90_ms']:>12.1f} "
              f"{r['wall_s']:>7.1f} {r['requests_per_prefill']:>12} {r['wrong']:>6}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_routing.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "backend": backend, "args": vars(a), "ideal_hit_rate": ideal,
                   "rows": rows}, f, indent=2)
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
