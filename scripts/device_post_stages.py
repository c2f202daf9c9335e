"""Where the host time of a cuda_ipc post goes inside bench_gpu's loop (issue 17, goal 1, run 30).

bench_gpu's set-up and loop (poison, synchronise, own context first, post + wait, verify), cuda_ipc
alone, identical and TP 1->2 pushes at 4k and 32k tokens. Every stage of the post stamps the host clock
on entry and exit (a wrapper per method: ~0.3 us each), so each iteration gives, from the post's start:
the copier's entry, each part's staging wait, pack-and-launch, the plan's host check and the post's
return. Medians of the timed iterations. The same plans are also posted back to back (no poisoning or
verification between), and the host check alone is timed on this host, warm, for the CPU VM's figures
to be compared with. Prints a table; JSON to argv[1].

  python3 scripts/device_post_stages.py $OUT/post_stages.json
"""
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import bench_gpu

from kvxfer.pagetable import plan as plan_module
from kvxfer.transport import base, cuda_copy, cuda_ipc

STAMPS: list[tuple[str, int]] = []


def stamped(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that every call stamps ``label>`` on entry and ``label<`` on exit."""
    fn = getattr(owner, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        STAMPS.append((label + ">", time.perf_counter_ns()))
        try:
            return fn(*args, **kw)
        finally:
            STAMPS.append((label + "<", time.perf_counter_ns()))
    setattr(owner, name, wrapper)


def instrument() -> None:
    stamped(cuda_copy.BatchedCopier, "copy", "copy")
    stamped(cuda_copy._Staging, "take", "take")
    stamped(cuda_copy.BatchedCopier, "_launch_part", "part")
    stamped(base.Transport, "_check_plan", "check")
    stamped(plan_module.TransferPlan, "_check_disjoint_vectorised", "disjoint")
    stamped(cuda_ipc.CudaIpcTransport, "_post", "post")


def stages(stamps: list[tuple[str, int]], t0: int) -> dict[str, float]:
    """Per label: summed time inside (us), and the first entry / last exit from ``t0`` (us)."""
    out: dict[str, float] = defaultdict(float)
    open_at: dict[str, int] = {}
    for label, t in stamps:
        key = label[:-1]
        if label.endswith(">"):
            open_at[key] = t
            out.setdefault(f"{key}_first_in", (t - t0) / 1e3)
        else:
            out[f"{key}_sum"] += (t - open_at.pop(key)) / 1e3
            out[f"{key}_last_out"] = (t - t0) / 1e3
    return dict(out)


def measure(bench: Any, mode: str, dst_names: list[str], blk: dict[str, np.ndarray], iters: int) -> dict[str, Any]:
    plans, _ = bench.plans(mode, dst_names, blk)
    t = bench.ts["cuda_ipc"]
    op, peer = (t.write if mode == "push" else t.read), f"{bench_gpu.PEER}-cuda_ipc"

    def post() -> tuple[int, int, int]:
        STAMPS.clear()
        start = time.perf_counter_ns()
        hs = [op(peer, p) for p in plans]
        posted = time.perf_counter_ns()
        for h in hs:
            h.wait(120)
        return start, posted, time.perf_counter_ns()

    post()
    rows: dict[str, list[dict[str, float]]] = {"bench": [], "back_to_back": []}
    bad = 0
    for _ in range(iters):
        bench.poison(mode, dst_names, blk)
        bench_gpu.sync(bench.device)
        bench.touch_own_context()
        start, posted, done = post()
        row = stages(STAMPS, start)
        row.update(posted=(posted - start) / 1e3, done=(done - start) / 1e3)
        rows["bench"].append(row)
        bad += bench.bad(mode, dst_names, blk)
    for _ in range(iters):
        start, posted, done = post()
        row = stages(STAMPS, start)
        row.update(posted=(posted - start) / 1e3, done=(done - start) / 1e3)
        rows["back_to_back"].append(row)
    out: dict[str, Any] = {"runs": sum(len(p) for p in plans), "plans": len(plans), "wrong_elements": bad,
                           "bytes": sum(p.total_bytes for p in plans)}
    for loop, rs in rows.items():
        keys = sorted({k for r in rs for k in r})
        out[loop] = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys}
    # The host check alone, warm, on this host (the CPU VM's figures are for the same plans).
    regions = list(t.regions)
    peer_regions = list(t.peer_regions(peer))
    ts = []
    for _ in range(25):
        t0 = time.perf_counter_ns()
        for p in plans:
            p.validate(regions, peer_regions) if mode == "push" else p.validate(peer_regions, regions)
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    out["check_warm_us"] = statistics.median(ts)
    return out


def main() -> None:
    torch.cuda.set_device(0)
    instrument()
    res: dict[str, Any] = {"cpu": platform.processor(), "cases": []}
    try:
        with open("/proc/cpuinfo") as f:
            res["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print("cpu:", res["cpu"], flush=True)
    for tokens in (4096, 32768):
        nblocks = tokens // bench_gpu.TPB
        bench = bench_gpu.Bench(["cuda_ipc"], False, nblocks, "cuda:0")
        rng = np.random.default_rng(tokens)
        blk = {name: rng.choice(nblocks + 8, nblocks, replace=False).astype(np.int32) for name in bench.mgrs}
        for case, dst_names in (("identical", ["decode"]), ("tp1->2", ["rank0", "rank1"])):
            for mode in ("push", "pull"):
                bench.set_source(mode, blk["prefill"])
                row = {"tokens": tokens, "case": case, "mode": mode,
                       **measure(bench, mode, dst_names, blk, 9)}
                res["cases"].append(row)
                b, a = row["bench"], row["back_to_back"]
                print(f"{tokens:>6} {case:<9} {mode:<4} runs {row['runs']:>6}  bench: posted {b['posted']:7.0f} "
                      f"done {b['done']:7.0f} copy-in {b.get('copy_first_in', 0):5.0f} take {b.get('take_sum', 0):5.0f} "
                      f"part {b.get('part_sum', 0):6.0f} check {b.get('check_sum', 0):6.0f} "
                      f"(disjoint {b.get('disjoint_sum', 0):5.0f})  | b2b: posted {a['posted']:7.0f} "
                      f"done {a['done']:7.0f} part {a.get('part_sum', 0):6.0f} check {a.get('check_sum', 0):6.0f} "
                      f"| check warm {row['check_warm_us']:6.0f}  wrong {row['wrong_elements']}", flush=True)
        bench.close()
        del bench
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
