#!/usr/bin/env bash
# Issue 17 profile on the lent H200: the post path's steps in one process, bench_gpu with cuda_ipc alone
# in its processes, and bench e2e (1B shape) with its control split, sampled by py-spy (carried in
# .devwheels/extra). Usage: bash scripts/device_profile.sh   (OUT=... for the results folder)
source scripts/device_setup.sh
SPY=/tmp/site_extra/bin/py-spy
record_env
cat "$OUT/env.txt"
echo "=== post probe"
timeout 90 python3 scripts/device_post_probe.py "$OUT/post_probe.json" 2>&1 | tail -14
echo "=== bench_gpu cuda_ipc alone"
timeout 200 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 5 --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -14
echo "=== bench e2e 1B, control split, under py-spy"
PYTHONPATH=$BOTH timeout 240 $SPY record --subprocesses --threads --format raw -r 200 -o "$OUT/e2e_1b.spy" -- \
  python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b --lengths 1024,4096,16384 \
  --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | grep -v "NIXL INFO" | tail -8
ls -la "$OUT"
