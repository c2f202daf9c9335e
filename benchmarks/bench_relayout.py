"""Layout changes over a host transport: a templated plan moved as large pieces in the source's layout into
a landing region, then re-laid out on the host, against the identical-layout transfer of the same bytes
in the same run (Llama-3-8B KV shape, CPU pools, fragmented slots on both sides).

Per case: planning time (``plan_templated`` with the layout pair's templates made, + ``landing_plan``), the
transfer's descriptors, the transfer time, the re-layout time, and their sum against the identical-layout
transfer; then the same pull pipelined (``read_relayout(piece_bytes=--piece-mib)``: each piece re-laid out
while the next moves) against the identical-layout transfer; medians over ``--iters``, every timed
iteration poisoned before (the destination pools) and checked after, cell by cell through the managers'
buffer views.

    PYTHONPATH=$PWD python benchmarks/bench_relayout.py [--backend nixl] [--tokens 4096] [--iters 3] [--piece-mib 8]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvxfer.cache import CacheConfig, KVCacheManager
from kvxfer.cache.memory import MemoryRegion
from kvxfer.extractor import plan_templated
from kvxfer.pagetable.relayout import landing_plan, relayout_host
from kvxfer.transport import create
from kvxfer.transport.relayout import read_relayout

LAYERS, HEADS, HEAD_DIM, TPB = 32, 8, 128, 32


def manager(tokens: int, tpb: int, spare: int, **kw: Any) -> tuple[KVCacheManager, np.ndarray]:
    """A CPU manager of the Llama-3-8B KV shape and a request's fragmented block ids on it."""
    blocks = math.ceil(tokens / tpb)
    cfg = CacheConfig.for_model(LAYERS, HEADS, HEAD_DIM, tpb, "bfloat16", blocks + spare, device="cpu", **kw)
    mgr = KVCacheManager(cfg)
    slots = mgr.layout.pool_groups[0].pools[0].num_slots
    return mgr, np.random.default_rng(tpb + 7 * len(kw)).permutation(slots)[:blocks].astype(np.int64)


def tokens_of(mgr: KVCacheManager, ids: np.ndarray, layer: int, role: str, tokens: int) -> torch.Tensor:
    """[heads this side holds, tokens, head_dim] of one (layer, role) of the request, in token order."""
    fmt = mgr.layout.format_of(next(b for b, _ in mgr.layout.formats if b.layer_id == layer and b.role == role))
    view = mgr.buffer_view(layer, role).view(torch.int16)[torch.from_numpy(ids)]   # bits: random bf16 holds NaNs
    if fmt.order == "NHD":
        view = view.transpose(1, 2)
    heads = view.shape[1]
    return view.transpose(0, 1).reshape(heads, -1, view.shape[-1])[:, :tokens]


def check(src: KVCacheManager, sids: np.ndarray, dst: KVCacheManager, dids: np.ndarray, tokens: int) -> bool:
    """Every (layer, role, head, token) of the destination's request holds the source's."""
    for layer in range(LAYERS):
        for role in ("key", "value"):
            want = tokens_of(src, sids, layer, role, tokens)
            fmt = dst.layout.format_of(next(b for b, _ in dst.layout.formats if b.layer_id == layer and b.role == role))
            got = tokens_of(dst, dids, layer, role, tokens)
            if not torch.equal(got, want[fmt.head_start:fmt.head_start + fmt.num_heads]):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="nixl")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--piece-mib", type=float, default=8.0, help="pipelined pull: bytes per piece, MiB")
    args = ap.parse_args(argv)
    tokens = args.tokens
    src, sids = manager(tokens, TPB, 16)
    for pool in src.memory_regions():
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * pool.nbytes).from_address(pool.base_address))
        arr[:] = np.random.default_rng(1).integers(0, 256, pool.nbytes, dtype=np.uint8)
    cases: dict[str, dict[str, Any]] = {
        "identical": {"tpb": TPB},
        "tokens/block 32->16": {"tpb": 16},
        "tokens/block 32->64": {"tpb": 64},
        "HND->NHD": {"tpb": TPB, "head_order": "NHD"},
        "TP 1->2 (rank 1) + 32->16": {"tpb": 16, "tp_size": 2, "tp_rank": 1},
    }
    rows: list[dict[str, Any]] = []
    for name, kw in cases.items():
        tpb = kw.pop("tpb")
        dst, dids = manager(tokens, tpb, 16, **kw)
        phases = plan_templated(src.layout, {0: sids}, dst.layout, {0: dids})
        assert phases is not None
        dst_regions = dst.memory_regions()
        t0 = time.perf_counter()
        phases = plan_templated(src.layout, {0: sids}, dst.layout, {0: dids})
        assert phases is not None
        size = landing_plan(phases, 0, len(dst_regions)).landing_bytes   # the plan of a landing at 0
        plan_ms = (time.perf_counter() - t0) * 1e3
        landing_buf = torch.empty(size + 4096, dtype=torch.uint8)
        off = (-landing_buf.data_ptr()) % 4096
        landing = landing_buf[off:off + size]
        landing_region = MemoryRegion(int(landing.data_ptr()), size)
        lp = landing_plan(phases, landing_region.base_address, len(dst_regions))
        a = create(args.backend, f"rl-a-{len(rows)}")
        b = create(args.backend, f"rl-b-{len(rows)}")
        a.register(src.memory_regions())
        b.register([*dst_regions, landing_region])
        a.connect(b.name, b.metadata())
        b.connect(a.name, a.metadata())
        identical = name == "identical"
        move, relay, piped, ok = [], [], [], True
        transfer = lp.transfer.expand()
        piece_bytes = max(1, int(args.piece_mib * (1 << 20)))
        for i in range(args.iters + 1):
            # Sequential (read, then re-layout) and pipelined alternate which goes first.
            for pipelined in ((False, True) if i % 2 else (True, False)):
                for region in dst_regions:
                    np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.base_address))[:] = \
                        2 * i + 1 + pipelined
                t0 = time.perf_counter()
                if identical:
                    b.read(a.name, phases[0] if len(phases) == 1 else transfer).wait(60.0)
                    t1 = t2 = time.perf_counter()
                elif pipelined:
                    read_relayout(b, a.name, lp, piece_bytes=piece_bytes).wait(60.0)
                    t1 = t2 = time.perf_counter()
                else:
                    b.read(a.name, transfer).wait(60.0)
                    t1 = time.perf_counter()
                    relayout_host(lp.relayout, b.regions, b.regions)
                    t2 = time.perf_counter()
                good = check(src, sids, dst, dids, tokens)
                ok = ok and good
                if i and pipelined:
                    piped.append(t2 - t0)
                elif i:
                    move.append(t1 - t0)
                    relay.append(t2 - t1)
        a.close()
        b.close()
        scratch_a = np.ones(lp.total_bytes, np.uint8)
        scratch_b = np.empty_like(scratch_a)
        copies = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            np.copyto(scratch_b, scratch_a)
            copies.append(time.perf_counter() - t0)
        del scratch_a, scratch_b
        rows.append({"case": name, "plan_ms": plan_ms, "memcpy_ms": statistics.median(copies) * 1e3, "descriptors": len(transfer) if not identical else len(phases[0]),
                     "bytes": lp.total_bytes, "move_ms": statistics.median(move) * 1e3,
                     "relayout_ms": statistics.median(relay) * 1e3, "pipelined_ms": statistics.median(piped) * 1e3,
                     "verified": ok})
        print(f"done {name}", flush=True)
    ident = statistics.median([rows[0]["move_ms"], rows[0]["pipelined_ms"]])   # both columns move it alike
    print(f"Llama-3-8B KV shape, {tokens} tokens, {args.backend}, CPU pools, medians of {args.iters}; "
          f"pipelined pieces of {args.piece_mib:g} MiB")
    print(f"{'case':28} {'plan ms':>8} {'descs':>7} {'MiB':>6} {'move ms':>8} {'relayout ms':>11} {'memcpy ms':>9} "
          f"{'total/identical':>15} {'pipelined ms':>12} {'piped/identical':>15} ok")
    for r in rows:
        total = r["move_ms"] + r["relayout_ms"]
        print(f"{r['case']:28} {r['plan_ms']:8.2f} {r['descriptors']:7d} {r['bytes'] >> 20:6d} {r['move_ms']:8.1f} "
              f"{r['relayout_ms']:11.1f} {r['memcpy_ms']:9.1f} {total / ident:14.2f}x {r['pipelined_ms']:12.1f} "
              f"{r['pipelined_ms'] / ident:14.2f}x {r['verified']}")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
