#!/usr/bin/env bash
# Issue 17, H200 runs 16-17: goal 5 after kv_posted, the early plan and tagged notices: bench e2e at the Llama-3.2-1B shape,
# the same with the stage probe (scripts/stage_trace) at 4k and 32k, and the demo on cuda:0.
source scripts/device_setup.sh >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BOTH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx
export UCX_LOG_LEVEL=error
filter() { grep -v "NIXL INFO"; }
echo "=== bench e2e 1B"
PYTHONPATH=$BOTH timeout 170 python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model llama-3.2-1b \
  --lengths 1024,4096,16384,32768 --iters 3 --out "$OUT/e2e_1b.json" 2>&1 | filter | tail -6
for n in 4096 32768; do
echo "=== traced e2e 1B $n"
KVX_TRACE=$OUT/trace_$n PYTHONPATH=$BOTH:$PWD/scripts/stage_trace timeout 100 python3 -m kvxfer bench e2e --device cuda:0 \
  --backend cuda_ipc --model llama-3.2-1b --lengths $n --iters 2 2>&1 | filter | tail -1
python3 scripts/stage_trace/merge.py "$OUT/trace_$n" 45
done
echo "=== demo cuda"
PYTHONPATH=$BOTH timeout 60 python3 -m kvxfer demo --device cuda:0 --backend cuda_ipc --checksum full --json > "$OUT/demo_cuda.json" 2> "$OUT/demo_cuda.err"
echo "demo exit $?"; python3 -c "import json; d=json.load(open('$OUT/demo_cuda.json')); print({k: d[k] for k in ('requests','mismatches','kv_mismatches','failed','ttft_ms_p50')}); print('transfer_ms per request:', [round(r['transfer_ms'], 3) for r in d['rows']])" || tail -5 "$OUT/demo_cuda.err"
