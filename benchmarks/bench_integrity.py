"""Integrity benchmark: blake3 digest + verify of a plan's pages (full, every 8th, 5 % sample) next to
the in-process copy of the same plan (kvxfer.transport.copy.copy_plan), measured in the same run.

Host memory only (this is where the hash runs: CUDA entries are staged to host first). Every figure is the
median over ``--repeat`` runs; every timed copy lands in destination pages poisoned just before it and is
checked against the source just after it (untimed); every timed verify must pass (it raises otherwise).

    PYTHONPATH=$PWD python benchmarks/bench_integrity.py [--pages 8192] [--page-kib 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.cache.memory import MemoryRegion
from kvxfer.cli.bench_transport import Verifier, median_timed, pages_digest, poison_pages
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport.copy import copy_plan
from kvxfer.transport.integrity import ChecksumPolicy, digest_source, verify_destination


def median(fn: Callable[[], Any], repeat: int, verify: Verifier | None = None) -> float:
    """Median wall time of ``repeat`` runs, in seconds (after a warm-up; ``verify`` poisons the destination
    before and checks it after every run, untimed)."""
    return median_timed(fn, repeat, verify)


def table_stream_check(plan: TransferPlan, src: np.ndarray, dst: np.ndarray) -> Verifier:
    """Poison ``plan``'s destination pages in ``dst`` / check them against its source pages in ``src``."""
    s0, d0 = int(src.ctypes.data), int(dst.ctypes.data)
    return Verifier(lambda v: poison_pages(dst, d0, plan.dst, v), lambda: pages_digest(dst, d0, plan.dst),
                    pages_digest(src, s0, plan.src))


def plans(pages: int, page: int, rng: np.random.Generator, src: np.ndarray, dst: np.ndarray) -> dict[str, TransferPlan]:
    """Scattered pages (one entry each, shuffled) and the same bytes as 64 coalesced runs."""
    s0, d0 = int(src.ctypes.data), int(dst.ctypes.data)
    perm_s, perm_d = rng.permutation(pages), rng.permutation(pages)
    size = np.full(pages, page, np.uint64)
    zero = np.zeros(pages, np.uint32)
    scattered = TransferPlan(PageTable(s0 + perm_s.astype(np.uint64) * np.uint64(page), size, zero),
                             PageTable(d0 + perm_d.astype(np.uint64) * np.uint64(page), size, zero))
    runs = 64
    run = pages * page // runs
    starts = np.arange(runs, dtype=np.uint64) * np.uint64(run)
    rsize, rzero = np.full(runs, run, np.uint64), np.zeros(runs, np.uint32)
    coalesced = TransferPlan(PageTable(s0 + starts, rsize, rzero), PageTable(d0 + starts, rsize, rzero))
    return {f"{pages} x {page // 1024} KiB scattered": scattered, f"{runs} x {run >> 20} MiB runs": coalesced}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=8192)
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    page = args.page_kib * 1024
    nbytes = args.pages * page
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    sreg = [MemoryRegion(int(src.ctypes.data), nbytes)]
    dreg = [MemoryRegion(int(dst.ctypes.data), nbytes)]
    policies = {"full": ChecksumPolicy(), "every 8th": ChecksumPolicy.every(8),
                "5 % sample": ChecksumPolicy.sample(0.05, seed=1)}
    rows: list[dict[str, Any]] = []
    print(f"{'plan':<28} {'policy':<11} {'copy GB/s':>10} {'digest GB/s':>12} {'verify GB/s':>12} "
          f"{'digest/copy':>12} {'digest bytes':>13}")
    for pname, plan in plans(args.pages, page, rng, src, dst).items():
        check = table_stream_check(plan, src, dst)
        t_copy = median(lambda plan=plan: copy_plan(plan, sreg, dreg), args.repeat, check)
        if check.failed:
            raise SystemExit(f"copy_plan of {pname}: {check.failed} of {check.checked} copies did not arrive intact")
        for name, policy in policies.items():
            digest = digest_source(plan, sreg, policy, "bench")
            t_digest = median(lambda plan=plan, policy=policy: digest_source(plan, sreg, policy, "bench"), args.repeat)
            # verify_destination raises IntegrityError unless dst holds the copy: each timed run checks it
            t_verify = median(lambda plan=plan, digest=digest: verify_destination(plan, dreg, digest), args.repeat)
            row = {"plan": pname, "policy": name, "bytes": plan.total_bytes, "entries": len(plan),
                   "checked_bytes": digest.checked_bytes, "copy_s": t_copy, "digest_s": t_digest,
                   "verify_s": t_verify, "digest_wire_bytes": len(digest.to_bytes())}
            rows.append(row)
            print(f"{pname:<28} {name:<11} {plan.total_bytes / t_copy / 1e9:>10.2f} "
                  f"{plan.total_bytes / t_digest / 1e9:>12.2f} {plan.total_bytes / t_verify / 1e9:>12.2f} "
                  f"{t_digest / t_copy:>12.2f} {row['digest_wire_bytes']:>13}")
    out = pathlib.Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC)
    path = out / f"integrity-{stamp:%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps({"date": stamp.isoformat(), "machine": platform.platform(),
                                "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
