#!/usr/bin/env bash
# GLM-4.7-Flash (MLA, latent KV cache) on the H200: the latent kernels' tests (compiled, against the torch ops,
# and the tiny GLM served through them), one layer's decode bandwidth and prefill (`micro`,
# bench/latent_decode_bench.py), and decode throughput of full against SnapKV@2048 and FP8 latents at 32K / 128K
# (random-weight GLM-4.7-Flash, bf16, 60 GiB of KV, full in the same run).
# Usage (device machine): bash bench/gpu_issue22.sh "$OUT" "tests micro t32 t128"
set -uo pipefail
out=${1:?output folder}; parts=${2:-tests micro t32 t128}
methods=${METHODS:-full,snapkv,fp8}
common=(--model random:glm-4.7-flash --dtype bfloat16 --kv-memory 60GiB --output 2048 --no-progress
        --methods "$methods")
read -ra extra <<< "${EXTRA:-}"
common+=("${extra[@]}")
for part in $parts; do
  case $part in
    tests) timeout "${PART_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_latent_attention.py \
             tests/models/test_glm4_moe_lite.py > "$out/tests.log" 2>&1
           echo "tests: rc=$?"; tail -3 "$out/tests.log"; continue ;;
    micro) (cd bench && timeout "${PART_TIMEOUT:-300}" python3 latent_decode_bench.py ${SWEEP:+--sweep} \
             --out "$out/latent_micro.json") > "$out/latent_micro.log" 2>&1
           echo "micro: rc=$?"; grep -v Warn "$out/latent_micro.log" | tail -40; continue ;;
    t32) args=(--inputs 32768 --steps "${STEPS:-32}" --sources "${SOURCES:-4}") ;;
    t128) args=(--inputs 131072 --steps "${STEPS:-32}" --sources "${SOURCES:-1}") ;;
    *) echo "unknown part $part"; continue ;;
  esac
  timeout "${PART_TIMEOUT:-500}" python3 -m kvc.runtime.cli bench throughput "${common[@]}" "${args[@]}" \
    --out "$out/throughput_$part.json" > "$out/throughput_$part.md" 2> "$out/throughput_$part.log"
  echo "$part: rc=$?"; cat "$out/throughput_$part.md"; grep -v Warn "$out/throughput_$part.log" | tail -8
done
