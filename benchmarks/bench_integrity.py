"""Integrity benchmark: the position-keyed digest of one request's KV (source side) and its check on a
destination with another layout, against the physical limit (memcpy: one contiguous copy of the same
number of bytes) and next to the in-process copy of the same request's plan
(kvxfer.transport.copy.copy_plan), measured in the same run; every statistic is a median. Every timed
copy lands in destination pages poisoned just before it and is verified by logical position just after
it (untimed); every timed verify must pass (it raises otherwise).

Source: tokens_per_block 16, HND, one rank; destinations: the same layout (a coalesced plan: the copy
runs near memcpy), and tokens_per_block 32, NHD, two tensor-parallel ranks (one entry per row). Host
memory (this is where the hash runs: CUDA pages are staged to host first).

    PYTHONPATH=$PWD python benchmarks/bench_integrity.py [--tokens 2048] [--layers 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvxfer.cache import CacheConfig, KVCacheManager
from kvxfer.disagg.worker import all_regions, plan_between
from kvxfer.errors import IntegrityError
from kvxfer.transport.copy import copy_plan
from kvxfer.transport.integrity import ChecksumPolicy, digest_kv, verify_kv


def median_time(fn: Callable[[], Any], repeat: int, before: Callable[[int], Any] | None = None,
                after: Callable[[], Any] | None = None) -> float:
    """Median wall time of ``repeat`` runs, in seconds; ``before(i)`` / ``after()`` run around each timed
    run, untimed (poison the destination, check what the run wrote)."""
    times = []
    for i in range(repeat):
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return statistics.median(times)


def poison(managers: list[KVCacheManager], value: int) -> None:
    """Fill every pool of ``managers`` with ``value`` (what a copy that moved nothing would leave)."""
    for m in managers:
        for pg in m.layout.pool_groups:
            for p in pg.pools:
                m.pool_tensor(pg.pool_group_index, p.pool_index).fill_(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=32, help="tokens per digest cell")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    blocks = -(-args.tokens // 16) + 2

    def managers(tpb: int, order: str, tp: int) -> list[KVCacheManager]:
        return [KVCacheManager(CacheConfig.for_model(args.layers, args.heads, args.head_dim, tpb, args.dtype, blocks,
                                                     head_order=order, tp_rank=r, tp_size=tp)) for r in range(tp)]

    src_m = managers(16, "HND", 1)
    src_c = [m.create_kv_cache(id="src") for m in src_m]
    for c in src_c:
        c.resume()
        c.resize(args.tokens)
    gen = torch.Generator().manual_seed(0)
    for m in src_m:
        for pg in m.layout.pool_groups:
            for p in pg.pools:
                t = m.pool_tensor(pg.pool_group_index, p.pool_index)
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    src_l = [m.layout for m in src_m]
    span = (0, args.tokens)
    policies = {"full": ChecksumPolicy(), "every 8th": ChecksumPolicy.every(8),
                "5 % sample": ChecksumPolicy.sample(0.05, seed=1)}
    destinations = {"same layout": (16, "HND", 1), "tpb 32, NHD, TP 2": (32, "NHD", 2)}
    rows: list[dict[str, Any]] = []
    print(f"request: {args.tokens} tokens x {args.layers} layers x {args.heads} heads x {args.head_dim} {args.dtype}; "
          f"source tpb 16, HND, TP 1. GB/s = request KV bytes / median time (sampled: effective rate)")
    print(f"{'destination':<18} {'policy':<11} {'cells':>7} {'memcpy GB/s':>12} {'copy GB/s':>10} {'digest GB/s':>12} "
          f"{'verify GB/s':>12} {'digest x memcpy':>16} {'wire bytes':>11}")
    for dname, (tpb, order, tp) in destinations.items():
        dst_m = managers(tpb, order, tp)
        dst_c = [m.create_kv_cache(id="dst") for m in dst_m]
        for c in dst_c:
            c.resume()
            c.resize(args.tokens)
        dst_l = [m.layout for m in dst_m]
        plan = plan_between(src_l, src_c, dst_l, dst_c, token_range=span)
        src_r, dst_r = all_regions(src_l), all_regions(dst_l)
        full = digest_kv(src_l, src_c, span, ChecksumPolicy(), "bench", chunk_tokens=args.chunk)
        # every timed copy lands in poisoned pages and is checked by logical position after it (untimed)
        t_copy = median_time(lambda plan=plan, src_r=src_r, dst_r=dst_r: copy_plan(plan, src_r, dst_r), args.repeat,
                             before=lambda i, dst_m=dst_m: poison(dst_m, 0x5A + i),
                             after=lambda dst_l=dst_l, dst_c=dst_c, full=full: verify_kv(dst_l, dst_c, full,
                                                                                       token_range=span))
        kv_bytes = plan.total_bytes
        flat_src = torch.empty(kv_bytes, dtype=torch.uint8).random_(0, 256, generator=gen)
        flat_dst = torch.empty_like(flat_src)
        t_memcpy = median_time(lambda a=flat_src, b=flat_dst: b.copy_(a), args.repeat)
        if not torch.equal(flat_src, flat_dst):
            raise SystemExit("the memcpy baseline copied the wrong bytes")
        for name, policy in policies.items():
            digest = digest_kv(src_l, src_c, span, policy, "bench", chunk_tokens=args.chunk)
            verify_kv(dst_l, dst_c, digest, token_range=span)     # the copy above put the same KV there
            t_digest = median_time(lambda p=policy: digest_kv(src_l, src_c, span, p, "bench", chunk_tokens=args.chunk),
                                   args.repeat)
            t_verify = median_time(lambda d=digest, dst_l=dst_l, dst_c=dst_c: verify_kv(dst_l, dst_c, d, token_range=span),
                                   args.repeat)
            row = {"destination": dname, "policy": name, "bytes": kv_bytes, "plan_entries": len(plan),
                   "cells": digest.num_cells, "checked_cells": digest.checked_cells,
                   "chunk_tokens": digest.chunk_tokens, "memcpy_s": t_memcpy, "copy_s": t_copy, "digest_s": t_digest, "verify_s": t_verify,
                   "digest_wire_bytes": len(digest.to_bytes())}
            rows.append(row)
            print(f"{dname:<18} {name:<11} {digest.checked_cells:>7} {kv_bytes / t_memcpy / 1e9:>12.2f} "
                  f"{kv_bytes / t_copy / 1e9:>10.2f} {kv_bytes / t_digest / 1e9:>12.2f} "
                  f"{kv_bytes / t_verify / 1e9:>12.2f} {t_memcpy / t_digest:>16.2f} {row['digest_wire_bytes']:>11}")
        # The check sees a mispairing: swap two destination blocks' contents and verify again.
        view = dst_m[0].buffer_view(0, "key")
        ids = dst_c[0].block_ids(0)
        view[int(ids[0])], view[int(ids[1])] = view[int(ids[1])].clone(), view[int(ids[0])].clone()
        try:
            verify_kv(dst_l, dst_c, digest_kv(src_l, src_c, span, ChecksumPolicy(), "bench"), token_range=span)
            raise SystemExit("a swapped destination block passed verification")
        except IntegrityError as exc:
            print(f"  swapped block caught: {str(exc)[:110]}...")
        for c in dst_c:
            c.close()
    out = pathlib.Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC)
    path = out / f"integrity-{stamp:%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps({"date": stamp.isoformat(), "machine": platform.platform(), "statistic": "median",
                                "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {path}")
    for c in src_c:
        c.close()


if __name__ == "__main__":
    main()
