#!/usr/bin/env bash
# Issue 17, device run 49 (the session's last device minutes), final tree: bench_gpu cuda_ipc, then the kernel
# sweep alone at 4k and 32k (program order A/B against copy_, the H200's case for run-major order).
# Usage: OUT=$OUT bash scripts/device_run49.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
bench_cuda_ipc 120
SWEEP_ONLY=1 prep_stages 150
