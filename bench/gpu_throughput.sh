#!/usr/bin/env bash
# kvc bench throughput on the H200, random-weight Qwen3-30B-A3B in bf16, 60 GiB of KV for every
# method. One invocation per part so a timeout loses one part only; results (JSON, stdout tables)
# land in $1. Parts: window32 window128 e2e (or several, space-separated in $2).
# Usage (device machine): bash bench/gpu_throughput.sh "$OUT" "window32 window128"
# Env: METHODS (window parts), STEPS (timed steps), TAG (file name suffix), PART_TIMEOUT (seconds).
set -uo pipefail
out=${1:?output folder}; parts=${2:-window32 window128 e2e}
methods=${METHODS:-full,streamingllm,snapkv,pyramidkv,adakv}
common=(--model random:qwen3-30b-a3b --dtype bfloat16 --kv-memory 60GiB --output 2048 --no-progress)
mkdir -p "$out"
for part in $parts; do
  case $part in
    window32) args=(--methods "$methods" --inputs 32768 --steps "${STEPS:-32}") ;;
    window128) args=(--methods "$methods" --inputs 131072 --steps "${STEPS:-32}") ;;
    e2e) args=(--methods snapkv --inputs 32768 --steps 32 --e2e --e2e-batch 64 --busy) ;;
    *) echo "unknown part $part"; continue ;;
  esac
  timeout "${PART_TIMEOUT:-280}" python3 -m kvc.runtime.cli bench throughput "${common[@]}" "${args[@]}" \
    --out "$out/throughput_$part${TAG:-}.json" > "$out/throughput_$part${TAG:-}.md" 2> "$out/throughput_$part${TAG:-}.log"
  echo "$part: rc=$?"; cat "$out/throughput_$part${TAG:-}.md"; tail -5 "$out/throughput_$part${TAG:-}.log"
done
