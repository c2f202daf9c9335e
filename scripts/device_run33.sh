#!/usr/bin/env bash
# Issue 17, device run 33 (one call, < 10 min): prefill posts its early plan prepared (Transport.prepare while
# the model computes). bench e2e at the Llama-3.2-1B shape with and without it (--no-prepare-writes), same
# machine, then 8B at 4k, the demo on cuda:0, and the GPU tests that run the workers.
# Usage: OUT=$OUT bash scripts/device_run33.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
for v in prep plain; do
  flag=$([ $v = plain ] && echo --no-prepare-writes)
  echo "=== bench e2e 1B ($v)"
  PYTHONPATH=$BOTH timeout 150 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
    --lengths 1024,4096,16384 --iters 5 $flag --out "$OUT/e2e_1b_$v.json" 2>&1 | filter | tail -5
done
echo "=== bench e2e 8B (prep)"
PYTHONPATH=$BOTH timeout 100 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3-8b \
  --lengths 4096 --iters 3 --out "$OUT/e2e_8b_prep.json" 2>&1 | filter | tail -3
echo "=== demo cuda"
demo_cuda demo_cuda --checksum full
echo "=== pytest -m gpu (the workers' GPU tests)"
PYTHONPATH=$BOTH timeout $(( ${BUDGET_S:-560} - SECONDS )) python3 -m pytest -m gpu -q -ra -p no:cacheprovider \
  tests/test_examples.py tests/test_hf.py tests/test_integrity.py 2>&1 | filter | tail -4
