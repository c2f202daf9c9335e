#!/usr/bin/env bash
# Issue 17, device run 39 (one call, < 10 min): the final tree (run 38's stream query after the launch taken
# back), bench_gpu with its columns interleaved per iteration: cuda_ipc at 4k and 32k, then nixl (+ nixl_prep)
# against raw NIXL (11 timed iterations a case); then bench e2e at the 1B shape and the demo on cuda:0.
# Usage: OUT=$OUT bash scripts/device_run39.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
bench_cuda_ipc 120
echo "=== bench_gpu nixl (+ nixl_prep) vs raw NIXL"
KVXFER_NIXL_THREADS=8 PYTHONPATH=$BOTH timeout 240 python3 benchmarks/bench_gpu.py --backends nixl --raw-nixl \
  --iters 11 --latency-iters 100 --json "$OUT/bench_gpu_nixl.json" 2>&1 | filter > "$OUT/bench_gpu_nixl.txt"
tail -14 "$OUT/bench_gpu_nixl.txt"
echo "=== bench e2e 1B (prepared writes)"
PYTHONPATH=$BOTH timeout 120 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384 --iters 5 --out "$OUT/e2e_1b_prep.json" 2>&1 | filter | tail -5
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
