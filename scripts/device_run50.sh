#!/usr/bin/env bash
# Issue 17, device run 50 (the session's last device minutes): tests/test_transport_gpu.py on the final tree
# (after a rename in cuda_copy made after run 46's whole-tree GPU run).
# Usage: OUT=$OUT bash scripts/device_run50.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
PYTHONPATH=$BOTH timeout 170 python3 -m pytest -m gpu -q -ra --timeout 60 -p no:cacheprovider \
  tests/test_transport_gpu.py 2>&1 | filter > "$OUT/pytest_transport_gpu.txt"; tail -4 "$OUT/pytest_transport_gpu.txt"
