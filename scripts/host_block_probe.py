"""Host work of bench_gpu's plans as TransferPlans and as BlockPlans, on CPU managers (run anywhere): the
planning (plan_transfer / plan_blocks, template cached after the first call), the check (validate) and
the bytes a cuda_ipc post would upload. Medians of 15, warm.

  python3 scripts/host_block_probe.py [tokens ...]
"""
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, "benchmarks")
import bench_gpu as bg  # noqa: E402

from kvxfer.extractor import plan_blocks, plan_transfer  # noqa: E402


def med_us(fn, n=15):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


for tokens in [int(a) for a in sys.argv[1:]] or [4096, 32768]:
    nb = tokens // bg.TPB
    mgrs = bg.managers(nb, "cpu")
    regions = [r for m in mgrs.values() for r in m.memory_regions()]
    offs = bg.region_offsets(mgrs)
    rng = np.random.default_rng(tokens)
    blk = {n: rng.choice(nb + 8, nb, replace=False).astype(np.int32) for n in mgrs}
    for case, dsts in (("identical", ["decode"]), ("tp1->2", ["rank0", "rank1"])):
        sl = mgrs["prefill"].layout
        args = [(sl, {0: blk["prefill"]}, mgrs[d].layout, {0: blk[d]}) for d in dsts]
        runs = [plan_transfer(*a) for a in args]
        blocks = [plan_blocks(*a) for a in args]
        shifted = [b.shift_regions(offs["prefill"], offs[d]) for b, d in zip(blocks, dsts)]
        assert all(b is not None for b in blocks)
        assert sum(p.total_bytes for p in runs) == sum(b.total_bytes for b in blocks)
        row = {
            "tokens": tokens, "case": case, "runs": sum(len(p) for p in runs),
            "template": blocks[0].runs_per_block, "blocks": blocks[0].num_blocks,
            "plan_transfer_us": med_us(lambda: [plan_transfer(*a) for a in args]),
            "plan_blocks_us": med_us(lambda: [plan_blocks(*a) for a in args]),
            "validate_runs_us": med_us(lambda: [bg.TransferPlan(bg.shift(p.src, offs["prefill"]),
                                                                bg.shift(p.dst, offs[d])).validate(regions, regions)
                                                for p, d in zip(runs, dsts)]),
            "validate_blocks_us": med_us(lambda: [b.validate(regions, regions) for b in shifted]),
            "upload_runs_bytes": sum(16 * len(p) + 16 for p in runs),
            "upload_blocks_bytes": sum(16 * b.num_blocks + 44 * b.runs_per_block for b in blocks),
        }
        print(row, flush=True)
