#!/usr/bin/env bash
# Issue 17, device run 54 (asked for as nvidia-h200), final tree. On an H200: every `pytest -m gpu` test,
# bench_gpu cuda_ipc, the demo on cuda:0, bench e2e 1B at 4k and 16k. On an H100: nothing more (runs 51-53 hold
# the H100 figures of this tree).
# Usage: OUT=$OUT bash scripts/device_run54.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: stopping"; exit 0; }
pytest_gpu 300
bench_cuda_ipc 110
echo "=== demo cuda (${SECONDS}s used)"
demo_cuda demo_cuda --checksum full
echo "=== bench e2e 1B (${SECONDS}s used)"
PYTHONPATH=$BOTH timeout $(( 585 - SECONDS )) python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc \
  --model llama-3.2-1b --lengths 4096,16384 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -4
echo "done at ${SECONDS}s"
