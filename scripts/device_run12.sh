#!/usr/bin/env bash
# Issue 17, H200 run 12 (< ~6 min): the cuda_ipc GPU conformance tests (kernel bounds on the device,
# large hostile plans), a mutation of the kernel's bounds check that its test must catch, bench_gpu
# (cuda_ipc), the post-path stamps, then the rest of `pytest -m gpu` while BUDGET_S (330 s) lasts.
source scripts/device_setup.sh >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BOTH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx
export UCX_LOG_LEVEL=error
BUDGET_S=${BUDGET_S:-330}
echo "=== test_transport_gpu"
PYTHONPATH=$BOTH timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transport_gpu.py 2>&1 | grep -v "NIXL INFO" | tail -6
echo "=== mutation: the kernel copies runs outside their regions (its test must fail)"
rm -rf /tmp/mut && mkdir /tmp/mut && cp -r kvxfer tests pyproject.toml /tmp/mut/
sed -i '/n = tl.where(inside, n, start)/d' /tmp/mut/kvxfer/transport/cuda_copy.py
grep -c "tl.where(inside" /tmp/mut/kvxfer/transport/cuda_copy.py   # 0: the check is gone
(cd /tmp/mut && PYTHONPATH=/tmp/mut:/tmp/site_extra timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_transport_gpu.py -k "no_run_outside" 2>&1 | tail -2)
echo "=== bench_gpu cuda_ipc alone"
timeout 90 python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 5 --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -14
echo "=== post stamps"
timeout 60 python3 scripts/device_post_stamps.py "$OUT/post_stamps.json" 2>&1 | tail -10
left=$(( BUDGET_S - SECONDS ))
echo "=== pytest -m gpu (the rest, $left s)"
if [ $left -gt 20 ]; then
  PYTHONPATH=$BOTH timeout $left python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ --ignore=tests/test_transport_gpu.py 2>&1 | grep -v "NIXL INFO" > "$OUT/pytest_gpu.txt"
  tail -8 "$OUT/pytest_gpu.txt"
fi
