#!/usr/bin/env bash
# Issue 17, device run 44 (one call, < 10 min): the copy kernels in run-major program order (1-D grid).
# bench_gpu cuda_ipc (columns interleaved); the prepared post's stage probe with the host cost of each CUDA
# call and the kernel sweep (program order A/B against copy_); the demo on cuda:0.
# Usage: OUT=$OUT bash scripts/device_run44.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
bench_cuda_ipc 130
prep_stages 200
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
