#!/usr/bin/env bash
# Issue 17, device run 61 (H200 only; stops at once on any other card): what "done" needs from an H200 in one
# call when the session's device time is short: every `pytest -m gpu` test on the final tree, bench_gpu cuda_ipc
# with the whole-piece load steps (goal 1), then bench e2e 1B at 4k x7 (goal 5) in the time left.
# Follow on the warm machine with: SKIP_BENCH=1 bash scripts/device_run60b.sh (prefill probe, e2e without prepared writes).
# Usage: OUT=$OUT [LIMIT=seconds, default 590] bash scripts/device_run61.sh  (e2e runs only with 90 s left before LIMIT)
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: stopping"; exit 0; }
pytest_gpu 330
bench_cuda_ipc 110
LIMIT=${LIMIT:-590}
if [ "$SECONDS" -lt $(( LIMIT - 90 )) ]; then e2e_1b 4096 7 $(( LIMIT - SECONDS )); fi
echo "done at ${SECONDS}s"
