#!/usr/bin/env bash
# The demo on cuda:0, then `pytest -m gpu` on the lent H200 (every GPU test of the tree, ~4.5 min). Output
# also in $OUT/demo_cuda.json and $OUT/pytest_gpu.txt.
source scripts/device_setup.sh >/dev/null 2>&1
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
echo "=== pytest -m gpu"
PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-570} - SECONDS )) python3 -m pytest -m gpu -q -ra \
  -p no:cacheprovider tests/ 2>&1 | grep -v "NIXL INFO" > "$OUT/pytest_gpu.txt"
tail -25 "$OUT/pytest_gpu.txt"
