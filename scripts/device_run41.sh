#!/usr/bin/env bash
# Issue 17, device run 41 (the session's last device minutes): bench e2e at the Llama-3-8B shape (4k, 16k) and
# the Llama-3.2-1B shape at 32k on the final tree (prepared writes on).
# Usage: OUT=$OUT bash scripts/device_run41.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== bench e2e 8B (prep)"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 4096,16384 --iters 3 --out "$OUT/e2e_8b_prep.json" 2>&1 | filter | tail -4
echo "=== bench e2e 1B 32k (prep)"
PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-320} - SECONDS )) python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc \
  --model llama-3.2-1b --lengths 32768 --iters 3 --out "$OUT/e2e_1b_32k_prep.json" 2>&1 | filter | tail -3
