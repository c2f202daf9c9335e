#!/usr/bin/env bash
# The GPU check on the lent machine, in two calls (each under the 10-minute call limit):
#   bash scripts/device_run.sh tests    # environment, `pytest -m gpu`, the GPU examples
#   bash scripts/device_run.sh bench    # bench_gpu (cuda_ipc, nixl, raw NIXL; then ucx), bench_tiers on CUDA
#   bash scripts/device_run.sh final    # `pytest -m gpu`, the demo on cuda:0, bench e2e at the Llama-3.2-1B shape
# Carry .devwheels (made by ../shared/tools/device-wheels .devwheels plus blake3/pyzmq in .devwheels/extra).
source scripts/device_setup.sh
if [ "${1:-tests}" = final ]; then
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
    python3 -c 'import torch, transformers; print("torch", torch.__version__, torch.version.cuda, "transformers", transformers.__version__)'; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  echo "=== pytest -m gpu"
  PYTHONPATH=$BOTH timeout 300 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter | tee "$OUT/pytest_gpu.txt" | tail -40
  echo "=== kvxfer demo --device cuda:0 --backend cuda_ipc --checksum full"
  PYTHONPATH=$BOTH timeout 100 python3 -m kvxfer demo --device cuda:0 --backend cuda_ipc --checksum full --json > "$OUT/demo_cuda.json" 2> "$OUT/demo_cuda.err"
  echo "demo exit $?"; python3 -c "import json; d=json.load(open('$OUT/demo_cuda.json')); print({k: d[k] for k in ('requests','mismatches','kv_mismatches','failed','ttft_ms_p50')}); print('transfer_ms per request:', [r['transfer_ms'] for r in d['rows']])" || tail -5 "$OUT/demo_cuda.err"
  echo "=== bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b"
  PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b --lengths 1024,4096,16384 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -8
elif [ "${1:-tests}" = tests ]; then
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m;
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  echo "=== pytest -m gpu"
  PYTHONPATH=$BOTH timeout 330 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | filter | tee "$OUT/pytest_gpu.txt" | tail -30
  for b in cuda_ipc nixl ucx; do
    echo "=== examples/two_gpu_pair.py --backend $b (one GPU: both processes on cuda:0)"
    PYTHONPATH=$BOTH timeout 80 python3 examples/two_gpu_pair.py --backend $b --model small --prompt-tokens 2048 2>&1 | filter | tail -8 | tee -a "$OUT/examples_gpu.txt"
  done
else
  # cuda_ipc alone in its processes: NIXL agents' progress threads spin and take the CPU the post path needs
  echo "=== bench_gpu cuda_ipc"
  timeout 150 python3 benchmarks/bench_gpu.py --backends cuda_ipc --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -16
  echo "=== bench_gpu nixl + raw NIXL (UCX num_threads=8), one run"
  KVXFER_NIXL_THREADS=8 PYTHONPATH=$PYTHONPATH:/tmp/site_nixl timeout 250 python3 benchmarks/bench_gpu.py --backends nixl --raw-nixl --json "$OUT/gpu_nixl.json" 2>&1 | filter | tail -16
  echo "=== bench_gpu ucx (4k tokens)"
  PYTHONPATH=$PYTHONPATH:/tmp/site_ucxx timeout 120 python3 benchmarks/bench_gpu.py --backends ucx --tokens 4096 --iters 3 --latency-iters 50 --json "$OUT/gpu_ucx.json" 2>&1 | tail -12
  echo "=== bench_tiers cuda"
  timeout 90 python3 benchmarks/bench_tiers.py --device cuda:0 --out "$OUT/tiers_cuda.json" 2>&1 | tail -24
fi
