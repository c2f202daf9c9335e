"""Transport benchmark matrix (issue 6): 64 MiB coalesced and 4096 x 16 KiB scattered pages, read and
write, every available backend, each next to memcpy and the raw backend measured in the same run."""

from __future__ import annotations

import datetime
import json
import pathlib
import sys

from kvxfer.transport import available_backends
from kvxfer.transport.bench import run_bench

CASES = [(1024, 65536, "consecutive"), (4096, 16384, "scattered")]


def main() -> int:
    rows = []
    for backend, reason in available_backends().items():
        if reason is not None:
            print(f"skip {backend}: {reason}")
            continue
        for pages, page_bytes, layout in CASES:
            for mode in ("read", "write"):
                rows.append(run_bench(backend, pages, page_bytes, mode, layout, iters=5))
    print(f"{'backend':9} {'mode':5} {'layout':11} {'MiB':>5} {'descs':>6} {'GB/s':>7} {'memcpy':>7} "
          f"{'raw':>7} {'%memcpy':>7} {'%raw':>6} ok")
    for r in rows:
        raw = r["raw_gbps"]
        pct_raw = "-" if raw is None else f"{100 * r['gbps'] / raw:.0f}%"
        print(f"{r['backend']:9} {r['mode']:5} {r['layout']:11} {r['bytes'] >> 20:>5} {r['descriptors']:>6} "
              f"{r['gbps']:>7.2f} {r['memcpy_gbps']:>7.2f} {'-' if raw is None else f'{raw:.2f}':>7} "
              f"{100 * r['gbps'] / r['memcpy_gbps']:>6.0f}% "
              f"{pct_raw:>6} {r['verified']}")
    out = pathlib.Path(__file__).parent / "results" / "transport.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.UTC).isoformat(), "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
