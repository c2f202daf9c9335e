#!/usr/bin/env bash
# Issue 17, H200 run 25: the final tree (early pin with the early plan): bench e2e at the Llama-3.2-1B
# (4 lengths) and Llama-3-8B (1k, 4k) shapes, the demo on cuda:0, the GPU tests that run the workers.
source scripts/device_setup.sh >/dev/null 2>&1
record_env
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
echo "=== bench e2e 8B"
PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 1024,4096 --iters 2 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -3
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
echo "=== pytest -m gpu (the workers' GPU tests)"
PYTHONPATH=$BOTH timeout $(( 570 - SECONDS )) python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/test_examples.py tests/test_hf.py \
  tests/test_integrity.py 2>&1 | filter | tail -4
