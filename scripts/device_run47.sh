#!/usr/bin/env bash
# Issue 17, device run 47 (the session's last device minutes), final tree: bench_gpu cuda_ipc; bench e2e at the
# Llama-3.2-1B shape (1k, 4k, 16k) and the Llama-3-8B shape (4k, 16k); the demo on cuda:0; then bench_gpu nixl
# against raw NIXL in what time is left.
# Usage: OUT=$OUT bash scripts/device_run47.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
bench_cuda_ipc 120
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 100 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384 --iters 5 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
echo "=== bench e2e 8B"
PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 4096,16384 --iters 3 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -4
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
echo "=== bench_gpu nixl (+ nixl_prep) vs raw NIXL (${SECONDS}s used)"
KVXFER_NIXL_THREADS=8 PYTHONPATH=$BOTH timeout $(( 560 - SECONDS )) python3 benchmarks/bench_gpu.py --backends nixl \
  --raw-nixl --iters 7 --latency-iters 100 --json "$OUT/bench_gpu_nixl.json" 2>&1 | filter > "$OUT/bench_gpu_nixl.txt"
tail -14 "$OUT/bench_gpu_nixl.txt"
