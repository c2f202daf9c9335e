#!/usr/bin/env bash
# Issue 17, device run 38 (one call, < 10 min): the tree with NIXL's prepared requests and cuda_ipc's stream
# query after the launch. Every `pytest -m gpu` test of the tree first, then bench_gpu cuda_ipc (4k, 32k) and
# nixl (+ nixl_prep) against raw NIXL with 11 timed iterations a case (run 37's 5 were noisy).
# Usage: OUT=$OUT bash scripts/device_run38.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== pytest -m gpu (whole tree)"
PYTHONPATH=$BOTH timeout 290 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter \
  > "$OUT/pytest_gpu.txt"; tail -6 "$OUT/pytest_gpu.txt"
echo "=== bench_gpu cuda_ipc (+ cuda_ipc_blocks, cuda_ipc_prep)"
PYTHONPATH=$BOTH timeout 110 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 9 --latency-iters 200 \
  --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"; tail -16 "$OUT/bench_gpu.txt"
echo "=== bench_gpu nixl (+ nixl_prep) vs raw NIXL"
KVXFER_NIXL_THREADS=8 PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-580} - SECONDS )) python3 benchmarks/bench_gpu.py \
  --backends nixl --raw-nixl --iters 11 --latency-iters 100 --json "$OUT/bench_gpu_nixl.json" 2>&1 | filter \
  > "$OUT/bench_gpu_nixl.txt"; tail -14 "$OUT/bench_gpu_nixl.txt"
