#!/usr/bin/env bash
# kvc tune on the GPU, one kernel family at a time (each saves its own entries), for the
# Qwen3-30B-A3B shape; the tuned cache files and the old-vs-new tables land in $1.
# Usage (device machine): bash bench/gpu_tune.sh "$OUT" [quick|full]
set -uo pipefail
out=${1:?output folder}; effort=${2:-quick}
mkdir -p "$out"
for kernels in attention moe compaction; do
  timeout "${TUNE_TIMEOUT:-170}" python3 -m kvc.runtime.cli tune --model random:qwen3-30b-a3b --dtype bfloat16 \
    --effort "$effort" --kernels "$kernels" --max-batch 256 --out "$out/tune_$kernels.json" \
    > "$out/tune_$kernels.log" 2>&1
  echo "$kernels: rc=$? $(tail -c 300 "$out/tune_$kernels.log" | tr '\n' ' ')"
  cp -r kernels_generated/tuned "$out/" 2>/dev/null
done
