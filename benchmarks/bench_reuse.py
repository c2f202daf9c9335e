"""Prefix-reuse speed: block keys per second hashing a 128k-token prompt, and matches per second on a
prefix tree of 100k blocks.

Baselines measured in the same run:
- hashing: the same chain with hashlib.sha256 (a common default for prefix-cache keys), and one
  blake3 call over the whole prompt (the throughput ceiling of the hash itself, no chain);
- matching: plain dict lookups of the same number of keys (the floor of any key-indexed tree).
Prints a table and writes JSON to benchmarks/results/bench_reuse.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable

import blake3
import numpy as np

from kvxfer.cache import CacheConfig, KVCacheManager, ReuseScope, block_keys


def best_of(rounds: int, fn: Callable[[], object]) -> float:
    """The fastest of ``rounds`` timed calls, in seconds."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def sha256_chain(tokens: np.ndarray, tpb: int, parent: bytes) -> list[bytes]:
    data = memoryview(tokens[:tokens.size // tpb * tpb].astype("<u4").tobytes())
    stride = 4 * tpb
    keys, key = [], parent
    for off in range(0, len(data), stride):
        key = hashlib.sha256(key + data[off:off + stride]).digest()
        keys.append(key)
    return keys


def bench_hashing(tokens: int, tpb: int, rounds: int) -> dict[str, float]:
    prompt = np.random.default_rng(0).integers(0, 128_000, tokens)
    root = ReuseScope().root_key
    n_keys = tokens // tpb
    t_blake = best_of(rounds, lambda: block_keys(prompt, tpb, root))
    t_sha = best_of(rounds, lambda: sha256_chain(prompt, tpb, root))
    raw = prompt.astype("<u4").tobytes()
    t_flat = best_of(rounds, lambda: blake3.blake3(raw).digest())
    return {"tokens": tokens, "tokens_per_block": tpb, "keys": n_keys,
            "blake3_chain_s": t_blake, "keys_per_s": n_keys / t_blake, "tokens_per_s": tokens / t_blake,
            "sha256_chain_keys_per_s": n_keys / t_sha, "blake3_whole_prompt_gb_per_s": len(raw) / t_flat / 1e9}


def bench_matching(tree_blocks: int, prompt_blocks: int, shared_blocks: int, tpb: int, queries: int,
                   rounds: int) -> dict[str, float]:
    """A tree of ``tree_blocks`` blocks: prompts of ``prompt_blocks`` blocks sharing a
    ``shared_blocks``-block system prompt. Queries are stored prompts plus a fresh tail block."""
    n_prompts = (tree_blocks - shared_blocks) // (prompt_blocks - shared_blocks)
    cfg = CacheConfig.for_model(1, 1, 4, tpb, "float16", tree_blocks + 4 * prompt_blocks)
    mgr = KVCacheManager(cfg)
    rng = np.random.default_rng(1)
    system = rng.integers(0, 1000, shared_blocks * tpb)
    prompts = [np.concatenate([system, rng.integers(1000, 128_000, (prompt_blocks - shared_blocks) * tpb)])
               for _ in range(n_prompts)]
    t0 = time.perf_counter()
    for p in prompts:
        kv = mgr.create_kv_cache_for_prompt(p)
        kv.resume()
        if not kv.resize(p.size):
            raise RuntimeError("benchmark pool too small")
        kv.commit(p[kv.num_committed_tokens:])
        kv.close()
    build_s = time.perf_counter() - t0
    tree = mgr.prefix_tree
    picks = rng.integers(0, n_prompts, queries)
    queries_tokens = [np.concatenate([prompts[i], rng.integers(200_000, 300_000, tpb)]) for i in picks]
    root = ReuseScope().root_key
    query_keys = [block_keys(q, tpb, root) for q in queries_tokens]

    def match_all() -> None:
        for q, k in zip(queries_tokens, query_keys, strict=True):
            m = tree.match(root, k, q, max_tokens=q.size - 1)
            assert len(m.nodes) == prompt_blocks

    index = {key: i for p in prompts for i, key in enumerate(block_keys(p, tpb, root))}

    def dict_all() -> None:
        for k in query_keys:
            for key in k[:prompt_blocks]:
                index[key]

    def probe_all() -> None:
        for q in queries_tokens:
            assert mgr.probe_prompt_reuse(q) == prompt_blocks * tpb

    t_match = best_of(rounds, match_all)
    t_dict = best_of(rounds, dict_all)
    t_probe = best_of(rounds, probe_all)
    return {"tree_blocks": tree.num_blocks, "prompts": n_prompts, "prompt_blocks": prompt_blocks,
            "tokens_per_block": tpb, "queries": queries, "build_s": build_s,
            "matches_per_s": queries / t_match, "matched_blocks_per_s": queries * prompt_blocks / t_match,
            "dict_lookup_matches_per_s": queries / t_dict,
            "probe_with_hashing_per_s": queries / t_probe}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=131_072)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--tree-blocks", type=int, default=100_000)
    p.add_argument("--prompt-blocks", type=int, default=128)
    p.add_argument("--shared-blocks", type=int, default=32)
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    h = bench_hashing(a.tokens, a.tokens_per_block, a.rounds)
    m = bench_matching(a.tree_blocks, a.prompt_blocks, a.shared_blocks, a.tokens_per_block, a.queries, a.rounds)
    print(f"{'hashing':<10} {'tokens':>8} {'keys':>6} {'ms':>7} {'keys/s':>10} {'tokens/s':>11} "
          f"{'sha256 keys/s':>14} {'blake3 flat GB/s':>17}")
    print(f"{'':<10} {h['tokens']:>8} {h['keys']:>6} {h['blake3_chain_s'] * 1e3:>7.2f} {h['keys_per_s']:>10.0f} "
          f"{h['tokens_per_s']:>11.0f} {h['sha256_chain_keys_per_s']:>14.0f} {h['blake3_whole_prompt_gb_per_s']:>17.2f}")
    print(f"{'matching':<10} {'tree':>8} {'blocks/q':>8} {'matches/s':>10} {'blocks/s':>11} "
          f"{'dict floor/s':>13} {'probe+hash/s':>13}")
    print(f"{'':<10} {m['tree_blocks']:>8} {m['prompt_blocks']:>8} {m['matches_per_s']:>10.0f} "
          f"{m['matched_blocks_per_s']:>11.0f} {m['dict_lookup_matches_per_s']:>13.0f} {m['probe_with_hashing_per_s']:>13.0f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_reuse.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "hashing": h, "matching": m}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
