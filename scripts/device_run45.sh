#!/usr/bin/env bash
# Issue 17, device run 45 (one call, < 10 min): prepared copies launch through arguments bound once (_BoundLaunch).
# bench_gpu cuda_ipc (columns interleaved); the prepared post's stage probe and kernel sweep; every
# `pytest -m gpu` test.
# Usage: OUT=$OUT bash scripts/device_run45.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
bench_cuda_ipc 130
prep_stages 150
echo "=== pytest -m gpu (whole tree)"
PYTHONPATH=$BOTH timeout 280 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter \
  > "$OUT/pytest_gpu.txt"; tail -8 "$OUT/pytest_gpu.txt"
