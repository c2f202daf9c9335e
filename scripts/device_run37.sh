#!/usr/bin/env bash
# Issue 17, device run 37 (one call, < 10 min): where a prepared cuda_ipc post's time goes at 4k and 32k
# (host stamps, kernel time on the GPU against copy_'s, the kernel's constants swept), then NIXL's prepared
# requests (the nixl_prep column) against raw NIXL in the same run, then the GPU transport tests.
# Usage: OUT=$OUT bash scripts/device_run37.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== prepared post stages"
PYTHONPATH=$BOTH timeout 200 python3 scripts/device_prep_stages.py "$OUT/prep_stages.json" 2>&1 | filter \
  > "$OUT/prep_stages.txt"; grep -v "^sweep" "$OUT/prep_stages.txt" | tail -22; grep "^sweep" "$OUT/prep_stages.txt" | cut -c1-220
echo "=== bench_gpu nixl (+ nixl_prep) vs raw NIXL"
KVXFER_NIXL_THREADS=8 PYTHONPATH=$BOTH timeout 240 python3 benchmarks/bench_gpu.py --backends nixl --raw-nixl --iters 5 \
  --latency-iters 100 --json "$OUT/bench_gpu_nixl.json" 2>&1 | filter > "$OUT/bench_gpu_nixl.txt"; tail -14 "$OUT/bench_gpu_nixl.txt"
echo "=== pytest tests/test_transport_gpu.py"
PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-570} - SECONDS )) python3 -m pytest -q -ra -p no:cacheprovider \
  tests/test_transport_gpu.py 2>&1 | filter > "$OUT/pytest_transport_gpu.txt"; tail -6 "$OUT/pytest_transport_gpu.txt"
