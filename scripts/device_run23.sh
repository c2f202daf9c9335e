#!/usr/bin/env bash
# Issue 17, H200 run 23: cuda_ipc notices over a plain TCP channel (notify_channel) instead of ZeroMQ
# PUSH/PULL: the GPU transport tests, bench e2e at the Llama-3.2-1B shape (4 lengths), the stage probe
# at 4k, and the demo on cuda:0 twice (transfers of its small requests).
source scripts/device_setup.sh >/dev/null 2>&1
record_env
echo "=== pytest tests/test_transport_gpu.py"
PYTHONPATH=$BOTH timeout 150 python3 -m pytest -q -ra -p no:cacheprovider tests/test_transport_gpu.py 2>&1 | filter | tail -4
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -6
echo "=== traced e2e 1B 4096"
KVX_TRACE=$OUT/trace_4096 PYTHONPATH=$BOTH:$PWD/scripts/stage_trace timeout 80 python3 -m kvxfer bench e2e --device cuda:0 \
  --backend cuda_ipc --model llama-3.2-1b --lengths 4096 --iters 2 2>&1 | filter | tail -1
python3 scripts/stage_trace/merge.py "$OUT/trace_4096" 30
for i in 1 2; do
echo "=== demo cuda #$i"
demo_cuda demo_cuda_$i
done
