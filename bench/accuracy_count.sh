#!/usr/bin/env bash
# Long generation (docs/accuracy.md, "Long generation: R-KV against prefill-only SnapKV"): `count` at 2K
# tokens, 20 cases, full, SnapKV (prefill only) and R-KV (compressing its own output every 128 tokens) at
# budgets 128 and 256, on the embedded default model (SmolLM2-135M-Instruct, float32, CPU; ~50 min on 2
# cores), then SnapKV with a decode budget (`every` 128, ~5 min), then SkipKV (whole sentences of its own
# output every 128 tokens, R-KV's importance per sentence, ~20 min). Results land in $1 (default
# bench/results/accuracy_count): eval*.json, table*.md. Resumable.
set -euo pipefail
out=${1:-bench/results/accuracy_count}
mkdir -p "$out"
kvc eval --methods full,snapkv,rkv --budgets 128,256 --tasks count --lengths 2048 --cases "${CASES:-20}" --seed 0 \
  --device "${DEVICE:-cpu}" --dtype float32 --out "$out/eval.json" --markdown "$out/table.md" --no-progress
# SnapKV with a decode budget (every 128 generated tokens, as R-KV): its own file (the same method, other parameters)
kvc eval --methods snapkv --budgets 128,256 --method-param every=128 --tasks count --lengths 2048 \
  --cases "${CASES:-20}" --seed 0 --device "${DEVICE:-cpu}" --dtype float32 --out "$out/eval_snapkv_every128.json" \
  --markdown "$out/table_snapkv_every128.md" --no-progress
# SkipKV: sentences of the text (".\n", ")\n\n", "\n\n"), every 128 generated tokens (its default)
kvc eval --methods skipkv --budgets 128,256 --tasks count --lengths 2048 --cases "${CASES:-20}" --seed 0 \
  --device "${DEVICE:-cpu}" --dtype float32 --out "$out/eval_skipkv.json" --markdown "$out/table_skipkv.md" \
  --no-progress
