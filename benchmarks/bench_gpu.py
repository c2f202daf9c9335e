"""GPU transfer benchmark (issue 9): two processes sharing one GPU, Llama-3-8B-shaped requests.

Prints, from one run: the device-to-device copy limit, a raw torch gather+scatter of the same pages
(the baseline kvxfer is measured against), and kvxfer transfers through one backend for identical
layouts and TP 1->2, push and pull, at each token count, with descriptor counts and plan time.
Every column is the median over ``--iters`` timed iterations, and every timed iteration is verified:
its destination is poisoned just before it and checked just after it (both untimed) -- kvxfer's by
per-(layer, role, block) checksums of the destination heads against the source's, the baselines by
comparing the destination with the source.

  python benchmarks/bench_gpu.py --backend cuda_ipc --tokens 4096 32768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from kvxfer.cache import BufferId, CacheConfig, CacheLayoutDesc, KVCacheManager
from kvxfer.extractor import plan_transfer
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import create

LAYERS, KV_HEADS, HEAD_DIM, TPB = 32, 8, 128, 32
ROLES = ("key", "value")


def managers(blocks: int, device: str) -> dict[str, KVCacheManager]:
    """prefill (TP 1), decode (TP 1), and the two ranks of a TP-2 decode."""
    def make(**kw: Any) -> KVCacheManager:
        return KVCacheManager(CacheConfig.for_model(LAYERS, KV_HEADS, HEAD_DIM, TPB, "bfloat16", blocks + 8,
                                                    device=device, **kw))
    return {"prefill": make(), "decode": make(), "rank0": make(tp_size=2, tp_rank=0),
            "rank1": make(tp_size=2, tp_rank=1)}


def region_offsets(mgrs: dict[str, KVCacheManager]) -> dict[str, int]:
    out, n = {}, 0
    for name, m in mgrs.items():
        out[name] = n
        n += len(m.memory_regions())
    return out


def checksum(m: KVCacheManager, blocks: np.ndarray, heads: tuple[int, int] | None) -> np.ndarray:
    """Per (layer, role, block) checksum of the heads ``heads`` (global range) of ``blocks``."""
    idx = torch.as_tensor(blocks, device=m.device, dtype=torch.long)
    out = []
    for layer in range(LAYERS):
        for role in ROLES:
            view = m.buffer_view(layer, role)[idx]  # [blocks, heads, tokens, dim] (HND)
            fmt = m.layout.format_of(BufferId(layer, role))
            if heads is not None:
                lo, hi = heads[0] - fmt.head_start, heads[1] - fmt.head_start
                view = view[:, lo:hi]
            words = view.contiguous().view(view.shape[0], -1).view(torch.int16).to(torch.int64)
            ramp = torch.arange(1, words.shape[1] + 1, device=words.device, dtype=torch.int64)
            out.append((words * ramp).sum(dim=1))
    sync(m.device)
    return torch.stack(out).cpu().numpy()


def poison(m: KVCacheManager, blocks: np.ndarray, value: int) -> None:
    """Fill every pool's bytes of ``blocks`` with ``value`` (a destination no earlier transfer wrote)."""
    idx = torch.as_tensor(blocks, device=m.device, dtype=torch.long)
    for g, pg in enumerate(m.layout.pool_groups):
        for p in range(len(pg.pools)):
            m.pool_tensor(g, p).view(pg.num_slots, -1)[idx] = value
    sync(m.device)


def poison_destination(conn: Any, mgrs: dict[str, KVCacheManager], blk: dict[str, np.ndarray], dst_names: list[str],
                       mode: str, value: int) -> None:
    """Poison the destination blocks of one case: the peer's (push) or ours (pull)."""
    for dn in dst_names:
        if mode == "push":
            conn.send(("poison", dn, blk[dn], value))
            conn.recv()
        else:
            poison(mgrs[dn], blk[dn], value)


def destination_ok(conn: Any, mgrs: dict[str, KVCacheManager], blk: dict[str, np.ndarray], dst_names: list[str],
                   mode: str) -> bool:
    """Checksums of what arrived against the source, per destination rank and head range."""
    ok = True
    for dn in dst_names:
        heads = None if dn == "decode" else ((0, 4) if dn == "rank0" else (4, 8))
        if mode == "push":
            want = checksum(mgrs["prefill"], blk["prefill"], heads)
            conn.send(("checksum", dn, blk[dn], None))
            got = conn.recv()
        else:
            conn.send(("checksum", "prefill", blk["prefill"], heads))
            want = conn.recv()
            got = checksum(mgrs[dn], blk[dn], None)
        ok = ok and bool(np.array_equal(want, got))
    return ok


def median_s(times: list[float]) -> float:
    """The median of per-iteration seconds (the statistic of every column)."""
    return float(np.median(times))


def transport_options(backend: str) -> dict[str, Any]:
    """Backend options from the environment (KVXFER_NIXL_THREADS: UCX worker threads of NIXL)."""
    threads = int(os.environ.get("KVXFER_NIXL_THREADS", "0"))
    return {"num_threads": threads} if backend == "nixl" and threads else {}


def peer_main(conn: Any, backend: str, blocks: int, seed: int, device: str) -> None:
    """The other process: the same managers, filled with its own random bytes, answering commands."""
    torch.manual_seed(seed)
    mgrs = managers(blocks, device)
    for m in mgrs.values():
        for g, pg in enumerate(m.layout.pool_groups):
            for p in range(len(pg.pools)):
                m.pool_tensor(g, p).random_(0, 256)
    t = create(backend, f"peer-{backend}", **transport_options(backend))
    t.register([r for m in mgrs.values() for r in m.memory_regions()])
    conn.send(({k: m.layout.to_msgpack() for k, m in mgrs.items()}, t.metadata()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "connect":
            t.connect(args[0], args[1])
            conn.send(None)
        elif cmd == "checksum":
            name, blk, heads = args
            conn.send(checksum(mgrs[name], blk, heads))
        elif cmd == "poison":
            name, blk, value = args
            poison(mgrs[name], blk, value)
            conn.send(None)
        elif cmd == "exit":
            t.close()
            conn.send(None)
            return


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def shift(table: PageTable, offset: int) -> PageTable:
    return PageTable(table.addr, table.nbytes, table.region + np.uint32(offset))


def run(backend: str, tokens_list: list[int], iters: int, max_descriptors: int, device: str) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    results: dict[str, Any] = {"backend": backend, "gpu": gpu, "device": device, "cases": [],
                               "options": transport_options(backend)}
    # device copy limit: one 1 GiB copy (256 MiB on a CPU), one direction
    a = torch.randint(0, 256, (1 << (30 if device.startswith("cuda") else 28),), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    d2d_times, d2d_ok = [], True
    for i in range(5):
        b.fill_(i + 1)
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        d2d_times.append(time.perf_counter() - t0)
        d2d_ok = d2d_ok and torch.equal(a, b)
    results["d2d_gbps"] = a.numel() / median_s(d2d_times) / 1e9
    results["d2d_verified"] = d2d_ok
    del a, b
    for tokens in tokens_list:
        nblocks = tokens // TPB
        mgrs = managers(nblocks, device)
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=peer_main, args=(child, backend, nblocks, 1234, device), daemon=True)
        proc.start()
        layouts_b, md = conn.recv()
        peer_layouts = {k: CacheLayoutDesc.from_msgpack(v) for k, v in layouts_b.items()}
        for g, pg in enumerate(mgrs["prefill"].layout.pool_groups):
            for p in range(len(pg.pools)):
                mgrs["prefill"].pool_tensor(g, p).random_(0, 256)
        t = create(backend, f"local-{backend}", **transport_options(backend))
        t.register([r for m in mgrs.values() for r in m.memory_regions()])
        t.connect(f"peer-{backend}", md)
        conn.send(("connect", t.name, t.metadata()))
        conn.recv()
        off_local, off_peer = region_offsets(mgrs), region_offsets(mgrs)
        rng = np.random.default_rng(tokens)
        blk = {name: rng.choice(nblocks + 8, nblocks, replace=False).astype(np.int32) for name in mgrs}
        # raw torch gather+scatter of the same whole slots, in this process (same GPU memory traffic)
        src_idx = torch.as_tensor(blk["prefill"], device=device, dtype=torch.long)
        dst_idx = torch.as_tensor(blk["decode"], device=device, dtype=torch.long)
        # int64 rows: torch's index kernels move 8-byte elements (uint8 rows would understate the baseline)
        pool_s = mgrs["prefill"].pool_tensor(0, 0).view(torch.int64).view(nblocks + 8, -1)
        pool_d = mgrs["decode"].pool_tensor(0, 0).view(torch.int64).view(nblocks + 8, -1)
        pool_d[dst_idx] = pool_s[src_idx]
        raw_times, raw_ok = [], True
        for i in range(iters):
            pool_d[dst_idx] = i + 1
            sync(device)
            t0 = time.perf_counter()
            pool_d[dst_idx] = pool_s[src_idx]
            sync(device)
            raw_times.append(time.perf_counter() - t0)
            raw_ok = raw_ok and torch.equal(pool_d[dst_idx], pool_s[src_idx])
        raw_gbps = pool_s[src_idx].numel() * 8 / median_s(raw_times) / 1e9
        for case, dst_names in (("identical", ["decode"]), ("tp1->2", ["rank0", "rank1"])):
            for mode in ("push", "pull"):
                plans, plan_ms = [], 0.0
                for dn in dst_names:
                    if mode == "push":   # local prefill -> peer decode
                        sl, sb, dl, db = mgrs["prefill"].layout, blk["prefill"], peer_layouts[dn], blk[dn]
                        so, do = off_local["prefill"], off_peer[dn]
                    else:                # local decode pulls from the peer's prefill
                        sl, sb, dl, db = peer_layouts["prefill"], blk["prefill"], mgrs[dn].layout, blk[dn]
                        so, do = off_peer["prefill"], off_local[dn]
                    t0 = time.perf_counter()
                    plan = plan_transfer(sl, {0: sb}, dl, {0: db})
                    plan_ms += (time.perf_counter() - t0) * 1e3
                    plans.append(TransferPlan(shift(plan.src, so), shift(plan.dst, do)))
                ndesc = sum(len(p) for p in plans)
                nbytes = sum(p.total_bytes for p in plans)
                row: dict[str, Any] = {"tokens": tokens, "case": case, "mode": mode, "descriptors": ndesc,
                                       "bytes": nbytes, "plan_ms": plan_ms, "raw_gather_scatter_gbps": raw_gbps,
                                       "raw_verified": raw_ok}
                if ndesc > max_descriptors:
                    row["skipped"] = f"{ndesc} descriptors > --max-descriptors {max_descriptors}"
                    results["cases"].append(row)
                    print(row, flush=True)
                    continue
                op = t.write if mode == "push" else t.read
                for p in plans:   # warm-up (connection set-up, registration caches)
                    op(f"peer-{backend}", p).wait(120)
                times, failed = [], 0
                for i in range(iters):
                    poison_destination(conn, mgrs, blk, dst_names, mode, 0x5A ^ (i * 37 & 0xFF))   # untimed
                    t0 = time.perf_counter()
                    hs = [op(f"peer-{backend}", p) for p in plans]
                    for h in hs:
                        h.wait(120)
                    times.append(time.perf_counter() - t0)
                    failed += not destination_ok(conn, mgrs, blk, dst_names, mode)                 # untimed
                row["gbps"] = nbytes / median_s(times) / 1e9
                row["median_gbps"] = row["gbps"]
                row["best_gbps"] = nbytes / min(times) / 1e9
                row["verified"] = failed == 0 and raw_ok and bool(results["d2d_verified"])
                row["failed_iterations"] = failed
                row["ratio_vs_raw"] = row["gbps"] / raw_gbps
                row["ratio_vs_d2d"] = row["gbps"] / results["d2d_gbps"]
                results["cases"].append(row)
                print(json.dumps(row), flush=True)
        conn.send(("exit",))
        conn.recv()
        proc.join(30)
        t.close()
        del mgrs
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda_ipc", choices=("cuda_ipc", "nixl", "ucx"))
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--max-descriptors", type=int, default=1 << 20)
    p.add_argument("--device", default="cuda:0", help="cuda:0 (both processes share it) or cpu (logic check)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    res = run(a.backend, a.tokens, a.iters, a.max_descriptors, a.device)
    print(f"\nbackend {a.backend} on {res['gpu']}; D2D limit {res['d2d_gbps']:.0f} GB/s; medians of {a.iters} "
          f"iterations, each verified (destination poisoned before, checked after)")
    print(f"{'tokens':>7} {'case':>9} {'mode':>5} {'desc':>8} {'plan ms':>8} {'GB/s':>8} {'raw g+s':>8} "
          f"{'x raw':>6} {'x D2D':>6} ok")
    for r in res["cases"]:
        if "skipped" in r:
            print(f"{r['tokens']:>7} {r['case']:>9} {r['mode']:>5} {r['descriptors']:>8} {r['plan_ms']:>8.1f}  "
                  f"skipped: {r['skipped']}")
            continue
        print(f"{r['tokens']:>7} {r['case']:>9} {r['mode']:>5} {r['descriptors']:>8} {r['plan_ms']:>8.1f} "
              f"{r['gbps']:>8.1f} {r['raw_gather_scatter_gbps']:>8.1f} {r['ratio_vs_raw']:>6.2f} "
              f"{r['ratio_vs_d2d']:>6.2f} {r['verified']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if all(r.get("verified", True) for r in res["cases"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
