#!/usr/bin/env bash
# Issue 17, device run 62 (after run 61): what "done" still needs, in one call, on any card (ask for nvidia-h200).
# 1. The demo on a cold Triton cache: the copier's warm-up now compiles every kernel variant; is run 61's
#    one-time ~88 ms at the start of the demo's second wave gone?
# 2. Every `pytest -m gpu` test on the final tree (the warm-up change has not run on a GPU).
# 3. On an H200 only, bench_gpu cuda_ipc (goal 1; run 60 has this kernel's figures on an H100).
# 4. bench e2e 1B at 4k x7 (goal 5) in the time left.
# On an H200, follow on the warm machine with: SKIP_BENCH=1 bash scripts/device_run60b.sh.
# Usage: OUT=$OUT [LIMIT=seconds, default 590] bash scripts/device_run62.sh  (each step runs only with time left)
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
LIMIT=${LIMIT:-590}
demo_cuda demo_cuda --checksum full
python3 -c "import json; d = json.load(open('$OUT/demo_cuda.json')); print('ttft ms', [round(r['ttft_ms'], 1) for r in d['rows']])"
pytest_gpu $(( LIMIT - SECONDS < 330 ? LIMIT - SECONDS : 330 ))
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "$SECONDS" -lt $(( LIMIT - 100 )) ]; then
  bench_cuda_ipc $(( LIMIT - SECONDS < 110 ? LIMIT - SECONDS : 110 ))
fi
if [ "$SECONDS" -lt $(( LIMIT - 90 )) ]; then e2e_1b 4096 7 $(( LIMIT - SECONDS )); fi
echo "done at ${SECONDS}s"
