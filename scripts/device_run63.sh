#!/usr/bin/env bash
# Issue 17, device run 63: where the demo's first wave (one request per family, nothing cached) spends its
# 350-900 ms of TTFT on the GPU (run 62: 762/840/909 ms on a cold machine, 347/414/475 ms warm; the second
# wave 27-151 ms). Each demo row now carries its TTFT split by stage. Three demos: a cold Triton cache, warm,
# and warm with CUDA_MODULE_LOADING=EAGER (are lazily loaded kernels the first request's cost?).
# Then bench e2e 1B at 4k with 31 iterations: run 61 (7 iterations) gave a TTFT ratio of 0.927 and run 62 (same
# kernel, 7 iterations) 1.188, both with "after prefill" ~1 ms: the row now carries every iteration and the
# median of the per-iteration ratios, to show how much of that is prefill's own spread.
# Usage: OUT=$OUT bash scripts/device_run63.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
demo_cuda demo_cold --checksum full; demo_split demo_cold
demo_cuda demo_warm --checksum full; demo_split demo_warm
CUDA_MODULE_LOADING=EAGER demo_cuda demo_eager --checksum full; demo_split demo_eager
e2e_1b 4096 31 150
python3 -c "
import json
r = json.load(open('$OUT/e2e_1b.json'))['rows'][0]
print('ratio of medians', round(r['ttft_ratio'], 3), 'median of paired ratios', round(r['ttft_ratio_paired'], 3))
for k, v in r['per_iteration_ms'].items(): print(k, sorted(round(x) for x in v))
"
echo "done at ${SECONDS}s"
