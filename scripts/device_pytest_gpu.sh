#!/usr/bin/env bash
# `pytest -m gpu` on the lent H200 (every GPU test of the tree, ~4.5 min). Output also in $OUT/pytest_gpu.txt.
source scripts/device_setup.sh >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export UCX_LOG_LEVEL=error
PYTHONPATH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx timeout ${BUDGET_S:-560} python3 -m pytest -m gpu -q -ra \
  -p no:cacheprovider tests/ 2>&1 | grep -v "NIXL INFO" > "$OUT/pytest_gpu.txt"
tail -25 "$OUT/pytest_gpu.txt"
