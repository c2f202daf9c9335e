#!/usr/bin/env bash
# Issue 17, device run 64: the workers now warm their model up on the compute thread before serving. Run 63
# showed the demo's first wave waiting on prefill's first forward (651 ms cold, 567 ms warm, 3,200 ms with
# eager module loading: cuBLAS set-up and kernel loading), the other first-wave requests queued behind it.
# 1. The demo on a cold Triton cache, then again: each row's TTFT split (is the first wave ~20-70 ms now?).
# 2. `pytest -m gpu` on the final tree, in the time left (GPU_TESTS: the paths, default the whole tree;
#    tests/test_examples.py tests/test_hf.py hold every GPU test that starts workers, ~180 s on an H100).
# Usage: OUT=$OUT [LIMIT=seconds, default 400] [GPU_TESTS=paths] bash scripts/device_run64.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
LIMIT=${LIMIT:-400}
demo_cuda demo_cold --checksum full; demo_split demo_cold
demo_cuda demo_warm --checksum full; demo_split demo_warm
pytest_gpu $(( LIMIT - SECONDS )) "${GPU_TESTS:-tests/}"
echo "done at ${SECONDS}s"
