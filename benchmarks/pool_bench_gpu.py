"""Pool several bench_gpu runs (fresh process pairs) into one comparison of two columns per case.

A bench_gpu run interleaves its columns, so within one run both columns see the same drift; between runs
they do not share a process pair, and on the GPU machines a column's own rate moves more between runs
than the two columns differ (on an H100, raw NIXL at 4k identical moved 144-351 GB/s from run to run). So
one run's ratio of medians is not the figure; this prints, per case:
- each run's ratio (median time of ``baseline`` / median time of ``column``: > 1 means ``column`` is faster),
- the ratio of the medians of all runs' iterations pooled,
- the median of the paired ratios (iteration i of ``baseline`` / iteration i of ``column``, same run).

  python benchmarks/pool_bench_gpu.py --column nixl_prep --baseline raw_nixl run1.json run2.json ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PooledCase:
    """One case's comparison over runs: ratios > 1 mean the column is faster than the baseline."""

    tokens: int
    case: str
    mode: str
    runs: tuple[float, ...]
    pooled: float
    paired: float
    iterations: int


def pool(results: list[dict[str, Any]], column: str, baseline: str) -> list[PooledCase]:
    """Each case present in every result, compared by ``baseline`` time over ``column`` time."""
    keys: list[tuple[int, str, str]] = []
    times: dict[tuple[int, str, str], list[tuple[list[float], list[float]]]] = {}
    for res in results:
        for row in res["cases"]:
            key = (int(row["tokens"]), str(row["case"]), str(row["mode"]))
            col, base = row.get(f"{column}_times_ms"), row.get(f"{baseline}_times_ms")
            if col is None or base is None:
                raise ValueError(f"case {key} of a result has no '{column}' or '{baseline}' times")
            if len(col) != len(base) or not col:
                raise ValueError(f"case {key}: {len(col)} '{column}' times against {len(base)} '{baseline}'")
            if key not in times:
                keys.append(key)
                times[key] = []
            times[key].append((col, base))
    out = []
    for key in keys:
        if len(times[key]) != len(results):
            raise ValueError(f"case {key} is in {len(times[key])} of {len(results)} results")
        cols = [t for col, _ in times[key] for t in col]
        bases = [t for _, base in times[key] for t in base]
        out.append(PooledCase(
            *key,
            runs=tuple(statistics.median(base) / statistics.median(col) for col, base in times[key]),
            pooled=statistics.median(bases) / statistics.median(cols),
            paired=statistics.median(b / c for col, base in times[key] for c, b in zip(col, base, strict=True)),
            iterations=len(cols)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_gpu --json files, one per run")
    p.add_argument("--column", default="nixl_prep", help="the column compared (default nixl_prep)")
    p.add_argument("--baseline", default="raw_nixl", help="what it is compared against (default raw_nixl)")
    p.add_argument("--json", default=None, help="write the pooled cases here")
    a = p.parse_args(argv)
    results = []
    for path in a.results:
        with open(path) as f:
            results.append(json.load(f))
    cases = pool(results, a.column, a.baseline)
    print(f"{a.column} against {a.baseline} over {len(results)} runs (> 1: {a.column} faster)")
    print(f"{'tokens':>6} {'case':>9} {'mode':>4} {'iters':>5} {'pooled':>6} {'paired':>6}  each run")
    for c in cases:
        print(f"{c.tokens:>6} {c.case:>9} {c.mode:>4} {c.iterations:>5} {c.pooled:>6.2f} {c.paired:>6.2f}  "
              + " ".join(f"{r:.2f}" for r in c.runs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"column": a.column, "baseline": a.baseline, "results": a.results,
                       "cases": [c.__dict__ for c in cases]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
