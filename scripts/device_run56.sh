#!/usr/bin/env bash
# Issue 17, device run 56: every `pytest -m gpu` test on the final tree (run 51's tree predates the reference
# model's in-place attention), whatever card comes.
# Usage: OUT=$OUT bash scripts/device_run56.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
pytest_gpu 290
echo "done at ${SECONDS}s"
