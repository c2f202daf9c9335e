#!/usr/bin/env bash
# Issue 15's done-means: every pairing-bug class injected into real worker processes (test hook
# $KVXFER_TEST_MUTATION) must make `kvxfer demo` exit non-zero, in push, pull and layer-wise, with and
# without --checksum full; the unmutated demo must pass. Prints one line per run and a summary.
#   bash scripts/mutation_matrix.sh [BACKEND]      (default nixl; run from the repo root, venv built)
set -u
backend=${1:-nixl}
kv=${KVXFER:-.venv/bin/kvxfer}
caught=0; missed=0; healthy_ok=0; healthy_bad=0
for checksum in off full; do
  for mode in push pull layerwise; do
    args=(--backend "$backend" --families 2 --per-family 2 --max-new-tokens 8 --checksum "$checksum" --json)
    if [ "$mode" = layerwise ]; then args+=(--layerwise); else args+=(--mode "$mode"); fi
    for mutation in none block_swap token_shift head_swap foreign_block zero_layer; do
      extra=(); [ "$mutation" = head_swap ] && extra=(--decode-tp 2)
      if [ "$mutation" = none ]; then
        out=$(env -u KVXFER_TEST_MUTATION "$kv" demo "${args[@]}" "${extra[@]}" 2>/dev/null); rc=$?
      else
        out=$(KVXFER_TEST_MUTATION=$mutation "$kv" demo "${args[@]}" "${extra[@]}" 2>/dev/null); rc=$?
      fi
      summary=$(printf '%s' "$out" | python3 -c "import json,sys
try:
    d = json.load(sys.stdin)
    print('mismatches=%s kv=%s failed=%s' % (d['mismatches'], d['kv_mismatches'], d['failed']))
except Exception:
    print('no-json')")
      echo "checksum=$checksum mode=$mode mutation=$mutation exit=$rc $summary"
      if [ "$mutation" = none ]; then
        if [ $rc -eq 0 ]; then healthy_ok=$((healthy_ok+1)); else healthy_bad=$((healthy_bad+1)); fi
      else
        if [ $rc -ne 0 ]; then caught=$((caught+1)); else missed=$((missed+1)); fi
      fi
    done
  done
done
echo "mutated runs caught: $caught, missed: $missed; unmutated runs passed: $healthy_ok, failed: $healthy_bad"
[ $missed -eq 0 ] && [ $healthy_bad -eq 0 ]
