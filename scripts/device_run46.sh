#!/usr/bin/env bash
# Issue 17, device run 46: every `pytest -m gpu` test, verbose, each bounded (run 45's whole-tree run stopped
# at its 280 s limit after 20 tests): names, durations and the stack of any test past 90 s.
# Usage: OUT=$OUT bash scripts/device_run46.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
echo "=== pytest -m gpu (whole tree, verbose)"
PYTHONPATH=$BOTH timeout 520 python3 -m pytest -m gpu -v -ra --timeout 90 --durations 20 -p no:cacheprovider tests/ \
  2>&1 | filter > "$OUT/pytest_gpu.txt"; grep -E "PASSED|FAILED|ERROR|SKIPPED|Timeout|passed|failed" "$OUT/pytest_gpu.txt" | tail -60
tail -40 "$OUT/pytest_gpu.txt"
