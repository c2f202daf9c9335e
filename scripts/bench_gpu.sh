#!/usr/bin/env bash
# The GPU checks and benchmarks of kvxfer in one command, for any machine with an NVIDIA GPU:
# `pytest -m gpu`, the demo on cuda:0, bench_gpu (cuda_ipc; nixl against raw NIXL, pooled over
# fresh process pairs), bench e2e at the Llama shapes and the tier copy engine. Prints each table
# and keeps every output (text and JSON) in $OUT. Run from the repository root:
#
#   bash scripts/bench_gpu.sh                       # everything, in the existing .venv
#   SETUP=1 bash scripts/bench_gpu.sh               # first create .venv with a CUDA torch and the cu12 extras
#   PARTS="tests cuda_ipc" TOKENS="4096" bash scripts/bench_gpu.sh
#
# Parameters (environment):
#   PARTS          what to run, in order: tests demo cuda_ipc nixl e2e tiers (default: all)
#   OUT            output folder (default: bench-gpu-<UTC date and time>)
#   VENV           the virtual environment (default .venv); PYTHON the interpreter that creates it
#   PY             the interpreter that runs everything (default $VENV/bin/python; e.g. PY=python3 for an
#                  environment that already has torch with CUDA, kvxfer's dependencies and the bindings)
#   SETUP=1        create/update $VENV: TORCH_SPEC (default torch) from TORCH_INDEX (default the
#                  PyTorch cu128 wheels), then kvxfer with the dev, hf and $FLAVOUR (cu12|cu13) extras
#   TOKENS         bench_gpu prompt lengths (default "4096 32768"); ITERS, LATENCY_ITERS its iterations
#   NIXL_PASSES    fresh process pairs of the nixl bench, pooled (default 3); NIXL_ITERS per pass (25)
#   E2E_MODELS     bench e2e shapes (default "llama-3.2-1b llama-3-8b"); E2E_LENGTHS (4096,16384), E2E_ITERS (11);
#                  E2E_ARGS more bench e2e options (e.g. "--decode-tokens-per-block 32 --decode-head-order NHD")
#   TEST_TIMEOUT   per-test bound of pytest -m gpu in seconds (default 300)
set -uo pipefail

PARTS=${PARTS:-"tests demo cuda_ipc nixl e2e tiers"}
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
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "torch of $PY sees no CUDA device: install a CUDA build (SETUP=1, TORCH_INDEX)" >&2; exit 1; }

mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 UCX_LOG_LEVEL=error
failed=0
# NIXL's informational lines out of a command's output, the rest into $OUT/NAME.txt and the terminal.
run() {  # run NAME command...
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "=== $name exited $rc"; failed=1; }
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
        --iters "$ITERS" --latency-iters "$LATENCY_ITERS" --json "$OUT/bench_gpu_cuda_ipc.json" ;;
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
    *)
      echo "unknown part '$part' in PARTS (tests demo cuda_ipc nixl e2e tiers)" >&2; exit 2 ;;
  esac
done
echo "outputs in $OUT/ (machine.txt, one .txt per part, JSON beside them)"
exit $failed
