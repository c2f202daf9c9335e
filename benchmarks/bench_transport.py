"""Transport benchmark matrix: 64 MiB coalesced and 4096 x 16 KiB scattered pages, read and
write, every available backend, each next to memcpy and the raw backend measured in the same run.

Every case runs ``--repeats`` times (fresh processes each time) and the table shows the median of
each figure over the repeats, because a shared machine swings a single run by 2-5x. Each run's figures
are themselves medians over ``--iters`` timed iterations, every one of them verified (destination
poisoned before, checked against the source after: see ``kvxfer.cli.bench_transport``)."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
from typing import Any

from kvxfer.cli.bench_transport import run_bench
from kvxfer.transport import available_backends

CASES = [(1024, 65536, "consecutive"), (4096, 16384, "scattered")]


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's description with every rate replaced by its median over ``runs``."""
    row = dict(runs[0])
    for key in ("gbps", "memcpy_gbps", "raw_gbps", "seconds"):
        values = [r[key] for r in runs if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    row["raw_ways_gbps"] = {way: statistics.median(r["raw_ways_gbps"][way] for r in runs)
                            for way in runs[0]["raw_ways_gbps"]}
    row["verified"] = all(r["verified"] for r in runs)
    row["verified_iterations"] = sum(r["verified_iterations"] for r in runs)
    row["failed_iterations"] = sum(r["failed_iterations"] for r in runs)
    row["repeats"] = len(runs)
    row["gbps_each"] = [r["gbps"] for r in runs]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--backends", default="", help="comma-separated subset (default: every available one)")
    args = ap.parse_args(argv)
    wanted = {b for b in args.backends.split(",") if b}
    rows = []
    for backend, reason in available_backends().items():
        if wanted and backend not in wanted:
            continue
        if reason is not None:
            print(f"skip {backend}: {reason}")
            continue
        for pages, page_bytes, layout in CASES:
            for mode in ("read", "write"):
                runs = [run_bench(backend, pages, page_bytes, mode, layout, iters=args.iters)
                        for _ in range(args.repeats)]
                rows.append(_median_row(runs))
                print(f"done {backend} {mode} {layout}: {[round(r['gbps'], 3) for r in runs]} GB/s", flush=True)
    print(f"{'backend':9} {'mode':5} {'layout':11} {'MiB':>5} {'descs':>6} {'GB/s':>7} {'memcpy':>7} "
          f"{'raw':>7} {'%memcpy':>7} {'%raw':>6} ok  raw ways GB/s")
    for r in rows:
        raw = r["raw_gbps"]
        pct_raw = "-" if raw is None else f"{100 * r['gbps'] / raw:.0f}%"
        ways = " ".join(f"{k}={v:.2f}" for k, v in r["raw_ways_gbps"].items())
        print(f"{r['backend']:9} {r['mode']:5} {r['layout']:11} {r['bytes'] >> 20:>5} {r['descriptors']:>6} "
              f"{r['gbps']:>7.2f} {r['memcpy_gbps']:>7.2f} {'-' if raw is None else f'{raw:.2f}':>7} "
              f"{100 * r['gbps'] / r['memcpy_gbps']:>6.0f}% "
              f"{pct_raw:>6} {r['verified']} {ways}")
    out = pathlib.Path(__file__).parent / "results" / "transport.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.UTC).isoformat(), "repeats": args.repeats,
                               "iters": args.iters, "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
