#!/usr/bin/env bash
# Issue 17, device run 45 (one call, < 10 min): prepared copies launch through arguments bound once (_BoundLaunch).
# bench_gpu cuda_ipc (columns interleaved); the prepared post's stage probe and kernel sweep; every
# `pytest -m gpu` test.
# Usage: OUT=$OUT bash scripts/device_run45.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== bench_gpu cuda_ipc (+ cuda_ipc_blocks, cuda_ipc_prep)"
PYTHONPATH=$BOTH timeout 130 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 9 --latency-iters 200 \
  --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"; tail -16 "$OUT/bench_gpu.txt"
echo "=== prepared post stages, host calls, kernel sweep"
PYTHONPATH=$BOTH timeout 150 python3 scripts/device_prep_stages.py "$OUT/prep_stages.json" 2>&1 | filter \
  > "$OUT/prep_stages.txt"; cat "$OUT/prep_stages.txt" | tail -40
echo "=== pytest -m gpu (whole tree)"
PYTHONPATH=$BOTH timeout 280 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter \
  > "$OUT/pytest_gpu.txt"; tail -8 "$OUT/pytest_gpu.txt"
