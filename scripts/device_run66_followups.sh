#!/usr/bin/env bash
# Issue 17, device run 66's follow-up calls on the same warm H100 (2026-12-06 22:27-22:34 UTC). Run 66's three
# passes gave nixl_prep at 0.64-1.06x raw NIXL at 4k identical with raw NIXL itself at 153-351 GB/s from pass to
# pass, so one pass cannot tell the waits apart:
#   b: four more 4k passes alternating old wait and new (25 interleaved iterations each), for
#      benchmarks/pool_bench_gpu.py to pool with run 66's;
#   c: the whole `pytest -m gpu` on the final tree (the nixl wait changed after run 64's);
#   d: nixl (+ nixl_prep) against raw NIXL at 32k, 7 iterations.
# Usage: OUT=$OUT bash scripts/device_run66_followups.sh b|c|d
source scripts/device_setup.sh >/dev/null 2>&1
record_env
case "$1" in
  b) i=0
     for policy in old new old new; do
       i=$((i + 1)); extra=""; [ "$policy" = old ] && extra="--nixl-sleep-every-us 0"
       bench_nixl "r${i}_$policy" 120 --tokens 4096 --iters 25 --latency-iters 100 $extra \
         | grep -E "identical|tp1|^ +[0-9]+ +[0-9]+ "
     done ;;
  c) cat "$OUT/env.txt"; pytest_gpu 330 ;;
  d) bench_nixl bench_gpu_nixl_32k 250 --tokens 32768 --iters 7 --latency-iters 50 | grep -E "identical|tp1|D2D" ;;
  *) echo "usage: $0 b|c|d" >&2; exit 2 ;;
esac
echo "done at ${SECONDS}s"
