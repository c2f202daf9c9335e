#!/usr/bin/env bash
# Issue 17, H200 run 29 (< ~9 min): large plans launched in parts (the GPU copies the first part while
# the host packs the next), and bench_gpu's own-context-first harness. The GPU transport tests, a
# mutation of the parts (each part's source addresses taken from the plan's start: its tests must fail),
# the kernel probe (variants, with and without parts, one process), bench_gpu cuda_ipc at 4k and 32k
# (own context first, the default) and at 4k with the peer's context last (the old harness).
source scripts/device_setup.sh >/dev/null 2>&1
BUDGET_S=${BUDGET_S:-570}
left() { echo $(( BUDGET_S - SECONDS )); }
record_env; cat "$OUT/env.txt"
echo "=== test_transport_gpu"
PYTHONPATH=$BOTH timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_transport_gpu.py 2>&1 \
  | filter > "$OUT/pytest_transport_gpu.txt"; tail -6 "$OUT/pytest_transport_gpu.txt"
echo "=== mutation: every part's sources from the plan's start (the parts tests must fail) ($(left) s left)"
rm -rf /tmp/mut && mkdir /tmp/mut && cp -r kvxfer tests pyproject.toml /tmp/mut/
sed -i 's/used = self._launch_part(dst\[part\], src\[part\]/used = self._launch_part(dst[part], src[: stop - start]/' \
  /tmp/mut/kvxfer/transport/cuda_copy.py
grep -c "src\[: stop - start\]" /tmp/mut/kvxfer/transport/cuda_copy.py
(cd /tmp/mut && PYTHONPATH=/tmp/mut:/tmp/site_extra timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_transport_gpu.py -k "parts" 2>&1 | grep -E "^FAILED|passed|failed" | tail -8)
echo "=== kernel probe ($(left) s left)"
timeout 120 python3 scripts/device_kernel_probe.py "$OUT/kernel_probe.json" 2>&1 | tail -9
echo "=== bench_gpu cuda_ipc, own context first ($(left) s left)"
timeout $(( $(left) - 75 )) python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 7 \
  --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -14
echo "=== bench_gpu cuda_ipc 4k, peer context last ($(left) s left)"
[ $(left) -gt 30 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 7 \
  --tokens 4096 --latency-iters 50 --peer-context-last --json "$OUT/gpu_cuda_ipc_peer_last.json" 2>&1 | tail -10
