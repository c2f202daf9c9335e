#!/usr/bin/env bash
# Issue 17 final figures on the lent H200, one call (< 10 min): the post path's stamps, bench_gpu (cuda_ipc
# alone), bench e2e at the Llama-3.2-1B shape (and Llama-3-8B with WITH_8B=1), the demo on cuda:0, then `pytest -m gpu` in the time left of BUDGET_S (585 s).
# Every output is also written under $OUT. Usage: bash scripts/device_final.sh
source scripts/device_setup.sh
record_env
cat "$OUT/env.txt"
echo "=== post stamps"
timeout 90 python3 scripts/device_post_stamps.py "$OUT/post_stamps.json" 2>&1 | tail -12
echo "=== bench_gpu cuda_ipc alone"
timeout 100 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 5 --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -14
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -5
if [ -n "$WITH_8B" ]; then
echo "=== bench e2e 8B"
PYTHONPATH=$BOTH timeout 130 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 1024,4096 --iters 2 --out "$OUT/e2e_8b.json" 2>&1 | filter | tail -4
fi
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
echo "=== pytest -m gpu"
PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-585} - SECONDS )) python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter > "$OUT/pytest_gpu.txt"
tail -25 "$OUT/pytest_gpu.txt"
