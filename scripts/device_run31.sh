#!/usr/bin/env bash
# Issue 17, H200 run 31: block plans (BlockPlan, copy_block_runs). Part "tests": the GPU transport tests
# first (the new kernel), then every `pytest -m gpu` test of the tree. Part "bench": bench_gpu with the
# cuda_ipc_blocks column, 4k and 32k tokens. Usage: OUT=$OUT bash scripts/device_run31.sh tests|bench
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
if [ "$1" = tests ]; then
  echo "=== pytest tests/test_transport_gpu.py"
  PYTHONPATH=$BOTH timeout 200 python3 -m pytest -q -x -ra -p no:cacheprovider tests/test_transport_gpu.py 2>&1 \
    | filter > "$OUT/pytest_transport_gpu.txt"; tail -15 "$OUT/pytest_transport_gpu.txt"
  echo "=== pytest -m gpu (whole tree)"
  PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-570} - SECONDS )) python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
    tests/ 2>&1 | filter > "$OUT/pytest_gpu.txt"; tail -25 "$OUT/pytest_gpu.txt"
else
  echo "=== bench_gpu cuda_ipc (+ cuda_ipc_blocks)"
  PYTHONPATH=$BOTH timeout 540 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 7 --latency-iters 100 \
    --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"; tail -22 "$OUT/bench_gpu.txt"
fi
