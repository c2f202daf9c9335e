#!/usr/bin/env bash
# Issue 17, H200 runs 16-17: goal 5 after kv_posted, the early plan and tagged notices: bench e2e at the Llama-3.2-1B shape,
# the same with the stage probe (scripts/stage_trace) at 4k and 32k, and the demo on cuda:0.
source scripts/device_setup.sh >/dev/null 2>&1
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -6
for n in 4096 32768; do
echo "=== traced e2e 1B $n"
KVX_TRACE=$OUT/trace_$n PYTHONPATH=$BOTH:$PWD/scripts/stage_trace timeout 100 python3 -m kvxfer bench e2e --device cuda:0 \
  --backend cuda_ipc --model llama-3.2-1b --lengths $n --iters 2 2>&1 | filter | tail -1
python3 scripts/stage_trace/merge.py "$OUT/trace_$n" 45
done
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
