#!/usr/bin/env bash
# KIVI's accuracy rows of docs/accuracy.md: methods/kivi.kvm at 2 and 4 bits (group 32, residual
# 128: the paper's) on the embedded default model (float32, CPU), passkey, multikey and multiturn at
# 4K tokens, 20 cases, seed 0: the cells `full` was measured on (docs/accuracy.md, FP8 section).
# Results land in $1 (default bench/results/accuracy_kivi): eval{2,4}.json, table{2,4}.md, eval.log.
# Usage: bash bench/accuracy_kivi.sh [OUT] ; env BITS (default "2 4"), TASKS, DENSE (layers kept in
# the model dtype, e.g. "[0,1]": `--method-param dense_layers=...`; default none).
set -euo pipefail
out=${1:-bench/results/accuracy_kivi}
mkdir -p "$out"
for bits in ${BITS:-2 4}; do
  dense=()
  [ -n "${DENSE:-}" ] && dense=(--method-param "dense_layers=$DENSE")
  /usr/bin/time -v kvc eval --methods kivi --method-param "bits=$bits" "${dense[@]}" --tasks "${TASKS:-passkey,multikey,multiturn}" \
    --lengths 4096 --cases 20 --seed 0 --device cpu --dtype float32 --no-progress \
    --out "$out/eval$bits.json" --markdown "$out/table$bits.md" 2>> "$out/eval.log" | tee "$out/table${bits}.log"
done
