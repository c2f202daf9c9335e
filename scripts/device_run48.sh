#!/usr/bin/env bash
# Issue 17, device run 48: bench e2e at 4k only (the Llama-3-8B shape at 16k does not fit two processes on an
# 80 GB card: run 47), more iterations: is the TTFT ratio above 1.05 at 4k prefill's variation or kvxfer's?
# Usage: OUT=$OUT bash scripts/device_run48.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== bench e2e 8B 4k"
PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 4096 --iters 5 --out "$OUT/e2e_8b_4k.json" 2>&1 | filter | tail -3
echo "=== bench e2e 1B 4k"
PYTHONPATH=$BOTH timeout 100 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 4096 --iters 9 --out "$OUT/e2e_1b_4k.json" 2>&1 | filter | tail -3
