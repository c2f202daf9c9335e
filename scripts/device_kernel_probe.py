"""Device probe of the cuda_ipc copy kernel (issue 13): kernel variants against the D2D limit, in one
process, on randomly placed runs, and the host cost of one post. Prints one table; JSON to argv[1].

  python3 scripts/device_kernel_probe.py $OUT/kernel_probe.json
"""
import json
import statistics
import sys
import time

import numpy as np
import torch

from kvxfer.transport import cuda_copy

GIB = 1 << 30


def events_ms(fn, iters=10):
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(torch.cuda.current_stream())
        fn()
        b.record(torch.cuda.current_stream())
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    torch.cuda.set_device(0)
    src = torch.empty(4 * GIB + (64 << 20), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.random_(0, 256)
    a, b = src[:GIB], dst[:GIB]
    d2d = GIB / events_ms(lambda: b.copy_(a), 20) / 1e6
    print(f"D2D {d2d:.0f} GB/s", flush=True)
    copier = cuda_copy.BatchedCopier(0, "kernel")
    zero = cuda_copy.RegionTable(np.zeros(1, np.uint64), np.zeros(1, np.uint64), 0)
    rng = np.random.default_rng(0)
    cases = {}
    for name, run, count in (("32KiB x 131072", 32 << 10, 131072), ("4MiB x 1024", 4 << 20, 1024),
                             ("32KiB x 16384", 32 << 10, 16384), ("4MiB x 128", 4 << 20, 128)):
        slots = (4 * GIB) // run
        s = rng.choice(slots, count, replace=False).astype(np.uint64) * np.uint64(run) + np.uint64(src.data_ptr())
        d = rng.choice(slots, count, replace=False).astype(np.uint64) * np.uint64(run) + np.uint64(dst.data_ptr())
        cases[name] = (d, s, np.full(count, run, np.uint64), np.zeros(count, np.uint32), run * count)
    # (chunk, block words, warps, plans launched in parts): the shipped variant first, then the same
    # without parts (one launch per plan, as before run 29), then the kernel's knobs one at a time.
    pipeline = cuda_copy.PIPELINE_RUNS
    variants = [(32 << 10, 4096, 4, True), (32 << 10, 4096, 4, False), (32 << 10, 2048, 4, True),
                (32 << 10, 4096, 8, True), (64 << 10, 4096, 4, True), (16 << 10, 2048, 4, True)]
    rows = []
    for chunk, block, warps, parts in variants:
        cuda_copy.CHUNK_BYTES, cuda_copy.BLOCK_WORDS, cuda_copy.NUM_WARPS = chunk, block, warps
        cuda_copy.PIPELINE_RUNS = pipeline if parts else 1 << 62
        row = {"chunk": chunk, "block_words": block, "warps": warps, "parts": parts}
        for name, (d, s, n, r, total) in cases.items():
            copier.copy(d, s, n, r, zero, False).synchronize()   # compile + warm

            def go(d=d, s=s, n=n, r=r):
                ev = copier.copy(d, s, n, r, zero, False)
                torch.cuda.current_stream().wait_event(ev)
            ms = events_ms(go)
            # the copy alone: queued behind an identical copy, so the GPU never waits for the host post
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            kernel_ms = []
            for _ in range(5):
                torch.cuda.synchronize()
                copier.copy(d, s, n, r, zero, False)
                start.record(copier.stream)
                copier.copy(d, s, n, r, zero, False)
                stop.record(copier.stream)
                stop.synchronize()
                kernel_ms.append(start.elapsed_time(stop))
            host = []
            for _ in range(10):
                t0 = time.perf_counter()
                ev = copier.copy(d, s, n, r, zero, False)
                host.append(time.perf_counter() - t0)
                ev.synchronize()
            row[name] = {"gbps": total / ms / 1e6, "x_d2d": total / ms / 1e6 / d2d,
                         "queued_x_d2d": total / statistics.median(kernel_ms) / 1e6 / d2d,
                         "post_us": statistics.median(host) * 1e6}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # correctness of the shipped variant (in parts) on the 131072-run case, every run of every part sampled
    cuda_copy.CHUNK_BYTES, cuda_copy.BLOCK_WORDS, cuda_copy.NUM_WARPS = variants[0][:3]
    cuda_copy.PIPELINE_RUNS = pipeline
    d, s, n, r, _ = cases["32KiB x 131072"]
    dst.fill_(0)
    copier.copy(d, s, n, r, zero, False).synchronize()
    k = np.concatenate([np.random.default_rng(1).choice(d.size, 256, replace=False), [0, 8191, 8192, 40959,
                                                                                      40960, d.size - 1]])
    ok = all(torch.equal(dst[int(d[i]) - dst.data_ptr():][: 32 << 10], src[int(s[i]) - src.data_ptr():][: 32 << 10])
             for i in k)
    # latency of one small post (64 runs of 64 KiB, like one 4 MiB block of 64 layer-roles) vs torch
    cuda_copy.CHUNK_BYTES, cuda_copy.BLOCK_WORDS, cuda_copy.NUM_WARPS = variants[0][:3]
    cuda_copy.PIPELINE_RUNS = pipeline
    d1, s1 = cases["4MiB x 128"][0][:1], cases["4MiB x 128"][1][:1]
    dd = (d1[0] + np.arange(64, dtype=np.uint64) * np.uint64(64 << 10)).astype(np.uint64)
    ss = (s1[0] + np.arange(64, dtype=np.uint64) * np.uint64(64 << 10)).astype(np.uint64)
    nn = np.full(64, 64 << 10, np.uint64)
    rr = np.zeros(64, np.uint32)
    lat, tlat = [], []
    ta, tb = src[: 4 << 20], dst[: 4 << 20]
    for _ in range(200):
        t0 = time.perf_counter()
        copier.copy(dd, ss, nn, rr, zero, False).synchronize()
        lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tb.copy_(ta)
        torch.cuda.synchronize()
        tlat.append(time.perf_counter() - t0)
    out = {"d2d_gbps": d2d, "variants": rows, "verified_sample": ok,
           "one_block_copy_p50_us": statistics.median(lat[20:]) * 1e6,
           "torch_4MiB_copy_p50_us": statistics.median(tlat[20:]) * 1e6}
    print(json.dumps({k: v for k, v in out.items() if k != "variants"}))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
