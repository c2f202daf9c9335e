#!/usr/bin/env bash
# The GPU checks and benchmarks of kvxfer in one command, for any machine with an NVIDIA GPU:
# `pytest -m gpu`, the demo on cuda:0, bench_gpu (cuda_ipc; nixl against raw NIXL, pooled over
# fresh process pairs), bench e2e at the Llama shapes, the tier copy engine, and TensorRT-LLM's own
# KVCacheManagerV2 tests run on kvxfer. Prints each table and keeps every output (text and JSON) in
# $OUT. Run from the repository root:
#
#   bash scripts/bench_gpu.sh                       # everything, in the existing .venv
#   SETUP=1 bash scripts/bench_gpu.sh               # first create .venv with a CUDA torch and the cu12 extras
#   PARTS="tests cuda_ipc" TOKENS="4096" bash scripts/bench_gpu.sh
#
# Parameters (environment):
#   PARTS          what to run, in order: tests demo cuda_ipc nixl e2e tiers reference defaults (default: all
#                  but reference and defaults). defaults: the host-memory transport table (`kvxfer bench
#                  transport --table`, nixl and ucx against raw NIXL) at kvxfer's defaults and with each
#                  transport setting the defaults decide (NIXL's progress thread, UCX peer-failure handling),
#                  for the choice on a machine of this size; DEFAULTS_ITERS iterations per row (5)
#   OUT            output folder (default: bench-gpu-<UTC date and time>)
#   VENV           the virtual environment (default .venv); PYTHON the interpreter that creates it
#   PY             the interpreter that runs everything (default $VENV/bin/python; e.g. PY=python3 for an
#                  environment that already has torch with CUDA, kvxfer's dependencies and the bindings)
#   SETUP=1        create/update $VENV: TORCH_SPEC (default torch) from TORCH_INDEX (default the
#                  PyTorch cu128 wheels), then kvxfer with the dev, hf and $FLAVOUR (cu12|cu13) extras
#   WHEELS         a folder of wheels (searched recursively) for a machine without network whose $PY has
#                  torch already: each is installed with pip --no-index --no-deps into $OUT/site, which goes
#                  first on PYTHONPATH (kvxfer itself runs from this checkout)
#   TOKENS         bench_gpu prompt lengths (default "4096 32768"); ITERS, LATENCY_ITERS its iterations;
#                  CUDA_IPC_ARGS more bench_gpu options for the cuda_ipc part (e.g. "--layouts --profile-posts 50")
#   NIXL_PASSES    fresh process pairs of the nixl bench, pooled (default 3); NIXL_ITERS per pass (25)
#   E2E_MODELS     bench e2e shapes (default "llama-3.2-1b llama-3-8b"); E2E_LENGTHS (4096,16384), E2E_ITERS (11);
#                  E2E_ARGS more bench e2e options (e.g. "--decode-tokens-per-block 32 --decode-head-order NHD")
#   TEST_TIMEOUT   per-test bound of pytest -m gpu in seconds (default 300)
#   REFERENCE_DIR  for PARTS=reference: a folder with TensorRT-LLM's tests/unittest/kv_cache_manager_v2_tests
#                  files (not part of kvxfer). They are copied to $OUT/reference with only their imports
#                  renamed to kvxfer's and run with its Python backend (TLLM_KV_CACHE_MANAGER_V2_BACKEND=python;
#                  `parameterized` must be installed) in REF_SHARDS pytest processes (default 7), REF_TIMEOUT
#                  seconds per test (240); REF_FIRST names tests (ids or -k words) that each start a shard of
#                  their own, the long ones; REF_ALONE tests each run in a process of their own afterwards with
#                  CUDA_LAUNCH_BLOCKING=1 (a device assertion ends its process's CUDA context, and with it the
#                  rest of a shard). Prints the counts and every test that did not pass.
set -uo pipefail

PARTS=${PARTS:-"tests demo cuda_ipc nixl e2e tiers"}
REF_SHARDS=${REF_SHARDS:-7}
REF_TIMEOUT=${REF_TIMEOUT:-240}
REF_FIRST=${REF_FIRST:-}
REF_ALONE=${REF_ALONE:-}
OUT=${OUT:-bench-gpu-$(date -u +%Y%m%d-%H%M%S)}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
FLAVOUR=${FLAVOUR:-cu12}
TOKENS=${TOKENS:-"4096 32768"}
ITERS=${ITERS:-9}
LATENCY_ITERS=${LATENCY_ITERS:-200}
NIXL_PASSES=${NIXL_PASSES:-3}
NIXL_ITERS=${NIXL_ITERS:-25}
E2E_MODELS=${E2E_MODELS:-"llama-3.2-1b llama-3-8b"}
E2E_LENGTHS=${E2E_LENGTHS:-4096,16384}
E2E_ITERS=${E2E_ITERS:-11}
E2E_ARGS=${E2E_ARGS:-}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}

if [ "${SETUP:-0}" = 1 ]; then
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV" || exit 1
  "$VENV/bin/python" -m pip install -q --upgrade pip || exit 1
  "$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch}" \
    --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}" || exit 1
  "$VENV/bin/python" -m pip install -q -e ".[dev,hf,$FLAVOUR]" || exit 1
fi
PY=${PY:-$VENV/bin/python}
command -v "$PY" >/dev/null || { echo "no $PY: run with SETUP=1, or set VENV or PY" >&2; exit 1; }
# the reference tests and the defaults' table also run on a CPU machine (CUDA-gated reference tests fail there)
needs_gpu=0
for part in $PARTS; do case $part in reference|defaults) ;; *) needs_gpu=1 ;; esac; done
[ "$needs_gpu" = 0 ] || "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "torch of $PY sees no CUDA device: install a CUDA build (SETUP=1, TORCH_INDEX)" >&2; exit 1; }

mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 UCX_LOG_LEVEL=error
if [ -n "${WHEELS:-}" ]; then
  mapfile -t wheels < <(find "$WHEELS" -name '*.whl' | sort)
  [ "${#wheels[@]}" -gt 0 ] || { echo "WHEELS=$WHEELS holds no .whl file" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$OUT/site" "${wheels[@]}" || exit 1
  PYTHONPATH=$(cd "$OUT/site" && pwd):$PYTHONPATH
fi
failed=0
# NIXL's informational lines out of a command's output, the rest into $OUT/NAME.txt and the terminal.
run() {  # run NAME command...
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "=== $name exited $rc"; failed=1; }
}

# TensorRT-LLM's KVCacheManagerV2 tests on kvxfer (PARTS=reference; see REFERENCE_DIR above).
run_reference() {
  [ -n "${REFERENCE_DIR:-}" ] && [ -d "$REFERENCE_DIR" ] || {
    echo "PARTS=reference needs REFERENCE_DIR: a folder with TensorRT-LLM's kv_cache_manager_v2_tests" >&2; return 1; }
  local dir=$OUT/reference
  mkdir -p "$dir/logs"
  cp "$REFERENCE_DIR"/*.py "$dir"/ || return 1
  sed -i -e 's/tensorrt_llm\.runtime\.kv_cache_manager_v2/kvxfer.cache/g' \
         -e 's/tensorrt_llm\.runtime\.kv_cache_hash/kvxfer.cache.hashing/g' \
         -e 's/from tensorrt_llm\._utils import KVCacheEventSerializer/from kvxfer.cache import KVCacheEventSerializer/' \
         "$dir"/*.py
  printf '[pytest]\n' > "$dir/pytest.ini"   # the tests' own folder is pytest's root, not this repository
  local repo=$PWD py
  py=$(command -v "$PY") && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")   # absolute, venv kept
  ( cd "$dir" && TLLM_KV_CACHE_MANAGER_V2_BACKEND=python PYTHONPATH=$repo:$dir:$PYTHONPATH \
      "$py" - "$REF_SHARDS" "$REF_TIMEOUT" "$REF_FIRST" "$REF_ALONE" ) <<'PYEOF' 2>&1 | tee "$OUT/reference.txt"
import os, subprocess, sys, xml.etree.ElementTree as ET
shards, timeout, first, alone = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
py = sys.executable
collect = subprocess.run([py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         capture_output=True, text=True)
ids = [line for line in collect.stdout.splitlines() if "::" in line]
print(f"collected {len(ids)} tests", flush=True)
if not ids:
    sys.exit("nothing collected:\n" + (collect.stdout + collect.stderr)[-3000:])
def named(i, words): return any(w == i or w in i for w in words)
alone_ids = [i for i in ids if named(i, alone)]
rest = [i for i in ids if i not in alone_ids]
heads = [i for i in rest if named(i, first)]
groups = [[h] for h in heads] + [[] for _ in range(max(0, shards - len(heads)))]
for k, i in enumerate(i for i in rest if i not in heads):
    groups[k % len(groups)].append(i)
def pytest(ids, name, env=None):
    return subprocess.Popen([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--timeout", timeout,
                             f"--junitxml=logs/{name}.xml", *ids], stdout=open(f"logs/{name}.log", "w"),
                            stderr=subprocess.STDOUT, env=env)
procs = [pytest(g, f"shard{k}") for k, g in enumerate(groups) if g]
for p in procs: p.wait()
for k, i in enumerate(alone_ids):
    pytest([i], f"alone{k}", dict(os.environ, CUDA_LAUNCH_BLOCKING="1")).wait()
counts = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
for name in sorted(os.listdir("logs")):
    if not name.endswith(".xml"): continue
    for case in ET.parse(f"logs/{name}").getroot().iter("testcase"):
        tags = [c.tag for c in case]
        kind = "failed" if "failure" in tags else "error" if "error" in tags else "skipped" if "skipped" in tags else "passed"
        counts[kind] += 1
        if kind in ("failed", "error"):
            msg = next(c for c in case if c.tag in ("failure", "error")).get("message", "")
            print(f"{kind.upper()} {case.get('classname')}::{case.get('name')} [{name[:-4]}]: {msg[:300]}")
print("reference tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" (logs in {os.getcwd()}/logs)")
sys.exit(1 if counts["failed"] or counts["error"] else 0)
PYEOF
  return "${PIPESTATUS[0]}"
}

{ date -u +"%Y-%m-%d %H:%M UTC"; git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

for part in $PARTS; do
  case $part in
    tests)
      run pytest_gpu "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider --timeout "$TEST_TIMEOUT" tests/ ;;
    demo)
      run demo "$PY" -m kvxfer demo --device cuda:0 --backend cuda_ipc --checksum full ;;
    cuda_ipc)
      # shellcheck disable=SC2086
      run bench_gpu_cuda_ipc "$PY" benchmarks/bench_gpu.py --backends cuda_ipc --tokens $TOKENS \
        --iters "$ITERS" --latency-iters "$LATENCY_ITERS" --json "$OUT/bench_gpu_cuda_ipc.json" ${CUDA_IPC_ARGS:-} ;;
    nixl)
      passes=()
      for pass in $(seq 1 "$NIXL_PASSES"); do
        # shellcheck disable=SC2086
        KVXFER_NIXL_THREADS=${KVXFER_NIXL_THREADS:-8} run "bench_gpu_nixl_$pass" "$PY" benchmarks/bench_gpu.py \
          --backends nixl --raw-nixl --tokens $TOKENS --iters "$NIXL_ITERS" --latency-iters 100 \
          --json "$OUT/bench_gpu_nixl_$pass.json"
        passes+=("$OUT/bench_gpu_nixl_$pass.json")
      done
      run nixl_pooled "$PY" benchmarks/pool_bench_gpu.py --column nixl_prep --baseline raw_nixl \
        --json "$OUT/nixl_pooled.json" "${passes[@]}" ;;
    e2e)
      for model in $E2E_MODELS; do
        run "e2e_$model" "$PY" -m kvxfer bench e2e --device cuda:0 --backend cuda_ipc --model "$model" \
          --lengths "$E2E_LENGTHS" --iters "$E2E_ITERS" --out "$OUT/e2e_$model.json" $E2E_ARGS   # split on spaces
      done ;;
    tiers)
      run tiers "$PY" benchmarks/bench_tiers.py --device cuda:0 --out "$OUT/tiers.json" ;;
    defaults)
      for variant in "" --progress-thread --error-handling --no-error-handling; do
        # shellcheck disable=SC2086
        run "defaults${variant:-_as_shipped}" "$PY" -m kvxfer bench transport --table --iters "${DEFAULTS_ITERS:-5}" \
          --latency-iters 300 $variant
      done ;;
    reference)
      run_reference || { echo "=== reference failed"; failed=1; } ;;
    *)
      echo "unknown part '$part' in PARTS (tests demo cuda_ipc nixl e2e tiers reference defaults)" >&2; exit 2 ;;
  esac
done
echo "outputs in $OUT/ (machine.txt, one .txt per part, JSON beside them)"
exit $failed
