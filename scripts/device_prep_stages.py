"""Where the time of a prepared cuda_ipc post goes inside bench_gpu's loop (issue 17, goal 1 at 4k; run 37).

bench_gpu's set-up and loop (poison, synchronise, own context first, post + wait, verify), cuda_ipc plans
prepared once per case (``Transport.prepare``), identical and TP 1->2, push and pull, 4k and 32k tokens.
Per iteration, from the post's start (host clock, us): the entries of the post path's stages (transport,
cuda_ipc's enqueue, the copier's ordered launch), the first kernel launch's entry and the last one's exit,
the posts' return and the waits' end; and on the GPU (CUDA events recorded on the copier's stream
around each launch) the kernels' time from the first launch to the last one's end. The same ``copy_`` of
the case's bytes is timed the same way in the same loop (host clock and events on its stream). Then the
host cost of each CUDA call the post path makes is timed back to back, and the kernel's constants are swept on
the 4k pushes (program order, bytes per program, warps, words in flight), each variant prepared anew, timed
back to back by events and by host clock against ``copy_`` of the same bytes, its bytes verified by position.
Medians. Prints a table; JSON to argv[1]. ``SWEEP_ONLY=1``: only the sweep, at 4k and 32k (run 42, H200).

  python3 scripts/device_prep_stages.py $OUT/prep_stages.json
"""
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import bench_gpu

from kvxfer.transport import base, cuda_copy, cuda_ipc

HOST: dict[str, list[int]] = {"launch_in": [], "launch_out": []}
GPU: list[tuple[Any, Any]] = []


#: The copier's stream, for the events around a bound launch (which does not know its stream's torch object).
STREAM: list[Any] = []


def instrument() -> None:
    """Stamp every kernel launch (host clock in and out) and bracket it with timing events on its stream."""
    for cls, name in ((cuda_copy.BatchedCopier, "_launch_runs"), (cuda_copy.BatchedCopier, "_launch_blocks"),
                      (cuda_copy.BatchedCopier, "_run_batch"), (cuda_copy._BoundLaunch, "__call__")):
        real = getattr(cls, name)

        def wrapper(self: Any, *args: Any, _real: Any = real, **kw: Any) -> Any:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = getattr(self, "stream", None) or STREAM[-1]
            HOST["launch_in"].append(time.perf_counter_ns())
            before.record(stream)
            try:
                return _real(self, *args, **kw)
            finally:
                after.record(stream)
                HOST["launch_out"].append(time.perf_counter_ns())
                GPU.append((before, after))
        setattr(cls, name, wrapper)
    for cls, name, stamp in ((base.Transport, "_post_prepared", "post_in"),
                             (cuda_ipc.CudaIpcTransport, "_enqueue", "enqueue_in"),
                             (cuda_copy.BatchedCopier, "_ordered", "ordered_in")):
        setattr(cls, name, stamped(getattr(cls, name), stamp))


def stamped(real: Any, stamp: str) -> Any:
    """``real`` with the host clock taken on entry into ``HOST[stamp]``."""
    def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
        HOST.setdefault(stamp, []).append(time.perf_counter_ns())
        return real(self, *args, **kw)
    return wrapper


def host_calls(bench: Any) -> dict[str, float]:
    """Median host cost (us, 300 calls back to back) of each CUDA call a prepared post makes before its launch."""
    copier = bench.ts["cuda_ipc"]._copier
    default, stream = torch.cuda.default_stream(0), copier.stream
    reused = torch.cuda.Event()
    reused.record(stream)
    calls = {"default_stream.query": default.query,
             "Event()": torch.cuda.Event,
             "Event().record": lambda: torch.cuda.Event().record(stream),
             "reused event.record": lambda: reused.record(stream),
             "make_current": lambda: cuda_copy.make_current(0),
             "current_device": torch.cuda.current_device,
             "record+wait_event": lambda: (reused.record(default), stream.wait_event(reused)),
             "_ordered(noop)": lambda: copier._ordered(lambda: None, False)}
    out = {}
    for name, fn in calls.items():
        times = []
        for _ in range(300):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        out[name] = statistics.median(times) / 1e3
    return out


def reset() -> None:
    for v in HOST.values():
        v.clear()
    GPU.clear()


def one(bench: Any, post: Any, start_ns: int) -> dict[str, float]:
    """The stamps of one iteration, from ``start_ns`` (us), and the kernels' GPU time (us)."""
    torch.cuda.synchronize()
    row = {"launch_out": (HOST["launch_out"][-1] - start_ns) / 1e3 if HOST["launch_out"] else 0.0}
    for stamp in ("post_in", "enqueue_in", "ordered_in", "launch_in"):
        row[stamp] = (HOST[stamp][0] - start_ns) / 1e3 if HOST.get(stamp) else 0.0
    if GPU:
        row["gpu_us"] = GPU[0][0].elapsed_time(GPU[-1][1]) * 1e3
        row["gpu_sum_us"] = sum(a.elapsed_time(b) for a, b in GPU) * 1e3
    return row


def measure(bench: Any, mode: str, dst_names: list[str], blk: dict[str, np.ndarray], iters: int) -> dict[str, Any]:
    plans, _ = bench.plans(mode, dst_names, blk)
    t = bench.ts["cuda_ipc"]
    peer = f"{bench_gpu.PEER}-cuda_ipc"
    prepared = [t.prepare("write" if mode == "push" else "read", peer, p) for p in plans]
    nbytes = sum(p.total_bytes for p in plans)
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    out: dict[str, Any] = {"runs": sum(len(p) for p in plans), "bytes": nbytes, "wrong_elements": 0}

    def loop(kind: str, poisoned: bool) -> None:
        rows = []
        for i in range(iters + 1):
            if poisoned:
                bench.poison(mode, dst_names, blk)
                bench_gpu.sync(bench.device)
                bench.touch_own_context()
            else:
                torch.cuda.synchronize()
            reset()
            start = time.perf_counter_ns()
            if kind == "prep":
                hs = [x.post() for x in prepared]
                posted = time.perf_counter_ns()
                for h in hs:
                    h.wait(120)
            else:
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                b.copy_(a)
                ev1.record()
                posted = time.perf_counter_ns()
                torch.cuda.synchronize()
            done = time.perf_counter_ns()
            row = one(bench, None, start)
            if kind != "prep":
                row["gpu_us"] = ev0.elapsed_time(ev1) * 1e3
            row.update(posted=(posted - start) / 1e3, done=(done - start) / 1e3)
            if i:
                rows.append(row)
            if poisoned and kind == "prep":
                out["wrong_elements"] += bench.bad(mode, dst_names, blk)
        keys = sorted({k for r in rows for k in r})
        out[f"{kind}_{'bench' if poisoned else 'b2b'}"] = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}

    for kind in ("prep", "copy_"):
        for poisoned in (True, False):
            loop(kind, poisoned)
    for x in prepared:
        x.release()
    return out


def sweep(bench: Any, blk: dict[str, np.ndarray], iters: int) -> list[dict[str, Any]]:
    """The kernel's constants and program order on the identical and TP pushes: each variant prepared anew,
    back to back; the same bytes' ``copy_`` timed by events alongside."""
    saved = (cuda_copy.CHUNK_BYTES, cuda_copy.NUM_WARPS, cuda_copy.BLOCK_WORDS, cuda_copy.RUN_MAJOR)
    rows = []
    variants = [(case, 32, 4, 4096, order) for case in ("identical", "tp1->2") for order in (True, False)]
    # Whole 32 KiB pieces in one load step (the TP runs are 32 KiB: bigger pieces change nothing there).
    variants += [(case, *v, True) for case in ("identical", "tp1->2")
                 for v in ((32, 4, 8192), (32, 8, 8192), (32, 2, 8192), (16, 4, 4096))]
    variants += [("identical", *v, True) for v in ((64, 4, 4096), (128, 4, 4096), (64, 8, 8192), (128, 8, 8192),
                                                   (256, 8, 8192), (32, 8, 4096), (128, 8, 16384),
                                                   (64, 8, 16384), (64, 4, 8192), (128, 4, 8192))]
    # cuMemcpyBatchAsync (the copier's "batch" method: the driver's own copies, one per run) in place of the kernel.
    variants += [(case, 0, 0, 0, True) for case in ("identical", "tp1->2")]
    t = bench.ts["cuda_ipc"]
    method = t._copier.method
    for case, chunk_kib, warps, words, run_major in variants:
        dst_names = ["decode"] if case == "identical" else ["rank0", "rank1"]
        batch = chunk_kib == 0
        if not batch:
            cuda_copy.CHUNK_BYTES, cuda_copy.NUM_WARPS, cuda_copy.BLOCK_WORDS = chunk_kib << 10, warps, words
            cuda_copy.RUN_MAJOR = run_major
        head = {"case": case, "chunk_kib": chunk_kib, "warps": warps, "words": words, "run_major": run_major,
                "method": "batch" if batch else "kernel"}
        try:
            plans, _ = bench.plans("push", dst_names, blk)
            if batch:
                if t._copier._batch is None:
                    raise RuntimeError("no cuMemcpyBatchAsync on this driver")
                t._copier.method = "batch"
            try:
                prepared = [t.prepare("write", f"{bench_gpu.PEER}-cuda_ipc", p) for p in plans]
            finally:
                t._copier.method = method
            head["prepared_kinds"] = sorted({x.backend_state.copy.kind for x in prepared})
            bench.poison("push", dst_names, blk)
            bench_gpu.sync(bench.device)
            gpu, wall = [], []
            for _ in range(iters + 2):
                reset()
                t0 = time.perf_counter_ns()
                for h in [x.post() for x in prepared]:
                    h.wait(120)
                wall.append((time.perf_counter_ns() - t0) / 1e3)
                gpu.append(GPU[0][0].elapsed_time(GPU[-1][1]) * 1e3)
            wrong = bench.bad("push", dst_names, blk)
            nbytes = sum(p.total_bytes for p in plans)
            a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
            b = torch.empty_like(a)
            copy_ = []
            for _ in range(iters + 2):
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                b.copy_(a)
                ev1.record()
                ev1.synchronize()
                copy_.append(ev0.elapsed_time(ev1) * 1e3)
            del a, b
            row = {**head, "gpu_us": statistics.median(gpu[2:]), "copy_us": statistics.median(copy_[2:]),
                   "wall_us": statistics.median(wall[2:]), "bytes": nbytes, "wrong_elements": wrong}
            row["gpu_gbps"] = nbytes / row["gpu_us"] / 1e3
            row["x_copy_"] = row["copy_us"] / row["gpu_us"]
            for x in prepared:
                x.release()
        except Exception as exc:   # a variant Triton cannot build: say so, go on
            row = {**head, "error": repr(exc)[:300]}
        rows.append(row)
        print("sweep", json.dumps(row), flush=True)
    cuda_copy.CHUNK_BYTES, cuda_copy.NUM_WARPS, cuda_copy.BLOCK_WORDS, cuda_copy.RUN_MAJOR = saved
    return rows


def main() -> None:
    torch.cuda.set_device(0)
    instrument()
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "cases": [], "d2d_gbps": bench_gpu.d2d_gbps("cuda:0")}
    print(res["gpu"], f"D2D {res['d2d_gbps']:.0f} GB/s", flush=True)
    print(f"{'tokens':>6} {'case':<9} {'mode':<4} {'loop':<11} | {'post_in':>7} {'enqueue':>7} {'ordered':>7} "
          f"{'launch_in':>9} {'launch_out':>10} "
          f"{'posted':>7} {'done':>7} {'gpu':>7} | {'copy_ posted':>12} {'done':>7} {'gpu':>7}", flush=True)
    for tokens in (4096, 32768):
        nblocks = tokens // bench_gpu.TPB
        bench = bench_gpu.Bench(["cuda_ipc"], False, nblocks, "cuda:0")
        STREAM.append(bench.ts["cuda_ipc"]._copier.stream)
        rng = np.random.default_rng(tokens)
        blk = {name: rng.choice(nblocks + 8, nblocks, replace=False).astype(np.int32) for name in bench.mgrs}
        for case, dst_names in (("identical", ["decode"]), ("tp1->2", ["rank0", "rank1"])):
            for mode in ("push", "pull"):
                if os.environ.get("SWEEP_ONLY"):
                    continue
                bench.set_source(mode, blk["prefill"])
                row = {"tokens": tokens, "case": case, "mode": mode, **measure(bench, mode, dst_names, blk, 9)}
                res["cases"].append(row)
                for loop in ("bench", "b2b"):
                    p, c = row[f"prep_{loop}"], row[f"copy__{loop}"]
                    print(f"{tokens:>6} {case:<9} {mode:<4} {loop:<11} | {p['post_in']:7.1f} {p['enqueue_in']:7.1f} "
                          f"{p['ordered_in']:7.1f} {p['launch_in']:9.1f} "
                          f"{p['launch_out']:10.1f} {p['posted']:7.1f} {p['done']:7.1f} {p.get('gpu_us', 0):7.1f} | "
                          f"{c['posted']:12.1f} {c['done']:7.1f} {c['gpu_us']:7.1f}  wrong {row['wrong_elements']}",
                          flush=True)
        if tokens == 4096:
            res["host_calls_us"] = host_calls(bench)
            print("host calls (us, back to back):", json.dumps(res["host_calls_us"]), flush=True)
        if tokens == 4096 or os.environ.get("SWEEP_ONLY"):
            bench.set_source("push", blk["prefill"])
            res[f"sweep_{tokens}"] = sweep(bench, blk, 15)
        bench.close()
        del bench
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
