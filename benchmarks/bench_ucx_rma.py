"""The ucx backend against raw NIXL, interleaved in one run: the rows of ``kvxfer bench transport
--table`` (scattered pages: 4096 x 16 KiB write, 256 x 1 MiB read, 64 x 4 MiB write) and the one-page
write+wait, with raw NIXL (its own agent; descriptor lists prepared once) timed between kvxfer ucx's
iterations, the order alternating, so that both see the same machine; so is plain UCP RMA on the ucx
transport's own ucxx handles (no kvxfer code on the way: the limit of ucxx's UCX here). ``--table`` measures each backend
in its own stretch of time, which on a shared machine moves a ratio by 2x.

Every timed iteration is verified: the destination pages are poisoned before and checked (blake3, plan
order) after, untimed. Each side keeps its error-handling mode unless told: ``--no-error-handling``
runs ucx without UCX peer-failure handling (shared memory/CMA, as raw NIXL's default); otherwise ucx keeps
its default (peer-failure handling: tcp on one host) and ``--nixl-error-handling`` puts raw NIXL in the
same mode (with NIXL's progress thread, which its peer then needs).

    python -m benchmarks.bench_ucx_rma --no-error-handling --iters 9 --latency-iters 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvxfer.cli.bench_transport import (
    TABLE_ROWS,
    Verifier,
    _Pair,
    _plan,
    _raw_nixl,
    _RawNixlPages,
    _slots,
    pages_digest,
    poison_pages,
)
from kvxfer.pagetable import PageTable, TransferPlan


def _verifier(pair: _Pair, mode: str, local_t: PageTable, remote_t: PageTable) -> Verifier:
    lbase = pair.local_region.base_address
    if mode == "write":
        return Verifier(lambda v: pair.remote_poison(remote_t, v), lambda: pair.remote_digest(remote_t),
                        pages_digest(pair.local_pool, lbase, local_t))
    return Verifier(lambda v: poison_pages(pair.local_pool, lbase, local_t, v),
                    lambda: pages_digest(pair.local_pool, lbase, local_t), pair.remote_digest(remote_t))


def _timed(fn: Any, verify: Verifier) -> float:
    verify.before()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    verify.after()
    return seconds


def _raw_ucp(pair: _Pair, mode: str, lt: PageTable, rt: PageTable) -> Any:
    """Plain UCP RMA on the ucx transport's own ucxx worker and endpoint, no kvxfer on the way: the
    runs' puts/gets and one flush (``ucp_rma``), lists built once, then the worker progressed back to
    back until the flush completes."""
    t: Any = pair.local
    rma, rp, worker = t._rma, t._rma_peers.get("bench-peer"), t._worker_handle
    if rma is None or rp is None:
        return None
    params = [t._region_params[r] for r in lt.region.tolist()]   # the local region's memory handle
    runs = (lt.addr.tolist(), rt.addr.tolist(), lt.nbytes.tolist(), rp.rkeys[rt.region].tolist(), params)
    progress = rma.lib.ucp_worker_progress

    def run() -> None:
        t._rma_callers += 1   # the transport's service thread keeps off the worker meanwhile, as for its own posts
        try:
            flush = rma.post(rp.endpoint.handle, mode, *runs)
            while not flush.completed:
                progress(worker)
            flush.check_error()
        finally:
            t._rma_callers -= 1
    return run


def bandwidth_row(ucx: _Pair, nixl: _Pair, pages: int, page_bytes: int, mode: str, iters: int) -> dict[str, Any]:
    """GB/s medians of kvxfer ucx and raw NIXL over the same slot choice, iterations interleaved."""
    rng = np.random.default_rng(1234)
    lslots, rslots = _slots(rng, pages, "scattered"), _slots(rng, pages, "scattered")
    sides: dict[str, tuple[Any, Verifier]] = {}
    for who, pair in (("ucx", ucx), ("raw_nixl", nixl), ("raw_ucp", ucx)):
        lt, rt = _plan(pair.local_region, lslots, pair.peer_region, rslots, page_bytes)
        plan = TransferPlan(lt, rt) if mode == "write" else TransferPlan(rt, lt)
        if who == "ucx":
            def op(plan: TransferPlan = plan) -> None:
                getattr(ucx.local, mode)("bench-peer", plan).wait(60.0)
        elif who == "raw_ucp":
            op = _raw_ucp(ucx, mode, lt, rt)
            if op is None:   # one-sided calls off (--no-rma)
                continue
        else:
            op = _raw_nixl(nixl.local, "bench-peer", mode, plan)
        sides[who] = (op, _verifier(pair, mode, lt, rt))
    times: dict[str, list[float]] = {who: [] for who in sides}
    order = list(sides)
    for i in range(iters + 1):   # the first round warms both up
        for who in (order if i % 2 else order[::-1]):
            op, verify = sides[who]
            t = _timed(op, verify)
            if i:
                times[who].append(t)
    total = pages * page_bytes
    med = {who: total / statistics.median(ts) / 1e9 for who, ts in times.items()}
    return {"what": f"{pages} x {page_bytes >> 10} KiB {mode}, GB/s", "ucx": med["ucx"], "raw_nixl": med["raw_nixl"],
            "raw_ucp": med.get("raw_ucp"), "ratio": med["ucx"] / med["raw_nixl"],
            "verified": all(v.failed == 0 and v.checked > 0 for _, v in sides.values())}


def latency_row(ucx: _Pair, nixl: _Pair, iters: int, page_bytes: int = 16384) -> dict[str, Any]:
    """One-page ``write(plan).wait()`` p50 of kvxfer ucx (a new plan each iteration) against raw NIXL's
    prepared-list post + polling, the same page slots, interleaved and alternating."""
    slots = min(ucx.local_region.nbytes, nixl.local_region.nbytes) // page_bytes
    raw = _RawNixlPages(nixl.local, "bench-peer", nixl.local_region, nixl.peer_region, page_bytes)
    rng = np.random.default_rng(99)
    times: dict[str, list[float]] = {"ucx": [], "raw_nixl": []}
    checked = failed = 0
    try:
        for i in range(iters + 5):
            ls, rs = int(rng.integers(0, slots)), int(rng.integers(0, slots))
            runs = []
            for who, pair in (("ucx", ucx), ("raw_nixl", nixl)):
                lt = PageTable(np.array([pair.local_region.base_address + ls * page_bytes], np.uint64),
                               np.array([page_bytes], np.uint64), np.zeros(1, np.uint32))
                rt = PageTable(np.array([pair.peer_region.base_address + rs * page_bytes], np.uint64),
                               np.array([page_bytes], np.uint64), np.zeros(1, np.uint32))
                runs.append((who, pair, lt, rt))
            for who, pair, lt, rt in (runs if i % 2 else runs[::-1]):
                pair.remote_poison(rt, 0x11 + i % 200)
                if who == "ucx":
                    plan = TransferPlan(lt, rt)
                    t0 = time.perf_counter()
                    ucx.local.write("bench-peer", plan).wait(10.0)
                    t = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    raw.wait(raw.post("WRITE", [ls], [rs]))
                    t = time.perf_counter() - t0
                checked += 1
                failed += pair.remote_digest(rt) != pages_digest(pair.local_pool, pair.local_region.base_address, lt)
                if i >= 5:
                    times[who].append(t)
    finally:
        raw.close()
    med = {who: statistics.median(ts) * 1e6 for who, ts in times.items()}
    return {"what": f"one {page_bytes >> 10} KiB page write+wait, p50, us", "ucx": med["ucx"],
            "raw_nixl": med["raw_nixl"], "ratio": med["ucx"] / med["raw_nixl"], "verified": failed == 0 and checked > 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=7, help="timed iterations per bandwidth row and side")
    ap.add_argument("--latency-iters", type=int, default=200)
    ap.add_argument("--no-error-handling", action="store_true", help="ucx endpoints without peer-failure handling")
    ap.add_argument("--nixl-error-handling", action="store_true",
                    help="raw NIXL with peer-failure handling (and NIXL's progress thread)")
    ap.add_argument("--no-rma", action="store_true", help="ucx: the two-sided protocol only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ucx_opts: dict[str, Any] = {"error_handling": not args.no_error_handling}
    if args.no_rma:
        ucx_opts["rma"] = False
    nixl_opts = {"error_handling": True, "progress_thread": True} if args.nixl_error_handling else {}
    rows = []
    for pages, page_bytes, mode in TABLE_ROWS:
        nbytes = 2 * pages * page_bytes
        ucx, nixl = _Pair("ucx", nbytes, ucx_opts), _Pair("nixl", nbytes, nixl_opts)
        try:
            rows.append(bandwidth_row(ucx, nixl, pages, page_bytes, mode, args.iters))
        finally:
            ucx.close()
            nixl.close()
    ucx, nixl = _Pair("ucx", 8192 * 16384, ucx_opts), _Pair("nixl", 8192 * 16384, nixl_opts)
    try:
        rows.append(latency_row(ucx, nixl, args.latency_iters))
    finally:
        ucx.close()
        nixl.close()
    out = {"ucx_options": ucx_opts, "nixl_options": nixl_opts, "iters": args.iters,
           "latency_iters": args.latency_iters, "rows": rows, "verified": all(r["verified"] for r in rows)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'':40} {'raw NIXL':>10} {'kvxfer ucx':>12} {'ratio':>7} {'raw UCP RMA':>12} {'ratio':>7}"
              f"  (ucx {ucx_opts}, nixl {nixl_opts})")
        for r in rows:
            raw_ucp = r.get("raw_ucp")
            extra = "" if raw_ucp is None else f" {raw_ucp:>12.2f} {raw_ucp / r['raw_nixl']:>6.2f}x"
            print(f"{r['what']:40} {r['raw_nixl']:>10.2f} {r['ucx']:>12.2f} {r['ratio']:>6.2f}x{extra}")
        print(f"every timed iteration verified: {out['verified']} (medians, interleaved)")
    return 0 if out["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
