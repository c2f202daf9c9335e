#!/usr/bin/env bash
# The whole GPU check in one device call: environment, `pytest -m gpu`, and the GPU benchmarks.
# Usage on the lent machine (carry .devwheels): bash scripts/device_run.sh [quick]
source scripts/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BOTH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m;
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "=== pytest -m gpu"
PYTHONPATH=$BOTH timeout 240 python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" | grep -v "NIXL INFO" | tail -40
[ "${1:-}" = quick ] && exit 0
echo "=== bench_gpu cuda_ipc"
timeout 150 python3 benchmarks/bench_gpu.py --backend cuda_ipc --json "$OUT/gpu_cuda_ipc.json" 2>&1 | grep -v "NIXL INFO" | tail -12
echo "=== bench_gpu nixl"
UCX_LOG_LEVEL=error PYTHONPATH=$PYTHONPATH:/tmp/site_nixl timeout 200 python3 benchmarks/bench_gpu.py --backend nixl --iters 3 --json "$OUT/gpu_nixl.json" 2>&1 | grep -v "NIXL INFO" | tail -12
echo "=== bench_gpu ucx"
PYTHONPATH=$PYTHONPATH:/tmp/site_ucxx timeout 120 python3 benchmarks/bench_gpu.py --backend ucx --iters 2 --max-descriptors 20000 --json "$OUT/gpu_ucx.json" 2>&1 | tail -12
echo "=== bench_tiers cuda"
timeout 60 python3 benchmarks/bench_tiers.py --device cuda:0 --out "$OUT/tiers_cuda.json" 2>&1 | tail -15
