#!/usr/bin/env bash
# Issue 17, device run 51: every `pytest -m gpu` test on the final tree (the ucx, pin and notification changes
# of runs 46-50 had not run on a GPU); the demo on cuda:0; bench e2e at the Llama-3-8B shape at 4k, 16k and 32k
# with the baseline computing the last logits only, each process's GPU memory sampled (16k did not fit in run 47).
# Usage: OUT=$OUT bash scripts/device_run51.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"; command -v nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control"
pytest_gpu 300
echo "=== demo cuda (${SECONDS}s used)"
demo_cuda demo_cuda --checksum full
echo "=== bench e2e 8B (${SECONDS}s used)"
with_gpu_memory mem_e2e_8b env PYTHONPATH=$BOTH timeout $(( 585 - SECONDS )) python3 -m kvxfer bench e2e \
  --device cuda:0 --backend cuda_ipc --model llama-3-8b --lengths 4096,16384,32768 --iters 3 \
  --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -6
echo "done at ${SECONDS}s"
