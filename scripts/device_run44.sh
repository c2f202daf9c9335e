#!/usr/bin/env bash
# Issue 17, device run 44 (one call, < 10 min): the copy kernels in run-major program order (1-D grid).
# bench_gpu cuda_ipc (columns interleaved); the prepared post's stage probe with the host cost of each CUDA
# call and the kernel sweep (program order A/B against copy_); the demo on cuda:0.
# Usage: OUT=$OUT bash scripts/device_run44.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== bench_gpu cuda_ipc (+ cuda_ipc_blocks, cuda_ipc_prep)"
PYTHONPATH=$BOTH timeout 130 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 9 --latency-iters 200 \
  --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"; tail -16 "$OUT/bench_gpu.txt"
echo "=== prepared post stages, host calls, kernel sweep"
PYTHONPATH=$BOTH timeout 200 python3 scripts/device_prep_stages.py "$OUT/prep_stages.json" 2>&1 | filter \
  > "$OUT/prep_stages.txt"; cat "$OUT/prep_stages.txt" | tail -40
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
