#!/usr/bin/env bash
# Issue 17, H200 run 30 (< ~5 min): where a cuda_ipc post's host time goes inside bench_gpu's loop
# (stage stamps, identical and TP 1->2, 4k and 32k tokens), and this host's CPU (model, governor).
source scripts/device_setup.sh >/dev/null 2>&1
record_env; cat "$OUT/env.txt"
{ lscpu | grep -E "Model name|^CPU\(s\)|MHz|NUMA node"; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1
  nproc; uptime; } | tee "$OUT/cpu.txt"
echo "=== post stages"
timeout 240 python3 scripts/device_post_stages.py "$OUT/post_stages.json" 2>&1 | filter | tail -12
echo "=== host micro (validate of the plans, as on the CPU VM)"
timeout 60 python3 scripts/host_check_probe.py 2>&1 | tail -12
