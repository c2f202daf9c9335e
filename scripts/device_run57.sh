#!/usr/bin/env bash
# Issue 17, device run 57 (asked for as nvidia-h200): every `pytest -m gpu` test on the final tree, whatever card
# comes (the transformers 1B test now under its own 240 s bound), then the demo on cuda:0. On an H200 also
# bench_gpu cuda_ipc and bench e2e 1B at 4k and 16k.
# Usage: OUT=$OUT bash scripts/device_run57.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
pytest_gpu 300
echo "=== demo cuda (${SECONDS}s used)"
demo_cuda demo_cuda --checksum full
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: done at ${SECONDS}s"; exit 0; }
bench_cuda_ipc 110
e2e_1b 4096,16384 3 $(( 585 - SECONDS ))
echo "done at ${SECONDS}s"
