#!/usr/bin/env bash
# Issue 17, device run 60b (H200 only, right after run 60 on the warm machine): bench_gpu cuda_ipc with the
# new kernel steps; the 1B 4k prefill on the main thread and on a compute thread (scripts/device_prefill_probe.py);
# bench e2e 1B at 4k x7 with and without prepared writes (does prefill's engine thread preparing the write during
# the compute cost the host-bound 1B compute at 4k?).
# Usage: OUT=$OUT [SKIP_BENCH=1] bash scripts/device_run60b.sh  (SKIP_BENCH: run 60 on this machine already ran bench_gpu)
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: stopping"; exit 0; }
[ -n "$SKIP_BENCH" ] || bench_cuda_ipc 110
echo "=== 1B 4k prefill, main thread against a compute thread (${SECONDS}s used)"
PYTHONPATH=$BOTH timeout 90 python3 scripts/device_prefill_probe.py "$OUT/prefill_probe.json" 4096 9 2>&1 | filter | tail -3
e2e_1b 4096 7 $(( (585 - SECONDS) / 2 ))
e2e_1b 4096 7 $(( 585 - SECONDS )) e2e_1b_noprep --no-prepare-writes
echo "done at ${SECONDS}s"
