"""Which call of a cuda_ipc post is slower inside bench_gpu's loop than back to back (issue 17, goal 1).

bench_gpu's set-up (4k tokens, identical layout). A profile hook records every call's duration (depth
<= 4) during ``write``; medians per call are compared between "bench" (poison, synchronise, post, verify)
and "again" (back to back). Untraced variants: "spin" (bench with a 300 us busy wait before the post),
and the kernel's own GPU time (events around the launch alone).

  python3 scripts/device_bench_trace.py $OUT/bench_trace.json
"""
import json
import statistics
import sys
import threading
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import bench_gpu

TRACE: list = []
STACK: list = []
GPU: dict = {}


def tracer(frame, event, arg):
    t = time.perf_counter()
    if event == "call":
        STACK.append((t, frame.f_code.co_qualname))
    elif event == "c_call":
        STACK.append((t, getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?")))
    elif event in ("return", "c_return", "c_exception") and STACK:
        t0, name = STACK.pop()
        if len(STACK) <= 4:
            TRACE.append((len(STACK), name, (t - t0) * 1e6))


class TimedLauncher:
    """Events on the copier's stream right before and after the kernel launch."""

    def __init__(self, inner, stream):
        self.inner, self.stream = inner, stream

    def __call__(self, *a):
        GPU["kb"].record(self.stream)
        t0 = time.perf_counter()
        self.inner(*a)
        GPU["launch_host_us"] = (time.perf_counter() - t0) * 1e6
        GPU["ka"].record(self.stream)


def main() -> None:
    torch.cuda.set_device(0)
    print("threads:", [t.name for t in threading.enumerate()], flush=True)
    out: dict = {}
    tokens = 4096
    nblocks = tokens // bench_gpu.TPB
    bench = bench_gpu.Bench(["cuda_ipc"], False, nblocks, "cuda:0")
    print("threads:", [t.name for t in threading.enumerate()], flush=True)
    copier = bench.ts["cuda_ipc"]._copier
    print("launcher:", copier.launcher, flush=True)
    for k in list(copier._compiled):
        copier._compiled[k] = TimedLauncher(copier._compiled[k], copier.stream)
    compile_ = copier._compile

    def compile_timed(key):
        copier._compiled[key] = TimedLauncher(compile_(key), copier.stream)
        return copier._compiled[key]
    copier._compile = compile_timed
    rng = np.random.default_rng(tokens)
    blk = {name: rng.choice(nblocks + 8, nblocks, replace=False).astype(np.int32) for name in bench.mgrs}
    for mode in ("pull", "push"):
        bench.set_source(mode, blk["prefill"])
        plans, _ = bench.plans(mode, ["decode"], blk)
        post = bench.backend_post("cuda_ipc", mode, plans)
        GPU["kb"] = torch.cuda.Event(enable_timing=True)
        GPU["ka"] = torch.cuda.Event(enable_timing=True)
        post()
        for variant in ("bench", "again", "spin", "bench-untraced", "again-untraced"):
            calls = defaultdict(list)
            rows = defaultdict(list)
            for it in range(17):
                GPU["kb"] = torch.cuda.Event(enable_timing=True)
                GPU["ka"] = torch.cuda.Event(enable_timing=True)
                if not variant.startswith("again"):
                    bench.poison(mode, ["decode"], blk)
                torch.cuda.synchronize()
                if variant == "spin":
                    t_end = time.perf_counter() + 300e-6
                    while time.perf_counter() < t_end:
                        pass
                traced = "untraced" not in variant and variant != "spin"
                TRACE.clear()
                STACK.clear()
                t0 = time.perf_counter()
                if traced:
                    sys.setprofile(tracer)
                posted = post()
                if traced:
                    sys.setprofile(None)
                t2 = time.perf_counter()
                if not variant.startswith("again"):
                    bench.bad(mode, ["decode"], blk)
                if it < 2:
                    continue
                rows["total_us"].append((t2 - t0) * 1e6)
                rows["post_us"].append((posted - t0) * 1e6)
                rows["launch_host_us"].append(GPU["launch_host_us"])
                rows["gpu_kernel_us"].append(GPU["kb"].elapsed_time(GPU["ka"]) * 1e3)
                seen: dict = defaultdict(int)
                for depth, name, dt in TRACE:
                    seen[(depth, name)] += 1
                    calls[(depth, name, seen[(depth, name)])].append(dt)
            med = {k: round(statistics.median(v), 1) for k, v in rows.items()}
            out[f"{mode} {variant}"] = med
            out[f"{mode} {variant} calls"] = {f"{d} {n} #{i}": round(statistics.median(v), 1)
                                             for (d, n, i), v in calls.items()}
            print(f"{mode} {variant:15s} " + " ".join(f"{k}={v}" for k, v in med.items()), flush=True)
        b, a = out[f"{mode} bench calls"], out[f"{mode} again calls"]
        diff = sorted(((b[k] - a.get(k, 0.0), k, b[k], a.get(k)) for k in b), reverse=True)[:25]
        print(f"--- {mode}: calls slower in bench than back to back (bench - again, bench, again us)")
        for d, k, bv, av in diff:
            print(f"  {d:8.1f} {bv:8.1f} {av!s:>8} {k}")
    bench.close()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
