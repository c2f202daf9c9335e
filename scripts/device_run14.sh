#!/usr/bin/env bash
# Issue 17, H200 run 14 (< 10 min): driver launch + driver events. The GPU transport tests, a mutation
# (the copy no longer waits for the model's stream: its test must fail), bench_gpu cuda_ipc, the demo on
# cuda:0, bench e2e (1B shape, 4k and 32k tokens), then the rest of `pytest -m gpu` in what is left.
source scripts/device_setup.sh >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BOTH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx
export UCX_LOG_LEVEL=error
BUDGET_S=${BUDGET_S:-570}
left() { echo $(( BUDGET_S - SECONDS )); }
filter() { grep -v "NIXL INFO"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c 'import torch, triton; print("torch", torch.__version__, torch.version.cuda, "triton", triton.__version__)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "=== test_transport_gpu"
PYTHONPATH=$BOTH timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_transport_gpu.py 2>&1 | filter | tail -6
echo "=== mutation: the copy does not wait for the model's stream (its test must fail)"
rm -rf /tmp/mut && mkdir /tmp/mut && cp -r kvxfer tests pyproject.toml /tmp/mut/
sed -i 's/            if not model_idle:   # pages written/            if False:   # pages written/' /tmp/mut/kvxfer/transport/cuda_copy.py
grep -c "if False:   # pages written" /tmp/mut/kvxfer/transport/cuda_copy.py
(cd /tmp/mut && PYTHONPATH=/tmp/mut:/tmp/site_extra timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_transport_gpu.py -k "models_stream" 2>&1 | grep -E "^E .*Error|passed|failed" | tail -4)
echo "=== bench_gpu cuda_ipc ($(left) s left)"
timeout 100 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 7 --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -14
echo "=== demo cuda ($(left) s left)"
PYTHONPATH=$BOTH timeout 60 python3 -m kvxfer demo --device cuda:0 --backend cuda_ipc --checksum full --json > "$OUT/demo_cuda.json" 2> "$OUT/demo_cuda.err"
echo "demo exit $?"; python3 -c "import json; d=json.load(open('$OUT/demo_cuda.json')); print({k: d[k] for k in ('requests','mismatches','kv_mismatches','failed','ttft_ms_p50')}); print('transfer_ms per request:', [round(r['transfer_ms'], 3) for r in d['rows']])" || tail -5 "$OUT/demo_cuda.err"
echo "=== bench e2e 1B ($(left) s left)"
PYTHONPATH=$BOTH timeout 110 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 4096,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
echo "=== pytest -m gpu, the rest ($(left) s left)"
PYTHONPATH=$BOTH timeout $(left) python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ \
  --ignore=tests/test_transport_gpu.py 2>&1 | filter > "$OUT/pytest_gpu_rest.txt"
tail -8 "$OUT/pytest_gpu_rest.txt"
