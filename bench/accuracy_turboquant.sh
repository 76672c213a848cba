#!/usr/bin/env bash
# TurboQuant's accuracy rows of docs/accuracy.md: methods/turboquant.kvm (random rotation, Lloyd-Max
# codes against each token's RMS) on the embedded default model (float32, CPU), passkey, multikey
# and multiturn at 4K tokens, 20 cases, seed 0: the cells `full` was measured on (docs/accuracy.md,
# FP8 section). BITS lists "key_bits:value_bits" settings (default "3:3 4:4").
# Results land in $1 (default bench/results/accuracy_turboquant): eval{K}{V}.json, table{K}{V}.md, eval.log.
# Usage: bash bench/accuracy_turboquant.sh [OUT] ; env BITS, TASKS, METHOD (a name or .kvm path; default turboquant).
set -euo pipefail
out=${1:-bench/results/accuracy_turboquant}
mkdir -p "$out"
for bits in ${BITS:-3:3 4:4}; do
  k=${bits%%:*}; v=${bits##*:}
  /usr/bin/time -v kvc eval --methods "${METHOD:-turboquant}" --method-param "key_bits=$k" --method-param "value_bits=$v" \
    --tasks "${TASKS:-passkey,multikey,multiturn}" --lengths 4096 --cases 20 --seed 0 --device cpu --dtype float32 \
    --no-progress --out "$out/eval$k$v.json" --markdown "$out/table$k$v.md" 2>> "$out/eval.log" \
    | tee "$out/table$k$v.log"
done
