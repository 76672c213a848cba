#!/usr/bin/env bash
# The accuracy table of docs/accuracy.md: every served method at budgets 128-1024 on the embedded
# default model (SmolLM2-135M-Instruct, float32), three tasks at 2K and 4K tokens, kvpress's presses
# on the same cases. Results land in $1 (default bench/results/accuracy): eval.json, table.md,
# plot.png, eval.log. Resumable: an interrupted run continues from eval.json.
# Usage: bash bench/accuracy.sh [OUT] ; env CASES (default 20), DEVICE (default cpu), PARTS ("kvc kvpress").
set -euo pipefail
out=${1:-bench/results/accuracy}
mkdir -p "$out"
common=(--methods full,streamingllm,snapkv,pyramidkv,tova,h2o,adakv --budgets 128,256,512,1024
        --tasks passkey,multikey,multiturn --lengths 2048,4096 --cases "${CASES:-20}" --seed 0
        --device "${DEVICE:-cpu}" --dtype float32 --out "$out/eval.json" --markdown "$out/table.md"
        --plot "$out/plot.png" --no-progress)
for part in ${PARTS:-kvc kvpress}; do
  case $part in
    kvc) extra=() ;;                         # kvc's engine: every method, budget, task and length
    kvpress) extra=(--reference kvpress) ;;  # adds kvpress's cells (single-turn tasks) to the same file
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
  /usr/bin/time -v kvc eval "${common[@]}" "${extra[@]}" 2>> "$out/eval.log" | tee "$out/table_$part.log"
done
