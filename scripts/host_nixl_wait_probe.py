"""Host probe for the nixl handle's wait (issue 17, goal 3): two NIXL agents in this process over host
memory, one prepared write of COUNT pages of PAGE bytes, posted and waited for ITERS times under each wait
policy (alternating), against raw NIXL's tight ``check_xfer_state`` loop on the same agent and request.
Every iteration's bytes are checked. Prints medians (us) and writes JSON.

Usage: python scripts/host_nixl_wait_probe.py OUT.json [COUNT=128] [PAGE=65536] [ITERS=41]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvxfer.cache.memory import MemoryRegion
from kvxfer.pagetable import PageTable, TransferPlan
from kvxfer.transport import create
from kvxfer.transport import nixl as nixl_backend

PAGE_ALIGN = 4096


def aligned(n: int) -> np.ndarray:
    raw = np.zeros(n + PAGE_ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE_ALIGN
    return raw[off:off + n]


def main() -> int:
    out = sys.argv[1]
    count, page, iters = (int(a) for a in (sys.argv[2:] + ["128", "65536", "41"][len(sys.argv) - 2:])[:3])
    src, dst = aligned(count * page * 2), aligned(count * page * 2)
    src[:] = np.random.default_rng(1).integers(0, 256, src.size, dtype=np.uint8)
    a, b = create("nixl", "probe-a"), create("nixl", "probe-b")
    a.register([MemoryRegion(int(src.ctypes.data), int(src.nbytes), "cpu", 0)])
    b.register([MemoryRegion(int(dst.ctypes.data), int(dst.nbytes), "cpu", 0)])
    a.connect("probe-b", b.metadata())
    b.connect("probe-a", a.metadata())
    rng = np.random.default_rng(2)
    s_pages = rng.choice(count * 2, count, replace=False).astype(np.uint64)
    d_pages = rng.choice(count * 2, count, replace=False).astype(np.uint64)
    sizes = np.full(count, page, dtype=np.uint64)
    zeros = np.zeros(count, dtype=np.uint32)
    plan = TransferPlan(PageTable(np.uint64(src.ctypes.data) + s_pages * np.uint64(page), sizes, zeros),
                        PageTable(np.uint64(dst.ctypes.data) + d_pages * np.uint64(page), sizes, zeros))
    prepared = a.prepare("write", "probe-b", plan)
    want = np.concatenate([src[int(p) * page:(int(p) + 1) * page] for p in s_pages])

    def landed() -> bool:
        got = np.concatenate([dst[int(p) * page:(int(p) + 1) * page] for p in d_pages])
        return bool(np.array_equal(got, want))

    agent: Any = a._agent  # type: ignore[attr-defined]
    raw_req = prepared.backend_state._idle[0]   # the same NIXL request kvxfer reposts

    def kvxfer_post(sleep_every_s: float) -> float:
        nixl_backend.WAIT_SLEEP_EVERY_S = sleep_every_s
        t0 = time.perf_counter()
        prepared.post().wait(10)
        return time.perf_counter() - t0

    def raw_post() -> float:
        t0 = time.perf_counter()
        agent.transfer(raw_req, b"")
        while (state := agent.check_xfer_state(raw_req)) != "DONE":
            if state == "ERR":
                raise RuntimeError("raw NIXL transfer failed")
        return time.perf_counter() - t0

    default = nixl_backend.WAIT_SLEEP_EVERY_S
    columns = {"sleep every ask (before)": lambda: kvxfer_post(0.0),
               "yield, sleep per 0.5 ms (now)": lambda: kvxfer_post(default),
               "raw NIXL tight loop": raw_post}
    times: dict[str, list[float]] = {k: [] for k in columns}
    wrong = 0
    for i in range(iters + 1):
        names = list(columns)
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            dst[:] = 0
            t = columns[name]()
            wrong += 0 if landed() else 1
            if i:   # the first round warms up
                times[name].append(t)
    nixl_backend.WAIT_SLEEP_EVERY_S = default
    prepared.release()
    a.close()
    b.close()
    medians = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    res: dict[str, Any] = {"count": count, "page": page, "iters": iters, "wrong_iterations": wrong,
           "median_us": medians,
           "times_us": {k: [x * 1e6 for x in v] for k, v in times.items()}}
    for column, us in medians.items():
        print(f"{column:>32}: {us:9.1f} us")
    print(f"{count} x {page} B, medians of {iters}; wrong iterations: {wrong}")
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
