"""The host check and pack of bench_gpu's plans on CPU managers, warm and with cold caches (run anywhere).

  python3 scripts/host_check_probe.py [tokens]
"""
import sys, time, statistics, numpy as np
sys.path.insert(0, "benchmarks")
import bench_gpu as bg
from kvxfer.extractor import plan_transfer
from kvxfer.pagetable import TransferPlan
tokens_list = [int(a) for a in sys.argv[1:]] or [4096, 32768]
for tokens in tokens_list:
    nb = tokens // bg.TPB
    mgrs = bg.managers(nb, "cpu")
    offs = bg.region_offsets(mgrs)
    regions = [r for m in mgrs.values() for r in m.memory_regions()]
    rng = np.random.default_rng(tokens)
    blk = {n: rng.choice(nb + 8, nb, replace=False).astype(np.int32) for n in mgrs}
    for case, dsts in (("identical", ["decode"]), ("tp", ["rank0", "rank1"])):
        plans = []
        for dn in dsts:
            p = plan_transfer(mgrs["prefill"].layout, {0: blk["prefill"]}, mgrs[dn].layout, {0: blk[dn]})
            plans.append(TransferPlan(bg.shift(p.src, offs["prefill"]), bg.shift(p.dst, offs[dn])))
        junk = np.ones(64 << 20, np.uint8)
        for cold in (False, True):
            ts = []
            for _ in range(15):
                if cold:
                    junk += 1
                t0 = time.perf_counter()
                for p in plans:
                    p.validate(regions, regions)
                ts.append((time.perf_counter() - t0) * 1e6)
            print(case, len(plans), len(plans[0]), "cold" if cold else "warm", "validate us", round(statistics.median(ts)))
            # pack like _launch_part
            ts = []
            stage = np.empty(8 << 20, np.uint8)
            for _ in range(15):
                if cold:
                    junk += 1
                t0 = time.perf_counter()
                for p in plans:
                    n = len(p)
                    for a, b in ((0, min(n, 8192)), (8192, min(n, 8192 + 32768)), (40960, n)):
                        if a >= n: break
                        sl = slice(a, b); k = b - a
                        s, d, nby, reg, loc = p.src.addr[sl], p.dst.addr[sl], p.src.nbytes[sl], p.dst.region[sl], p.src.region[sl]
                        u = int(nby.min()) == int(nby.max()); o = int(reg.min()) == int(reg.max()); l = int(loc.min()) == int(loc.max())
                        np.copyto(stage[:8*k].view(np.uint64), s)
                        np.copyto(stage[8*k+8:16*k+8].view(np.uint64), d)
                        np.copyto(stage[16*k+16:16*k+20].view(np.uint32), nby[:1], casting="unsafe")
                ts.append((time.perf_counter() - t0) * 1e6)
            print(case, "cold" if cold else "warm", "pack us", round(statistics.median(ts)))
