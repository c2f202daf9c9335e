#!/usr/bin/env bash
# Issue 17, device run 52, final tree (asked for as nvidia-h200). On an H200: every `pytest -m gpu` test, then
# bench_gpu cuda_ipc and bench e2e at the Llama-3.2-1B shape. On an H100 (the tables' final-tree refresh):
# bench_gpu cuda_ipc, bench e2e 1B at 1k-32k (the baseline now computes the last logits only), bench_gpu nixl
# against raw NIXL.
# Usage: OUT=$OUT bash scripts/device_run52.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  h200_checks
else
  bench_cuda_ipc 120
  e2e_1b 1024,4096,16384,32768 5 200
  echo "=== bench_gpu nixl (+ nixl_prep) vs raw NIXL (${SECONDS}s used)"
  KVXFER_NIXL_THREADS=8 PYTHONPATH=$BOTH timeout $(( 585 - SECONDS )) python3 benchmarks/bench_gpu.py --backends nixl \
    --raw-nixl --iters 7 --latency-iters 100 --json "$OUT/bench_gpu_nixl.json" 2>&1 | filter > "$OUT/bench_gpu_nixl.txt"
  tail -14 "$OUT/bench_gpu_nixl.txt"
fi
echo "done at ${SECONDS}s"
