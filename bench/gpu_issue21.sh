#!/usr/bin/env bash
# Decode-time eviction on the H200: the GPU tests (decode graphs of H2O, TOVA, R-KV, StreamingLLM and SnapKV with a
# decode budget: eviction in place, positions and query windows written inside them),
# one layer's eviction in order against in place (`micro`, bench/evict_in_place_bench.py), and decode throughput
# of per-step eviction against SnapKV and full at 32K / 128K (random-weight Qwen3-30B-A3B, bf16, 60 GiB of KV,
# full in the same run), with a profile of the decode windows (`--busy`) where BUSY=1.
# `fill`: one layer's in-place fill, torch against the one-launch Triton kernel (bench/fill_kernel.py).
# Usage (device machine): bash bench/gpu_issue21.sh "$OUT" "tests micro fill window32 window128"
# METHODS (default full,snapkv,streamingllm,h2o,tova) picks the throughput parts' methods; EXTRA adds options.
# `budget32` / `budget128`: full against SnapKV with a constant decode budget (snapkv:every=$EVERY, default 16;
# BUDGET_METHOD=adakv or pyramidkv for theirs).
set -uo pipefail
out=${1:?output folder}; parts=${2:-tests micro window32 window128}
methods=${METHODS:-full,snapkv,streamingllm,h2o,tova}
common=(--model random:qwen3-30b-a3b --dtype bfloat16 --kv-memory 60GiB --output 2048 --no-progress
        --methods "$methods")
read -ra extra <<< "${EXTRA:-}"
common+=("${extra[@]}")
[[ ${BUSY:-0} == 1 ]] && common+=(--busy --busy-batch "${BUSY_BATCH:-317}")
for part in $parts; do
  case $part in
    tests) timeout "${PART_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_graphs.py \
             > "$out/tests.log" 2>&1
           echo "tests: rc=$?"; tail -3 "$out/tests.log"; continue ;;
    micro) for shape in "--oldest" "" "--dropped 16"; do
             name=$(echo "e${shape}" | tr -d ' -')
             timeout "${PART_TIMEOUT:-120}" python3 bench/evict_in_place_bench.py --device cuda --rows 317 \
               --window 2048 $shape --out "$out/evict_$name.json" > "$out/evict_$name.log" 2>&1
             echo "micro $name: rc=$?"; grep -v Warn "$out/evict_$name.log" | tail -4
           done; continue ;;
    fill) timeout "${PART_TIMEOUT:-120}" python3 bench/fill_kernel.py --evict 1 16 256 --out "$out/fill.json" \
            > "$out/fill.log" 2>&1
          echo "fill: rc=$?"; grep -v Warn "$out/fill.log" | tail -12; continue ;;
    window32) args=(--inputs 32768 --steps "${STEPS:-32}" --sources "${SOURCES:-8}") ;;
    window128) args=(--inputs 131072 --steps "${STEPS:-32}" --sources "${SOURCES:-2}") ;;
    budget32|budget128) input=$([[ $part == budget32 ]] && echo 32768 || echo 131072)
      bm=${BUDGET_METHOD:-snapkv}
      timeout "${PART_TIMEOUT:-500}" python3 -m kvc.runtime.cli bench throughput "${common[@]/$methods/full,$bm}" \
        --inputs "$input" --steps "${STEPS:-32}" --sources "${SOURCES:-4}" --method-params "$bm:every=${EVERY:-16}" \
        --out "$out/throughput_$part.json" > "$out/throughput_$part.md" 2> "$out/throughput_$part.log"
      echo "$part: rc=$?"; cat "$out/throughput_$part.md"; grep -v Warn "$out/throughput_$part.log" | tail -5
      continue ;;
    *) echo "unknown part $part"; continue ;;
  esac
  timeout "${PART_TIMEOUT:-500}" python3 -m kvc.runtime.cli bench throughput "${common[@]}" "${args[@]}" \
    --out "$out/throughput_$part.json" > "$out/throughput_$part.md" 2> "$out/throughput_$part.log"
  echo "$part: rc=$?"; cat "$out/throughput_$part.md"; grep -v Warn "$out/throughput_$part.log" | tail -5
done
