#!/usr/bin/env bash
# Issue 17, H200 run 12 (< ~5 min): the cuda_ipc GPU conformance and kernel tests (bounds on the device,
# large hostile plans), a mutation of the kernel's bounds check that its test must catch, the workers'
# GPU tests (examples, demo, the 1B transformers shape), bench_gpu (cuda_ipc), the post-path stamps,
# then the rest of `pytest -m gpu` while BUDGET_S (300 s) lasts.
source scripts/device_setup.sh >/dev/null 2>&1
BUDGET_S=${BUDGET_S:-300}
left() { echo $(( BUDGET_S - SECONDS )); }
echo "=== test_transport_gpu (cuda_ipc and the kernel)"
PYTHONPATH=$BOTH timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_transport_gpu.py \
  -k "cuda_ipc or kernel or few_runs" 2>&1 | grep -v "NIXL INFO" | tail -4
echo "=== mutation: the kernel copies runs outside their regions (its test must fail)"
rm -rf /tmp/mut && mkdir /tmp/mut && cp -r kvxfer tests pyproject.toml /tmp/mut/
sed -i '/n = tl.where(inside, n, start)/d' /tmp/mut/kvxfer/transport/cuda_copy.py
grep -c "tl.where(inside" /tmp/mut/kvxfer/transport/cuda_copy.py   # 0: the check is gone
(cd /tmp/mut && PYTHONPATH=/tmp/mut:/tmp/site_extra timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_transport_gpu.py -k "no_run_outside" 2>&1 | grep -E "wrong bytes|passed|failed" | tail -3)
echo "=== workers on the GPU: examples, demo, 1B shape ($(left) s left)"
PYTHONPATH=$BOTH timeout $(( $(left) - 60 )) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_examples.py \
  tests/test_hf.py 2>&1 | grep -v "NIXL INFO" | tail -4
echo "=== bench_gpu cuda_ipc alone ($(left) s left)"
[ $(left) -gt 40 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 5 \
  --json "$OUT/gpu_cuda_ipc.json" 2>&1 | tail -14
echo "=== post stamps ($(left) s left)"
[ $(left) -gt 35 ] && timeout $(( $(left) - 5 )) python3 scripts/device_post_stamps.py "$OUT/post_stamps.json" 2>&1 | tail -10
echo "=== pytest -m gpu, the rest ($(left) s left)"
if [ $(left) -gt 30 ]; then
  PYTHONPATH=$BOTH timeout $(left) python3 -m pytest -m gpu -q -ra -p no:cacheprovider tests/ \
    --ignore=tests/test_transport_gpu.py --ignore=tests/test_examples.py --ignore=tests/test_hf.py 2>&1 \
    | grep -v "NIXL INFO" > "$OUT/pytest_gpu_rest.txt"
  tail -5 "$OUT/pytest_gpu_rest.txt"
fi
