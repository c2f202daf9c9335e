#!/usr/bin/env bash
# Issue 17, H200 run 25: the final tree (early pin with the early plan): bench e2e at the Llama-3.2-1B
# (4 lengths) and Llama-3-8B (1k, 4k) shapes, the demo on cuda:0, the GPU tests that run the workers.
source scripts/device_setup.sh >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BOTH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx
export UCX_LOG_LEVEL=error
filter() { grep -v "NIXL INFO"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, torch.version.cuda, "triton", triton.__version__)'; } > "$OUT/env.txt" 2>&1
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
echo "=== bench e2e 8B"
PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 1024,4096 --iters 2 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -3
echo "=== demo cuda"
PYTHONPATH=$BOTH timeout 60 python3 -m kvxfer demo --device cuda:0 --backend cuda_ipc --checksum full --json > "$OUT/demo_cuda.json" 2> "$OUT/demo_cuda.err"
echo "demo exit $?"; python3 -c "import json; d=json.load(open('$OUT/demo_cuda.json')); print({k: d[k] for k in ('requests','mismatches','kv_mismatches','failed','ttft_ms_p50')}); print('transfer_ms per request:', [round(r['transfer_ms'], 3) for r in d['rows']])" || tail -5 "$OUT/demo_cuda.err"
echo "=== pytest -m gpu (the workers' GPU tests)"
PYTHONPATH=$BOTH timeout $(( 570 - SECONDS )) python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/test_examples.py tests/test_hf.py \
  tests/test_integrity.py 2>&1 | filter | tail -4
