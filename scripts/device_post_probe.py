"""Device probe of the cuda_ipc post path (issue 17, goal 2): the host time of each step of one
``BatchedCopier.copy`` and of the whole post -> done, in one process, for a one-block plan (64 runs of
64 KiB) and for 128 x 4 MiB and 16,384 x 32 KiB plans; medians of 200. Prints a table; JSON to argv[1].

  python3 scripts/device_post_probe.py $OUT/post_probe.json
"""
import json
import statistics
import sys
import time

import numpy as np
import torch

from kvxfer.transport import cuda_copy
from kvxfer.transport.cuda_copy import cu

MIB = 1 << 20


def median_us(fn, iters=200):
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[iters // 10:]) * 1e6


def main() -> None:
    torch.cuda.set_device(0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.random_(0, 256)
    copier = cuda_copy.BatchedCopier(0, "kernel")
    zero = cuda_copy.RegionTable(np.zeros(1, np.uint64), np.zeros(1, np.uint64), 0)
    rng = np.random.default_rng(0)
    cases = {}
    for name, run, count in (("1 block: 64 x 64KiB", 64 << 10, 64), ("128 x 4MiB", 4 * MIB, 128),
                             ("16384 x 32KiB", 32 << 10, 16384)):
        slots = (1 << 30) // run
        if name.startswith("1 block"):
            s = np.uint64(src.data_ptr()) + np.arange(count, dtype=np.uint64) * np.uint64(run)
            d = np.uint64(dst.data_ptr()) + np.arange(count, dtype=np.uint64) * np.uint64(run)
        else:
            count = min(count, slots)
            s = rng.choice(slots, count, replace=False).astype(np.uint64) * np.uint64(run) + np.uint64(src.data_ptr())
            d = rng.choice(slots, count, replace=False).astype(np.uint64) * np.uint64(run) + np.uint64(dst.data_ptr())
        cases[name] = (d, s, np.full(count, run, np.uint64), np.zeros(count, np.uint32))
    stream = copier.stream
    default = torch.cuda.default_stream(0)
    ev = torch.cuda.Event()
    steps = {
        "torch.cuda.Event()": lambda: torch.cuda.Event(),
        "event.record(stream)": lambda: ev.record(stream),
        "default record + stream.wait_event": lambda: (copier._model_done.record(default),
                                                       stream.wait_event(copier._model_done)),
        "make_current": lambda: cuda_copy.make_current(0),
        "default_stream.query()": lambda: default.query(),
        "cuMemcpyHtoDAsync 4 KiB": None,
        "event.synchronize (done)": lambda: ev.synchronize(),
    }
    stage = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    table = torch.empty(4096, dtype=torch.uint8, device="cuda")
    h = int(stream.cuda_stream)
    steps["cuMemcpyHtoDAsync 4 KiB"] = lambda: cu.cuMemcpyHtoDAsync(int(table.data_ptr()), int(stage.data_ptr()),
                                                                     4096, h)
    out = {"steps_us": {}, "cases": {}}
    for name, fn in steps.items():
        out["steps_us"][name] = median_us(fn)
        torch.cuda.synchronize()
    for name, (d, s, n, r) in cases.items():
        copier.copy(d, s, n, r, zero, False).synchronize()
        post = median_us(lambda d=d, s=s, n=n, r=r: copier.copy(d, s, n, r, zero, False))
        torch.cuda.synchronize()
        whole = median_us(lambda d=d, s=s, n=n, r=r: copier.copy(d, s, n, r, zero, False).synchronize())
        # the launch alone (staging and upload as in copy): time _run_kernel
        launch = median_us(lambda d=d, s=s, n=n, r=r: copier._run_kernel(d, s, n, r, zero, False))
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu = []
        for _ in range(20):
            torch.cuda.synchronize()
            a.record(stream)
            copier._run_kernel(d, s, n, r, zero, False)
            b.record(stream)
            b.synchronize()
            gpu.append(a.elapsed_time(b) * 1e3)
        out["cases"][name] = {"copy_host_us": post, "copy_plus_sync_us": whole, "run_kernel_host_us": launch,
                              "gpu_us": statistics.median(gpu), "bytes": int(n.sum())}
    ta, tb = src[: 4 * MIB], dst[: 4 * MIB]

    def torch_copy():
        tb.copy_(ta)
        torch.cuda.synchronize()
    out["torch_4MiB_copy_plus_sync_us"] = median_us(torch_copy)
    for k, v in out["steps_us"].items():
        print(f"{k:40s} {v:8.1f} us")
    for k, v in out["cases"].items():
        print(f"{k:20s} " + " ".join(f"{kk} {vv:.1f}" for kk, vv in v.items()))
    print(f"torch 4 MiB copy_ + sync {out['torch_4MiB_copy_plus_sync_us']:.1f} us", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
