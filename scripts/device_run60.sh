#!/usr/bin/env bash
# Issue 17, device run 60 (any card; ask for nvidia-h200): the tree with whole 32 KiB load steps in the copy
# kernel (BLOCK_WORDS 8192, from the H100 sweep of run 59h) and the batch method found again. The kernel's
# constants swept back to back at 4k and 32k (old and new steps, cuMemcpyBatchAsync beside them), then every
# `pytest -m gpu` test, then bench_gpu cuda_ipc if the time allows. On an H200, follow with scripts/device_run60b.sh on the warm machine.
# Usage: OUT=$OUT [H200_ONLY=1] bash scripts/device_run60.sh  (H200_ONLY: stop at once on any other card)
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
if [ -n "$H200_ONLY" ]; then nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: stopping"; exit 0; }; fi
SWEEP_ONLY=1 prep_stages 240 | grep -v "^sweep"
python3 - "$OUT/prep_stages.txt" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("sweep "):
        r = json.loads(line[6:])
        print(r["case"], r["method"], r["chunk_kib"], r["warps"], r["words"], int(r["run_major"]),
              round(r.get("gpu_us", 0), 1), round(r.get("x_copy_", 0), 3), r.get("wrong_elements"), r.get("error", "")[:80])
PY
pytest_gpu $(( 585 - SECONDS ))
tail -3 "$OUT/pytest_gpu.txt"
if [ "$SECONDS" -lt 470 ]; then bench_cuda_ipc $(( 585 - SECONDS )); fi
echo "done at ${SECONDS}s"
