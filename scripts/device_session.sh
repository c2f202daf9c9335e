#!/usr/bin/env bash
# What every device run script shares (sourced by scripts/device_setup.sh after the wheels are in; it
# installs nothing, so it can be sourced anywhere): the output folder, the PYTHONPATH with both bindings,
# and helpers for the machine record and the demo on cuda:0.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BOTH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx
export UCX_LOG_LEVEL=error

# NIXL's informational lines out of a command's output.
filter() { grep -v "NIXL INFO"; }

# The machine, driver, torch and Triton versions, into $OUT/env.txt.
record_env() {
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch, triton; print("torch", torch.__version__, torch.version.cuda, "triton", triton.__version__)'
  } > "$OUT/env.txt" 2>&1
}

# The demo's JSON summary: its counts and each request's transfer (ms); else the tail of its stderr.
demo_summary() {  # demo_summary JSON ERR
  python3 - "$1" <<'PY' || tail -5 "$2"
import json, sys
d = json.load(open(sys.argv[1]))
print({k: d[k] for k in ("requests", "mismatches", "kv_mismatches", "failed", "ttft_ms_p50")})
print("transfer_ms per request:", [round(r["transfer_ms"], 3) for r in d["rows"]])
PY
}

# The demo on cuda:0 over cuda_ipc (60 s at most): its JSON in $OUT/NAME.json, then its summary.
demo_cuda() {  # demo_cuda NAME [demo options]
  local name=$1; shift
  PYTHONPATH=$BOTH timeout 60 python3 -m kvxfer demo --device cuda:0 --backend cuda_ipc "$@" --json \
    > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "demo exit $?"
  demo_summary "$OUT/$name.json" "$OUT/$name.err"
}

# A demo's rows from $OUT/NAME.json: each request's TTFT and its split by stage (the demo's ttft_split_ms).
demo_split() {  # demo_split NAME
  python3 -c "
import json
d = json.load(open('$OUT/$1.json'))
print('$1', 'elapsed ms', round(d['elapsed_ms']), 'transfers ms', [round(r['transfer_ms'], 2) for r in d['rows']])
for r in d['rows']:
    print(r['request'], r['family'], r['prompt_tokens'], 'ttft', round(r['ttft_ms'], 1),
          {k: round(v, 1) for k, v in r['ttft_split_ms'].items()})
"
}

# bench_gpu over cuda_ipc (with its blocks and prepared columns), 9 interleaved iterations and 200 latency
# iterations: its table in $OUT/bench_gpu.txt (last lines printed), its JSON in $OUT/bench_gpu.json.
bench_cuda_ipc() {  # bench_cuda_ipc [timeout_s]
  echo "=== bench_gpu cuda_ipc (+ cuda_ipc_blocks, cuda_ipc_prep)"
  PYTHONPATH=$BOTH timeout "${1:-130}" python3 benchmarks/bench_gpu.py --backends cuda_ipc --iters 9 \
    --latency-iters 200 --json "$OUT/bench_gpu.json" 2>&1 | filter > "$OUT/bench_gpu.txt"
  tail -16 "$OUT/bench_gpu.txt"
}

# bench_gpu nixl (+ nixl_prep) against raw NIXL through its own agent, 8 UCX threads: its table in $OUT/NAME.txt
# (last lines printed), its JSON in $OUT/NAME.json. Extra arguments go to bench_gpu (--tokens, --iters, ...).
bench_nixl() {  # bench_nixl NAME TIMEOUT_S [bench_gpu arguments...]
  local name=$1 limit=$2; shift 2
  echo "=== bench_gpu nixl (+ nixl_prep) vs raw NIXL $* (${SECONDS}s used)"
  KVXFER_NIXL_THREADS=8 PYTHONPATH=$BOTH timeout "$limit" python3 benchmarks/bench_gpu.py --backends nixl \
    --raw-nixl --json "$OUT/$name.json" "$@" 2>&1 | filter > "$OUT/$name.txt"
  tail -14 "$OUT/$name.txt"
}

# The prepared post's stage probe, host-call costs and kernel sweep (scripts/device_prep_stages.py).
prep_stages() {  # prep_stages [timeout_s]
  echo "=== prepared post stages, host calls, kernel sweep"
  PYTHONPATH=$BOTH timeout "${1:-150}" python3 scripts/device_prep_stages.py "$OUT/prep_stages.json" 2>&1 | filter \
    > "$OUT/prep_stages.txt"
  tail -40 "$OUT/prep_stages.txt"
}

# Each GPU process's memory (nvidia-smi, every 0.5 s) while a command runs: the samples in $OUT/NAME.csv,
# then each process's largest sample printed. Usage: with_gpu_memory NAME command...
with_gpu_memory() {
  local name=$1; shift
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits -lms 500 \
    > "$OUT/$name.csv" 2>/dev/null &
  local sampler=$!
  "$@"; local rc=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  python3 - "$OUT/$name.csv" <<'PY'
import collections, sys
peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 3 and parts[2].isdigit():
        peak[(parts[0], parts[1])] = max(peak[(parts[0], parts[1])], int(parts[2]))
print("peak GPU memory MiB per process:", {f"{pid} {name[-40:]}": mib for (pid, name), mib in peak.items()})
PY
  return $rc
}

# Every `pytest -m gpu` test of the tree, verbose, each bounded at 90 s: output in $OUT/pytest_gpu.txt, its
# failures and summary printed.
pytest_gpu() {  # pytest_gpu [timeout_s [test paths, default tests/]]
  echo "=== pytest -m gpu (${2:-whole tree}, verbose)"
  PYTHONPATH=$BOTH timeout "${1:-300}" python3 -m pytest -m gpu -v -ra --timeout 90 --durations 10 \
    -p no:cacheprovider ${2:-tests/} 2>&1 | filter > "$OUT/pytest_gpu.txt"
  grep -E "FAILED|ERROR|Timeout" "$OUT/pytest_gpu.txt" | head -20
  tail -3 "$OUT/pytest_gpu.txt"
}

# bench e2e at the Llama-3.2-1B shape on cuda:0 over cuda_ipc: JSON in $OUT/e2e_1b.json, the table's tail printed.
e2e_1b() {  # e2e_1b LENGTHS ITERS TIMEOUT_S [NAME [more bench e2e arguments...]]
  local lengths=$1 iters=$2 limit=$3 name=${4:-e2e_1b}; shift 3; shift $(( $# > 0 ? 1 : 0 ))
  echo "=== bench e2e 1B $* (${SECONDS}s used)"
  PYTHONPATH=$BOTH timeout "$limit" python3 -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc \
    --model llama-3.2-1b --lengths "$lengths" --iters "$iters" --out "$OUT/$name.json" "$@" 2>&1 | filter | tail -6
}

# What a call that finds an H200 runs first: the GPU tests, bench_gpu cuda_ipc, bench e2e 1B (1k-16k).
h200_checks() {
  pytest_gpu 300
  bench_cuda_ipc 110
  e2e_1b 1024,4096,16384 3 $(( 585 - SECONDS ))
}
