#!/usr/bin/env bash
# Issue 17, device run 53 (asked for as nvidia-h200). On an H200: every `pytest -m gpu` test, bench_gpu cuda_ipc,
# bench e2e 1B. On an H100: goal 1 at 4k with the two processes as MPS clients (one GPU context server-side,
# no time-slicing between the processes' contexts) against the same bench without MPS, same machine.
# Usage: OUT=$OUT bash scripts/device_run53.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  h200_checks
else
  mps_bench() {  # mps_bench NAME
    PYTHONPATH=$BOTH timeout 100 python3 benchmarks/bench_gpu.py --backends cuda_ipc --tokens 4096 --iters 9 \
      --latency-iters 100 --json "$OUT/bench_gpu_$1.json" 2>&1 | filter > "$OUT/bench_gpu_$1.txt"
    tail -10 "$OUT/bench_gpu_$1.txt"
  }
  for round in 1 2; do
    echo "=== round $round: bench_gpu 4k without MPS (${SECONDS}s used)"; mps_bench plain_$round
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && echo "MPS control daemon started"
    echo "=== round $round: bench_gpu 4k, both processes MPS clients (${SECONDS}s used)"; mps_bench mps_$round
    echo quit | nvidia-cuda-mps-control; sleep 2
    tail -5 $CUDA_MPS_LOG_DIRECTORY/control.log > "$OUT/mps_control_$round.log" 2>/dev/null
    cp $CUDA_MPS_LOG_DIRECTORY/server.log "$OUT/mps_server_$round.log" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  done
fi
echo "done at ${SECONDS}s"
