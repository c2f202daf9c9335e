#!/usr/bin/env bash
# Issue 17, H200 run 27: the TTFT ratio with more samples (the compute itself varies by up to ~15% between
# iterations): bench e2e 1B at 4k and 16k, 7 iterations; 8B at 4k, 5 iterations.
source scripts/device_setup.sh >/dev/null 2>&1
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 4096,16384 --iters 7 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -3
echo "=== bench e2e 8B"
PYTHONPATH=$BOTH timeout 120 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 4096 --iters 5 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -2
