#!/usr/bin/env bash
# Issue 17, H200 run 24: the final serving path (notices over notify_channel, settled writes finished by
# the posting thread): every GPU test, bench e2e at the Llama-3.2-1B shape (4 lengths), the stage probe
# at 4k, the demo on cuda:0 twice.
source scripts/device_setup.sh >/dev/null 2>&1
record_env
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
echo "=== traced e2e 1B 4096"
KVX_TRACE=$OUT/trace_4096 PYTHONPATH=$BOTH:$PWD/scripts/stage_trace timeout 80 python3 -m kvxfer bench e2e --device cuda:0 \
  --backend cuda_ipc --model llama-3.2-1b --lengths 4096 --iters 2 2>&1 | filter | tail -1
python3 scripts/stage_trace/merge.py "$OUT/trace_4096" 24
for i in 1 2; do
echo "=== demo cuda #$i"
demo_cuda demo_cuda_$i
done
echo "=== pytest -m gpu"
PYTHONPATH=$BOTH timeout $(( 575 - SECONDS )) python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter > "$OUT/pytest_gpu.txt"
tail -6 "$OUT/pytest_gpu.txt"
