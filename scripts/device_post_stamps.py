"""Where one cuda_ipc ``write(plan)`` spends its time between two processes (issue 17, goals 1-2):
bench_gpu's set-up (peer process, Llama-3-8B shape), host stamps around each step of the post path and
CUDA events on the copier's stream (when the upload starts and the kernel ends, as the GPU saw them,
relative to an event recorded at ``write`` entry). Medians of 15 per case and variant:
"bench" poisons at the peer and synchronises before each post (as bench_gpu), "again" posts back to
back (synchronised in between), "copier" calls ``BatchedCopier.copy`` directly (no Transport).

  python3 scripts/device_post_stamps.py $OUT/post_stamps.json
"""
import functools
import json
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import bench_gpu

from kvxfer.pagetable import TransferPlan
from kvxfer.transport import base, cuda_copy

stamps: dict[str, list[float]] = defaultdict(list)


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            stamps[label].append((time.perf_counter() - t0) * 1e6)
    setattr(owner, name, wrapper)


def main() -> None:
    torch.cuda.set_device(0)
    timed(base.Transport, "_post", "write")
    timed(TransferPlan, "validate", "validate")
    timed(cuda_copy.BatchedCopier, "copy", "copier.copy")
    timed(cuda_copy.BatchedCopier, "_run_kernel", "run_kernel")
    timed(cuda_copy._Staging, "take", "staging.take")
    out: dict = {}
    for tokens in (4096,):
        nblocks = tokens // bench_gpu.TPB
        bench = bench_gpu.Bench(["cuda_ipc"], False, nblocks, "cuda:0")
        t = bench.ts["cuda_ipc"]
        copier = t._copier
        rng = np.random.default_rng(tokens)
        blk = {name: rng.choice(nblocks + 8, nblocks, replace=False).astype(np.int32) for name in bench.mgrs}
        cases = [("1 block", ["decode"], {n: b[:1] for n, b in blk.items()}),
                 ("identical", ["decode"], blk), ("tp1->2", ["rank0", "rank1"], blk)]
        for case, dsts, sub in cases:
            bench.set_source("push", sub["prefill"])
            plans, _ = bench.plans("push", dsts, sub)
            table = t._peer_tables[f"{bench_gpu.PEER}-cuda_ipc"]
            for variant in ("bench", "again", "copier"):
                stamps.clear()
                rows = defaultdict(list)
                for it in range(17):
                    if variant == "bench":
                        bench.poison("push", dsts, sub)
                    torch.cuda.synchronize()
                    anchor = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    anchor.record(copier.stream)
                    t0 = time.perf_counter()
                    if variant == "copier":
                        evs = [copier.copy(p.dst.addr, p.src.addr, p.src.nbytes, p.dst.region, table, False) for p in plans]
                        t1 = time.perf_counter()
                        for e in evs:
                            e.synchronize()
                    else:
                        hs = [t.write(f"{bench_gpu.PEER}-cuda_ipc", p) for p in plans]
                        t1 = time.perf_counter()
                        for h in hs:
                            h.wait(60)
                    t2 = time.perf_counter()
                    end.record(copier.stream)
                    end.synchronize()
                    if it >= 2:
                        rows["post_us"].append((t1 - t0) * 1e6)
                        rows["post_to_done_us"].append((t2 - t0) * 1e6)
                        rows["gpu_anchor_to_end_us"].append(anchor.elapsed_time(end) * 1e3)
                if variant == "bench":
                    rows["wrong"] = [bench.bad("push", dsts, sub)]
                med = {k: statistics.median(v) for k, v in rows.items()}
                med.update({f"step {k}": statistics.median(v[2 * len(plans):]) for k, v in stamps.items() if v})
                med["runs"] = sum(len(p) for p in plans)
                med["bytes"] = sum(p.total_bytes for p in plans)
                out[f"{tokens} {case} {variant}"] = med
                print(f"{tokens} {case:9s} {variant:6s} " + " ".join(f"{k}={v:.1f}" for k, v in med.items()), flush=True)
        bench.close()
    a, b = torch.empty(512 << 20, dtype=torch.uint8, device="cuda"), torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(15):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    out["torch 512 MiB copy_+sync us"] = statistics.median(times)
    print(out["torch 512 MiB copy_+sync us"])
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
