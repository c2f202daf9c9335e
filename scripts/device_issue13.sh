#!/usr/bin/env bash
# Issue 13 on the lent H200 (run from the repository root after `source scripts/device_setup.sh`):
#   bash scripts/device_issue13.sh   # bench_gpu (cuda_ipc, nixl, raw NIXL), the kernel probe against D2D,
#                                    # kernel + conformance tests, bench e2e at the Llama-3.2-1B shape
# E2E_MODEL=llama-3-8b E2E_LENGTHS=1024,4096 runs the TTFT benchmark at the Llama-3-8B shape instead.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NIXL=$PYTHONPATH:/tmp/site_nixl
export UCX_LOG_LEVEL=error KVXFER_NIXL_THREADS=${KVXFER_NIXL_THREADS:-8}
filter() { grep -v "NIXL INFO"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, torch.version.cuda, "triton", triton.__version__)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "=== bench_gpu"
PYTHONPATH=$NIXL timeout 150 python3 benchmarks/bench_gpu.py --backends cuda_ipc nixl --raw-nixl --iters 5 \
  --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"; tail -16 "$OUT/bench_gpu.txt"
echo "=== kernel probe"
timeout 45 python3 scripts/device_kernel_probe.py "$OUT/kernel_probe.json" 2>&1 | tail -4
echo "=== pytest (kernel + cuda_ipc and nixl conformance)"
PYTHONPATH=$NIXL timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_transport_gpu.py -k "kernel or cuda_ipc or nixl" 2>&1 | filter | tail -6 | tee "$OUT/pytest_gpu.txt"
echo "=== bench e2e"
timeout 80 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model ${E2E_MODEL:-llama-3.2-1b} \
  --lengths ${E2E_LENGTHS:-1024,4096,16384} --iters 2 --out "$OUT/e2e.json" 2>&1 | tail -5
