#!/usr/bin/env bash
# Issue 17, H200 run 18: goal 5 on the final serving path: bench e2e at the Llama-3.2-1B and Llama-3-8B
# shapes, the stage probe at 4k (1B), the demo on cuda:0. `pytest -m gpu` runs in a second call
# (scripts/device_pytest_gpu.sh): both together pass one call's 10 minutes.
source scripts/device_setup.sh >/dev/null 2>&1
record_env
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -6
echo "=== bench e2e 8B"
PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 1024,4096 --iters 2 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -4
echo "=== traced e2e 1B 4096"
KVX_TRACE=$OUT/trace_4096 PYTHONPATH=$BOTH:$PWD/scripts/stage_trace timeout 80 python3 -m kvxfer bench e2e --device cuda:0 \
  --backend cuda_ipc --model llama-3.2-1b --lengths 4096 --iters 2 2>&1 | filter | tail -1
python3 scripts/stage_trace/merge.py "$OUT/trace_4096" 30
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
