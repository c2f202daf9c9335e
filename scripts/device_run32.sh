#!/usr/bin/env bash
# Issue 17, device run 32 (one call, < 10 min): prepared transfers (Transport.prepare) and block plans
# checked while they copy. The GPU transport tests first (the new paths), then bench_gpu with the
# cuda_ipc_prep and cuda_ipc_blocks columns at 4k and 32k, then every `pytest -m gpu` test of the tree.
# Usage: OUT=$OUT bash scripts/device_run32.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== pytest tests/test_transport_gpu.py"
PYTHONPATH=$BOTH timeout 150 python3 -m pytest -q -x -ra -p no:cacheprovider tests/test_transport_gpu.py 2>&1 \
  | filter > "$OUT/pytest_transport_gpu.txt"; tail -8 "$OUT/pytest_transport_gpu.txt"
echo "=== bench_gpu cuda_ipc (+ cuda_ipc_blocks, cuda_ipc_prep)"
PYTHONPATH=$BOTH timeout 200 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 9 --latency-iters 200 \
  --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"; tail -16 "$OUT/bench_gpu.txt"
echo "=== pytest -m gpu (whole tree)"
PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-570} - SECONDS )) python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
  tests/ 2>&1 | filter > "$OUT/pytest_gpu.txt"; tail -6 "$OUT/pytest_gpu.txt"
