"""Allocation throughput of the cache manager: 1,000 requests x 4k tokens, create/resume/resize/close.

Baseline in the same run: the raw SlotAllocator doing the same slot traffic (alloc + decref), which is
the floor our lifecycle bookkeeping adds to. Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvxfer.cache import CacheConfig, KVCacheManager
from kvxfer.cache.allocator import SlotAllocator


def run(requests: int, tokens: int, rounds: int) -> dict[str, float]:
    cfg = CacheConfig.for_model(32, 8, 128, 32, "bfloat16", 1, coalesce=True)
    blocks = -(-tokens // cfg.tokens_per_block)
    # Small per-slot bytes for the benchmark: same shape of bookkeeping, less memory.
    cfg = CacheConfig.for_model(32, 1, 8, 32, "float16", requests * blocks + 8)
    mgr = KVCacheManager(cfg)
    best = {"lifecycle_s": float("inf"), "allocator_s": float("inf")}
    for _ in range(rounds):
        t0 = time.perf_counter()
        caches = []
        for i in range(requests):
            kv = mgr.create_kv_cache(id=f"r{i}")
            kv.resume()
            if not kv.resize(tokens):
                raise RuntimeError("benchmark pool too small")
            caches.append(kv)
        for kv in caches:
            kv.close()
        best["lifecycle_s"] = min(best["lifecycle_s"], time.perf_counter() - t0)
        alloc = SlotAllocator(requests * blocks + 8)
        t0 = time.perf_counter()
        held = [alloc.alloc(blocks) for _ in range(requests)]
        for ids in held:
            alloc.decref(ids)
        best["allocator_s"] = min(best["allocator_s"], time.perf_counter() - t0)
    return {"requests": requests, "tokens": tokens, "blocks_per_request": blocks,
            "lifecycle_s": best["lifecycle_s"], "allocator_s": best["allocator_s"],
            "requests_per_s": requests / best["lifecycle_s"],
            "blocks_per_s": requests * blocks / best["lifecycle_s"],
            "overhead_vs_allocator": best["lifecycle_s"] / best["allocator_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    r = run(a.requests, a.tokens, a.rounds)
    print(f"{'requests':>9} {'tokens':>7} {'blocks/req':>10} {'lifecycle ms':>13} {'raw alloc ms':>13} "
          f"{'req/s':>9} {'blocks/s':>11} {'ratio':>6}")
    print(f"{r['requests']:>9} {r['tokens']:>7} {r['blocks_per_request']:>10} {r['lifecycle_s'] * 1e3:>13.1f} "
          f"{r['allocator_s'] * 1e3:>13.1f} {r['requests_per_s']:>9.0f} {r['blocks_per_s']:>11.0f} "
          f"{r['overhead_vs_allocator']:>6.2f}")
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/bench_cache.json", "w") as f:
        json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
