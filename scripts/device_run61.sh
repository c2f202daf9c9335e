#!/usr/bin/env bash
# Issue 17, device run 61: what "done" needs from an H200 in one call when the session's device time is short: every `pytest -m gpu` test on the final tree, bench_gpu cuda_ipc
# with the whole-piece load steps (goal 1), then bench e2e 1B at 4k x7 (goal 5) in the time left.
# On any other card it runs goal 5's e2e rows and the demo instead (below).
# On an H200, follow on the warm machine with: SKIP_BENCH=1 bash scripts/device_run60b.sh (prefill probe, e2e without prepared writes).
# Usage: OUT=$OUT [LIMIT=seconds, default 590] bash scripts/device_run61.sh  (each step runs only with enough time left before LIMIT)
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
LIMIT=${LIMIT:-590}
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  # Any other card: goal 5 and the demo on the final tree (the bandwidth, overhead and pytest figures of run 60
  # are already of this tree's code).
  echo "not an H200: e2e 1B 4k x7, e2e 8B 4k x5, demo cuda:0"
  e2e_1b 4096 7 $(( (LIMIT - SECONDS) / 2 ))
  if [ "$SECONDS" -lt $(( LIMIT - 240 )) ]; then e2e_1b 4096 5 $(( LIMIT - 60 - SECONDS )) e2e_8b --model llama-3-8b; fi
  demo_cuda demo_cuda --checksum full
  echo "done at ${SECONDS}s"; exit 0
fi
pytest_gpu $(( LIMIT - SECONDS < 330 ? LIMIT - SECONDS : 330 ))
if [ "$SECONDS" -lt $(( LIMIT - 100 )) ]; then bench_cuda_ipc $(( LIMIT - SECONDS < 110 ? LIMIT - SECONDS : 110 )); fi
if [ "$SECONDS" -lt $(( LIMIT - 90 )) ]; then e2e_1b 4096 7 $(( LIMIT - SECONDS )); fi
echo "done at ${SECONDS}s"
