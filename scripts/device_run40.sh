#!/usr/bin/env bash
# Issue 17, device run 40 (one call, < 10 min): cuda_ipc launches without the model-stream wait when that
# stream is idle at post. bench_gpu cuda_ipc (columns interleaved), every `pytest -m gpu` test, the demo.
# Usage: OUT=$OUT bash scripts/device_run40.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== bench_gpu cuda_ipc (+ cuda_ipc_blocks, cuda_ipc_prep)"
PYTHONPATH=$BOTH timeout 120 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 9 --latency-iters 200 \
  --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"; tail -16 "$OUT/bench_gpu.txt"
echo "=== pytest -m gpu (whole tree)"
PYTHONPATH=$BOTH timeout 300 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter \
  > "$OUT/pytest_gpu.txt"; tail -6 "$OUT/pytest_gpu.txt"
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
