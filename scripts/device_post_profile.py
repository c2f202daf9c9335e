"""Device profile of one cuda_ipc ``write(plan).wait()`` between two processes (issue 17, goal 2):
cProfile of the posting thread over 300 one-block and 128-block pushes (bench_gpu's set-up, cuda_ipc
alone), and whether ``torch.cuda.Event.synchronize`` lets other Python threads run while it waits
(the completion thread synchronises on every copy). Prints the profile; JSON to argv[1].

  python3 scripts/device_post_profile.py $OUT/post_profile.json
"""
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import bench_gpu


def gil_released_by_event_synchronize() -> dict[str, float]:
    """Python loop iterations the main thread makes while another thread synchronises on an event
    behind a ~50 ms GPU sleep, against the same loop with that thread sleeping in time.sleep."""
    out = {}
    for how in ("event.synchronize", "time.sleep"):
        ev = torch.cuda.Event()
        torch.cuda._sleep(int(1.98e9 * 0.05))   # ~50 ms of GPU clock cycles
        ev.record()
        started = threading.Event()

        def waiter(how: str = how, ev: torch.cuda.Event = ev, started: threading.Event = started) -> None:
            started.set()
            if how == "event.synchronize":
                ev.synchronize()
            else:
                time.sleep(0.05)
        t = threading.Thread(target=waiter)
        t.start()
        started.wait()
        n, t0 = 0, time.perf_counter()
        while t.is_alive():
            n += 1
        out[how] = n / (time.perf_counter() - t0)
        torch.cuda.synchronize()
    return out


def main() -> None:
    torch.cuda.set_device(0)
    res: dict = {"loop_iterations_per_s_while_another_thread_waits": gil_released_by_event_synchronize()}
    print(res, flush=True)
    bench = bench_gpu.Bench(["cuda_ipc"], False, 4096 // bench_gpu.TPB, "cuda:0")
    rng = np.random.default_rng(0)
    nblocks = 4096 // bench_gpu.TPB
    blk = {name: rng.choice(nblocks + 8, nblocks, replace=False).astype(np.int32) for name in bench.mgrs}
    for k in (1, 128):
        sub = {n: b[:k] for n, b in blk.items()}
        plans, _ = bench.plans("push", ["decode"], sub)
        t = bench.ts["cuda_ipc"]
        peer = f"{bench_gpu.PEER}-cuda_ipc"
        for _ in range(20):
            t.write(peer, plans[0]).wait(10)
        times, posts = [], []
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            t0 = time.perf_counter()
            h = t.write(peer, plans[0])
            t1 = time.perf_counter()
            h.wait(10)
            times.append(time.perf_counter() - t0)
            posts.append(t1 - t0)
        prof.disable()
        plain = []
        for _ in range(300):
            t0 = time.perf_counter()
            t.write(peer, plans[0]).wait(10)
            plain.append(time.perf_counter() - t0)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        row = {"blocks": k, "descriptors": len(plans[0]), "bytes": plans[0].total_bytes,
               "write_wait_p50_us": statistics.median(plain) * 1e6,
               "profiled_write_wait_p50_us": statistics.median(times) * 1e6,
               "profiled_write_p50_us": statistics.median(posts) * 1e6, "profile": s.getvalue()}
        res[f"blocks_{k}"] = row
        print(json.dumps({kk: v for kk, v in row.items() if kk != "profile"}), flush=True)
        print(s.getvalue()[:6000], flush=True)
    bench.close()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
