#!/usr/bin/env bash
# Issue 17, device run 59 (ask for nvidia-h200): what run 58 left on the H200. The transformers GPU test under the
# new near-tie rule, then the kernel's constants swept back to back at 4k and 32k (SWEEP_ONLY; run 43 had 128 KiB
# pieces at 0.92x D2D against 0.90x for the current 32 KiB at 32k), then bench e2e 1B at 4k with 7 iterations, with and
# without prepared writes.
# Stops at once on an H100 (runs 51-57 hold the H100 figures of this tree).
# Usage: OUT=$OUT bash scripts/device_run59.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: stopping"; exit 0; }
SWEEP_ONLY=1 prep_stages 320
echo "=== pytest -m gpu tests/test_hf.py (${SECONDS}s used)"
PYTHONPATH=$BOTH timeout 150 python3 -m pytest -m gpu -v -ra -p no:cacheprovider tests/test_hf.py 2>&1 | filter \
  > "$OUT/pytest_hf.txt"; tail -3 "$OUT/pytest_hf.txt"
e2e_1b 4096 7 $(( (585 - SECONDS) / 2 ))
# The same without prepared writes: does prefill's engine thread preparing the write during the compute (GIL)
# cost the compute thread at 4k, where the 1B prefill is host-bound?
echo "=== bench e2e 1B 4k --no-prepare-writes (${SECONDS}s used)"
PYTHONPATH=$BOTH timeout $(( 585 - SECONDS )) python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc \
  --model llama-3.2-1b --lengths 4096 --iters 7 --no-prepare-writes --out "$OUT/e2e_1b_noprep.json" 2>&1 | filter | tail -4
echo "done at ${SECONDS}s"
