#!/usr/bin/env bash
# Issue 17, H200 run 13 (< ~6 min): kernels launched by cuLaunchKernel (driver launch) - the GPU transport
# tests, a mutation of the driver launch (its warm-up must catch it and fall back, its test must fail),
# the bench-context probe (where a post's time goes inside bench_gpu's loop), bench_gpu cuda_ipc with the
# "D2D in place" column.
source scripts/device_setup.sh >/dev/null 2>&1
BUDGET_S=${BUDGET_S:-330}
left() { echo $(( BUDGET_S - SECONDS )); }
echo "=== test_transport_gpu"
PYTHONPATH=$BOTH timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transport_gpu.py 2>&1 \
  | grep -v "NIXL INFO" | tail -4
echo "=== mutation: the driver launch swaps source and destination (warm-up falls back; its test must fail)"
rm -rf /tmp/mut && mkdir /tmp/mut && cp -r kvxfer tests pyproject.toml /tmp/mut/
sed -i 's/self._pack(self._buf, 0, \*args)/self._pack(self._buf, 0, args[1], args[0], *args[2:])/' \
  /tmp/mut/kvxfer/transport/cuda_copy.py
grep -c "args\[1\], args\[0\]" /tmp/mut/kvxfer/transport/cuda_copy.py
(cd /tmp/mut && PYTHONPATH=/tmp/mut:/tmp/site_extra timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_transport_gpu.py -k "driver or odd_sizes" 2>&1 | grep -E "AssertionError|passed|failed" | tail -4)
echo "=== bench context probe ($(left) s left)"
timeout 120 python3 scripts/device_bench_context.py "$OUT/bench_context.json" 2>&1 | tail -20
echo "=== bench_gpu cuda_ipc ($(left) s left)"
[ $(left) -gt 40 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 7 \
  --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -14
