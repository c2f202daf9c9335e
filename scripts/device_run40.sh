#!/usr/bin/env bash
# Issue 17, device run 40 (one call, < 10 min): cuda_ipc launches without the model-stream wait when that
# stream is idle at post. bench_gpu cuda_ipc (columns interleaved), every `pytest -m gpu` test, the demo.
# Usage: OUT=$OUT bash scripts/device_run40.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
bench_cuda_ipc 120
echo "=== pytest -m gpu (whole tree)"
PYTHONPATH=$BOTH timeout 300 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter \
  > "$OUT/pytest_gpu.txt"; tail -6 "$OUT/pytest_gpu.txt"
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
