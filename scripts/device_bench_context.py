"""Why a cuda_ipc post inside bench_gpu's loop is slower than back to back (issue 17, goal 1).

bench_gpu's own set-up (peer process, Llama-3-8B shape, 4k tokens). Variants, 15 timed iterations each
(medians): "bench" = bench_gpu's loop (poison, synchronise, post + wait, verify); "nobad" = no verify;
"again" = back to back; "bench2" = bench with the garbage collector off; "torch" = bench's loop with a 512 MiB ``copy_`` + synchronise in place of the post
(the D2D wall limit in the same surroundings). Host stamps relative to t0 (kernel enqueue start/end,
post return, wait return) and CUDA events on the copier's stream (anchor recorded before t0, one at
enqueue start, one after the launch, one after the wait) show whether host or GPU starts late.

  python3 scripts/device_bench_context.py $OUT/bench_context.json
"""
import gc
import json
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import bench_gpu

from kvxfer.transport import cuda_copy

MARK: dict[str, float] = {}
EVENTS: dict[str, torch.cuda.Event] = {}


def main() -> None:
    torch.cuda.set_device(0)
    out: dict = {}
    tokens = 4096
    nblocks = tokens // bench_gpu.TPB
    bench = bench_gpu.Bench(["cuda_ipc"], False, nblocks, "cuda:0")
    t = bench.ts["cuda_ipc"]
    copier = t._copier
    run_kernel = copier._run_kernel

    def stamped(*a, **k):
        EVENTS["k0"].record(copier.stream)
        MARK["k_in"] = time.perf_counter()
        try:
            return run_kernel(*a, **k)
        finally:
            MARK["k_out"] = time.perf_counter()
            EVENTS["k1"].record(copier.stream)
    copier._run_kernel = stamped
    print("launcher:", copier.launcher, flush=True)

    rng = np.random.default_rng(tokens)
    blk = {name: rng.choice(nblocks + 8, nblocks, replace=False).astype(np.int32) for name in bench.mgrs}
    big_a = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    big_b = torch.empty_like(big_a)
    for case, dsts, mode in (("identical", ["decode"], "push"), ("identical", ["decode"], "pull"),
                             ("tp1->2", ["rank0", "rank1"], "push")):
        bench.set_source(mode, blk["prefill"])
        plans, _ = bench.plans(mode, dsts, blk)
        post = bench.backend_post("cuda_ipc", mode, plans)
        for variant in ("bench", "nobad", "again", "torch", "bench2"):
            rows = defaultdict(list)
            bad = 0
            for it in range(17):
                for k in ("anchor", "k0", "k1", "end"):
                    EVENTS[k] = torch.cuda.Event(enable_timing=True)
                if variant in ("bench", "nobad", "torch", "bench2"):
                    bench.poison(mode, dsts, blk)
                torch.cuda.synchronize()
                if variant == "bench2":   # bench with the cyclic garbage collector off
                    gc.disable()
                EVENTS["anchor"].record(copier.stream)
                MARK.clear()
                t0 = time.perf_counter()
                if variant == "torch":
                    big_b.copy_(big_a)
                    torch.cuda.synchronize()
                    posted = time.perf_counter()
                else:
                    posted = post()
                t2 = time.perf_counter()
                EVENTS["end"].record(copier.stream)
                EVENTS["end"].synchronize()
                gc.enable()
                if variant in ("bench", "torch", "bench2"):
                    bad += bench.bad(mode, dsts, blk) if variant != "torch" else 0
                if it < 2:
                    continue
                rows["total_us"].append((t2 - t0) * 1e6)
                rows["post_us"].append((posted - t0) * 1e6)
                if "k_in" in MARK:
                    rows["host_k_in_us"].append((MARK["k_in"] - t0) * 1e6)
                    rows["host_k_out_us"].append((MARK["k_out"] - t0) * 1e6)
                    rows["gpu_anchor_to_k0_us"].append(EVENTS["anchor"].elapsed_time(EVENTS["k0"]) * 1e3)
                    rows["gpu_k0_to_k1_us"].append(EVENTS["k0"].elapsed_time(EVENTS["k1"]) * 1e3)
                    rows["gpu_k1_to_end_us"].append(EVENTS["k1"].elapsed_time(EVENTS["end"]) * 1e3)
                rows["gpu_anchor_to_end_us"].append(EVENTS["anchor"].elapsed_time(EVENTS["end"]) * 1e3)
            med = {k: round(statistics.median(v), 1) for k, v in rows.items()}
            med["wrong"] = bad
            key = f"{case} {mode} {variant}"
            out[key] = med
            print(f"{key:26s} " + " ".join(f"{k}={v}" for k, v in med.items()), flush=True)
    # One launch alone, back to back (host time of a 1-program launch that copies nothing): the copier's
    # launcher, and Triton's own launcher of the same kernel (a copier without the driver entry points).
    zero = torch.zeros(64, dtype=torch.int64, device="cuda")
    z = int(zero.data_ptr())
    args = (z, z, z, z, z, z, z, 2, 2, z, z, z)
    cuda_copy._libcuda.cache_clear()
    real = cuda_copy._libcuda
    cuda_copy._libcuda = lambda: None
    triton_copier = cuda_copy.BatchedCopier(0, "kernel")
    cuda_copy._libcuda = real
    for name, c in ((copier.launcher, copier), ("triton", triton_copier)):
        launch = next(iter(c._compiled.values()))
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            launch(1, 1, c._stream_handle, args)
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        out[f"{name} launch us"] = statistics.median(times)
    print({k: v for k, v in out.items() if k.endswith(" us")})
    bench.close()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
