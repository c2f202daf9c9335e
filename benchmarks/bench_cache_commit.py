"""Per-block cost of the cache manager's bookkeeping for one long request (llama-3.2-1b shape, CPU pools,
16 tokens per block): create + resume, committing the prompt in 1,024-token chunks, committing it in one
call, and evicting a previous request's blocks (the resize that has to make room), with prefix reuse on
and off (off: no tree, the floor of the same calls).

The pool holds one request plus 64 blocks, so from the second request on every resize evicts the
previous request's tree blocks (reuse on). Each figure is the median of ``--reps`` requests after one
warm-up request (``first_resume``: one sample per manager). Prints a table; ``--json PATH`` writes the
figures. Before/after a change: run it with PYTHONPATH pointing at each checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvxfer.cache import KVCacheManager
from kvxfer.model import preset

TOKENS_PER_BLOCK = 16
CHUNK = 1024
PHASES = ("first_resume", "create_resume", "evict_resize", "chunked_commit", "whole_commit")


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def run(num_tokens: int, reuse: bool, reps: int) -> dict[str, float]:
    """Median milliseconds of each phase for ``num_tokens``-token requests."""
    cfg = preset("llama-3.2-1b")
    blocks = num_tokens // TOKENS_PER_BLOCK
    mgr = KVCacheManager(cfg.cache_config(TOKENS_PER_BLOCK, blocks + 64, "cpu", enable_prefix_reuse=reuse))
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    seed = 0

    def prompt() -> np.ndarray:
        nonlocal seed
        seed += 1
        return np.random.default_rng(seed).integers(0, cfg.vocab_size, num_tokens)

    first = mgr.create_kv_cache_for_prompt(prompt(), "first")
    t0 = time.perf_counter()
    first.resume()
    times["first_resume"].append(_ms_since(t0))
    first.close()
    for rep in range(reps + 1):
        for whole in (False, True):
            tokens = prompt()
            t0 = time.perf_counter()
            cache = mgr.create_kv_cache_for_prompt(tokens, f"r{rep}-{whole}")
            cache.resume()
            create = _ms_since(t0)
            t0 = time.perf_counter()
            if not cache.resize(num_tokens):
                raise RuntimeError(f"bench_cache_commit: no room for {num_tokens} tokens")
            evict = _ms_since(t0)
            t0 = time.perf_counter()
            for i in range(0, num_tokens, num_tokens if whole else CHUNK):
                cache.commit(tokens[i:i + (num_tokens if whole else CHUNK)])
            commit = _ms_since(t0)
            cache.close()
            if rep == 0:
                continue                     # warm-up: the pool was still empty
            times["create_resume"].append(create)
            times["evict_resize"].append(evict)
            times["whole_commit" if whole else "chunked_commit"].append(commit)
    mgr.drain_events()
    return {p: statistics.median(v) for p, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    rows = []
    print(f"{'tokens':>7} {'blocks':>6} {'reuse':>5} " + " ".join(f"{p:>15}" for p in PHASES) + "   (ms, median)")
    for n in args.tokens:
        for reuse in (True, False):
            res = run(n, reuse, args.reps)
            rows.append({"tokens": n, "blocks": n // TOKENS_PER_BLOCK, "prefix_reuse": reuse, "median_ms": res})
            print(f"{n:>7} {n // TOKENS_PER_BLOCK:>6} {'on' if reuse else 'off':>5} "
                  + " ".join(f"{res[p]:>15.2f}" for p in PHASES))
    print("evict_resize: resize(prompt) of a new request while the previous request's blocks fill the pool "
          "(reuse on: evicts them all); chunked_commit: 1,024-token commits; first_resume: a fresh manager's "
          "first resume (one sample each; the process's first one pays any lazy import)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cache_commit", "model": "llama-3.2-1b", "device": "cpu",
                       "tokens_per_block": TOKENS_PER_BLOCK, "chunk_tokens": CHUNK, "reps": args.reps,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
