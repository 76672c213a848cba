#!/usr/bin/env bash
# KVzip against SnapKV at equal memory (docs/accuracy.md, "KVzip"): passkey and multikey at 2K tokens, 20
# cases, on the embedded default model (SmolLM2-135M-Instruct, float32, CPU; ~25 min on 2 cores). KVzip keeps
# `ratio` of the context's KV pairs across all layers and heads, SnapKV `budget` tokens per head: ratio 0.25
# against budget 512 (with full), ratio 0.0625 against budget 128. Results in $1 (default
# bench/results/accuracy_kvzip): eval_ratio*.json, table_ratio*.md. Resumable. `reference` as $2: KVzip at both
# ratios through kvpress's KVzipPress beside kvc's (eval_reference.json, table_reference.md; ~20 more minutes).
set -euo pipefail
out=${1:-bench/results/accuracy_kvzip}
mkdir -p "$out"
common=(--tasks passkey,multikey --lengths 2048 --cases "${CASES:-20}" --seed 0 --device "${DEVICE:-cpu}"
        --dtype float32 --no-progress)
if [[ ${2:-} == reference ]]; then
  kvc eval --methods kvzip --budgets 512 --method-param ratio=0.0625 --reference kvpress "${common[@]}" \
    --out "$out/eval_reference.json" --markdown "$out/table_reference.md"
  exit
fi
kvc eval --methods full,snapkv,kvzip --budgets 512 --method-param ratio=0.25 "${common[@]}" \
  --out "$out/eval_ratio0.25.json" --markdown "$out/table_ratio0.25.md"
kvc eval --methods snapkv,kvzip --budgets 128 --method-param ratio=0.0625 "${common[@]}" \
  --out "$out/eval_ratio0.0625.json" --markdown "$out/table_ratio0.0625.md"
