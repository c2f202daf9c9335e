#!/usr/bin/env bash
# Issue 17, H200 run 26: a second sample of the final tree's goal-5 figures (bench e2e, 1B at 4 lengths and
# 8B at 1k/4k, 3 iterations each).
source scripts/device_setup.sh >/dev/null 2>&1
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
echo "=== bench e2e 8B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 1024,4096 --iters 3 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -3
