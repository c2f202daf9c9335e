"""End-to-end benchmark: TTFT and decode-side KV arrival, disaggregated vs one process, push and
push layer-wise; writes benchmarks/results/e2e-<date>.json. Pass prompt lengths as the first argument
(default 1024,4096; the full matrix is 1024,2048,4096,8192,16384,32768)."""

from __future__ import annotations

import datetime
import json
import pathlib
import sys

from kvxfer.cli.bench_e2e import print_table, run


def main() -> int:
    lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096").split(",")]
    results = [run(lengths, "auto", "push", layerwise, iters=2, chunk=1024) for layerwise in (False, True)]
    for r in results:
        print_table(r)
        print()
    out = pathlib.Path(__file__).parent / "results" / f"e2e-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
