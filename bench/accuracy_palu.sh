#!/usr/bin/env bash
# Palu's accuracy rows of docs/accuracy.md: methods/palu.kvm (low-rank K/V from an SVD of the K/V
# projection weights, keys before RoPE) on the embedded default model (float32, CPU), passkey,
# multikey and multiturn at 4K tokens, 20 cases, seed 0: the cells `full` was measured on
# (docs/accuracy.md, FP8 section). RATIOS lists the `ratio` settings (default "0.5"); each is
# calibrated first (`kvc calibrate palu`, seconds) into $OUT/inputs-RATIO, except the shipped 0.5.
# METHOD (default palu) may name a variant file (bench/variants/palu_postrope.kvm: keys after RoPE), whose
# projections are always calibrated. Results land in $1 (default bench/results/accuracy_palu): eval{R}.json,
# table{R}.md, eval.log.
# Usage: bash bench/accuracy_palu.sh [OUT] ; env METHOD, RATIOS, TASKS, PARAMS (more --method-param, e.g.
# heads_per_group=3), CALIBRATION (more `kvc calibrate` options, e.g. "--context 4096 --samples 4": keys after
# RoPE need calibration positions as long as the eval's).
set -euo pipefail
out=${1:-bench/results/accuracy_palu}
mkdir -p "$out"
read -ra extra <<< "${PARAMS:-}"
read -ra calibration <<< "${CALIBRATION:-}"
args=()
for p in "${extra[@]}"; do args+=(--method-param "$p"); done
method=${METHOD:-palu}
file=$(basename "$method" .kvm).safetensors
for ratio in ${RATIOS:-0.5}; do
  inputs=()
  if [[ "$ratio" != "0.5" || ${#args[@]} -gt 0 || "$method" != palu ]]; then
    kvc calibrate "$method" --method-param "ratio=$ratio" "${args[@]}" "${calibration[@]}" --out "$out/inputs-$ratio/$file" \
      >> "$out/eval.log" 2>&1
    inputs=(--method-inputs "$out/inputs-$ratio")
  fi
  /usr/bin/time -v kvc eval --methods "$method" --method-param "ratio=$ratio" "${args[@]}" "${inputs[@]}" \
    --tasks "${TASKS:-passkey,multikey,multiturn}" --lengths 4096 --cases 20 --seed 0 --device cpu --dtype float32 \
    --no-progress --out "$out/eval$ratio.json" --markdown "$out/table$ratio.md" 2>> "$out/eval.log" \
    | tee "$out/table$ratio.log"
done
