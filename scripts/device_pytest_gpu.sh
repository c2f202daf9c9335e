#!/usr/bin/env bash
# The demo on cuda:0, then `pytest -m gpu` on the lent H200 (every GPU test of the tree, ~4.5 min). Output
# also in $OUT/demo_cuda.json and $OUT/pytest_gpu.txt.
source scripts/device_setup.sh >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export UCX_LOG_LEVEL=error
echo "=== demo cuda"
PYTHONPATH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx timeout 60 python3 -m kvxfer demo --device cuda:0 --backend cuda_ipc \
  --checksum full --json > "$OUT/demo_cuda.json" 2> "$OUT/demo_cuda.err"
echo "demo exit $?"; python3 -c "import json; d=json.load(open('$OUT/demo_cuda.json')); print({k: d[k] for k in ('requests','mismatches','kv_mismatches','failed','ttft_ms_p50')}); print('transfer_ms per request:', [round(r['transfer_ms'], 3) for r in d['rows']])" || tail -5 "$OUT/demo_cuda.err"
echo "=== pytest -m gpu"
PYTHONPATH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx timeout $(( ${BUDGET_S:-570} - SECONDS )) python3 -m pytest -m gpu -q -ra \
  -p no:cacheprovider tests/ 2>&1 | grep -v "NIXL INFO" > "$OUT/pytest_gpu.txt"
tail -25 "$OUT/pytest_gpu.txt"
