#!/usr/bin/env bash
# Issue 17, device run 66: run 65 (H200) put nixl_prep at 0.63-0.72x raw NIXL at 4k identical, where run 52 (H100)
# had 1.22-1.31x. The nixl handle's wait slept (time.sleep(0): 55-75 us of timer slack) between every two
# asks of check_xfer_state, where raw NIXL asks back to back; it now yields (os.sched_yield) and sleeps once
# per 0.5 ms. The 4k cases with 25 iterations, 8 UCX threads (as runs 52 and 65), the new wait and then the
# old (--nixl-sleep-every-us 0), each against raw NIXL in the same process. UCX's cuda_ipc reaps at most
# UCX_CUDA_IPC_MAX_POLL (16) copy events per progress call, so a 128-descriptor post needs ~8 asks after its
# copies end: the third pass (maxpoll) raises that to 1024 for both kvxfer and raw NIXL. Then the nixl GPU tests.
# Usage: OUT=$OUT [ITERS=25] [LAT_ITERS=100] [BENCH_LIMIT=150 (s, each)] bash scripts/device_run66.sh
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
for policy in new old maxpoll; do
  extra=""; [ "$policy" = old ] && extra="--nixl-sleep-every-us 0"
  poll=16; [ "$policy" = maxpoll ] && poll=1024
  echo "--- wait policy $policy, UCX_CUDA_IPC_MAX_POLL=$poll"
  UCX_CUDA_IPC_MAX_POLL=$poll bench_nixl "bench_gpu_nixl_$policy" "${BENCH_LIMIT:-150}" --tokens 4096 \
    --iters "${ITERS:-25}" --latency-iters "${LAT_ITERS:-100}" $extra
done
# The GPU tests of the nixl backend on this tree (the wait changed after run 64's full `pytest -m gpu`).
pytest_gpu ${PYTEST_LIMIT:-90} "tests/test_transport_gpu.py -k nixl"
echo "done at ${SECONDS}s"
