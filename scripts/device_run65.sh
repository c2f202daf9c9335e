#!/usr/bin/env bash
# Issue 17, device run 65 (H200, after run 64's pytest -m gpu, bench_gpu cuda_ipc and bench e2e 1B): the
# tables run 64 did not cover on the H200.
# 1. bench_gpu nixl (+ nixl_prep) against raw NIXL through its own agent with prepared lists (goal 3).
# 2. bench e2e at the Llama-3-8B shape, 4k and 16k, 5 iterations (goal 5 at the second shape).
# Usage: OUT=$OUT [LIMIT=seconds, default 420] bash scripts/device_run65.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
LIMIT=${LIMIT:-420}
bench_nixl bench_gpu_nixl 200 --iters 7 --latency-iters 100
echo "=== bench e2e 8B (${SECONDS}s used)"
PYTHONPATH=$BOTH timeout $(( LIMIT - SECONDS )) python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc \
  --model llama-3-8b --lengths 4096,16384 --iters 5 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -6
echo "done at ${SECONDS}s"
