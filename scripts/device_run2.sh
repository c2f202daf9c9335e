#!/usr/bin/env bash
# Issue 17, second device run: cuda_ipc/kernel GPU tests after the completion-path change, the post
# profile, bench_gpu cuda_ipc alone, bench e2e (1B) without a profiler. OUT=... for the results.
source scripts/device_setup.sh
echo "=== pytest gpu (transport, workers)"
PYTHONPATH=$BOTH timeout 240 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_transport_gpu.py tests/test_integrity.py tests/test_examples.py 2>&1 | filter | tail -6
echo "=== post profile"
timeout 90 python3 scripts/device_post_profile.py "$OUT/post_profile.json" 2>&1 | head -90
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 200 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
echo "=== demo cuda"
PYTHONPATH=$BOTH timeout 100 python3 -m kvxfer demo --device cuda:0 --backend cuda_ipc --checksum full --json > "$OUT/demo_cuda.json" 2> "$OUT/demo_cuda.err"
echo "demo exit $?"; python3 -c "import json; d=json.load(open('$OUT/demo_cuda.json')); print({k: d[k] for k in ('requests','mismatches','kv_mismatches','failed','ttft_ms_p50')}); print('transfer_ms per request:', [r['transfer_ms'] for r in d['rows']])" || tail -5 "$OUT/demo_cuda.err"
