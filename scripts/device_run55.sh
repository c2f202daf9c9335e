#!/usr/bin/env bash
# Issue 17, device run 55 (asked for as nvidia-h200), final tree. On an H200: h200_checks (GPU tests, bench_gpu
# cuda_ipc, bench e2e 1B). On an H100: where the prefill worker's compute loses to the one-process run at 1k
# (47.0 against 38.1 ms in run 52): bench e2e 1B at 1k and 4k, push with the early plan prepared (default),
# push without preparing it, and pull (no early plan), 7 iterations each.
# Usage: OUT=$OUT bash scripts/device_run55.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  h200_checks
else
  for variant in push push-noprep pull push-again; do
    case $variant in
      push|push-again) opts=() ;;
      push-noprep) opts=(--no-prepare-writes) ;;
      pull) opts=(--mode pull) ;;
    esac
    echo "=== bench e2e 1B, $variant (${SECONDS}s used)"
    PYTHONPATH=$BOTH timeout 120 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc \
      --model llama-3.2-1b --lengths 1024,4096 --iters 7 "${opts[@]}" --out "$OUT/e2e_1b_$variant.json" 2>&1 \
      | filter | tail -2
  done
fi
echo "done at ${SECONDS}s"
