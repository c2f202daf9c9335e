#!/usr/bin/env bash
# Issue 17, H200 run 28: does the GIL switch interval (0.5 ms, kvxfer serve's default since run 23) slow the
# prefill process's compute? bench e2e 8B at 4k, 4 iterations, at 5 ms then 0.5 ms.
source scripts/device_setup.sh >/dev/null 2>&1
for si in 5 0.5; do
echo "=== bench e2e 8B 4k, switch interval $si ms"
PYTHONPATH=$BOTH timeout 110 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 4096 --iters 4 --switch-interval-ms $si --out "$OUT/e2e_8b_si$si.json" 2>&1 | grep -v "NIXL INFO" | tail -1
done
