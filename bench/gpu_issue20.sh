#!/usr/bin/env bash
# Quantized KV on the H200: the GPU tests of KIVI, FP8 and TurboQuant (the generated kernels compiled for real),
# the decode kernel's bandwidth over the bytes it reads, prefill attention over stored codes (`prefill`), and
# decode throughput against full at 32K
# and 128K (random-weight Qwen3-30B-A3B, bf16, 60 GiB of KV, full in the same run).
# Usage (device machine): bash bench/gpu_issue20.sh "$OUT" "tests micro window32 window128"
# (`deltamicro`: DeltaKV's decode kernel against plain over as many dense tokens, bench/delta_decode_bench.py)
# METHODS (default full,kivi,fp8,turboquant) picks the methods of the throughput parts (deltakv: untrained inputs of
# the model's shape, bench/delta_inputs.py, unless EXTRA gives --method-inputs); EXTRA adds options.
set -uo pipefail
out=${1:?output folder}; parts=${2:-tests micro window32 window128}
methods=${METHODS:-full,kivi,fp8,turboquant}
common=(--model random:qwen3-30b-a3b --dtype bfloat16 --kv-memory 60GiB --output 2048 --no-progress
        --methods "$methods")
read -ra extra <<< "${EXTRA:-}"
common+=("${extra[@]}")
# deltakv on the random model: untrained compressor inputs of its shape (speed does not depend on them)
if [[ ,$methods, == *,deltakv,* && " ${EXTRA:-} " != *" --method-inputs "* ]]; then
  python3 bench/delta_inputs.py --model random:qwen3-30b-a3b --out /tmp/deltakv-inputs/deltakv.safetensors > /dev/null
  common+=(--method-inputs /tmp/deltakv-inputs)
fi
for part in $parts; do
  case $part in
    tests) timeout "${PART_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/methods/test_kivi.py \
             tests/methods/test_fp8.py tests/methods/test_turboquant.py tests/methods/test_deltakv.py \
             tests/kernels/test_delta_decode.py -k "triton or sm90 or graph or prefix or register" > "$out/tests.log" 2>&1
           echo "tests: rc=$?"; tail -3 "$out/tests.log"
           timeout "${PART_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_spec_triton.py \
             tests/kernels/test_quantized_decode_fast.py > "$out/tests_kernels.log" 2>&1
           echo "kernel tests: rc=$?"; tail -3 "$out/tests_kernels.log"; continue ;;
    micro) for m in ${MICRO:-kivi fp8 turboquant}; do
             timeout "${PART_TIMEOUT:-120}" python3 bench/quantized_decode_bench.py --method "$m" --sweep \
               --shapes 32x32768,8x131072 --out "$out/${m}_decode.json" > "$out/${m}_decode.log" 2>&1
             echo "micro $m: rc=$?"; grep -v Warn "$out/${m}_decode.log" | tail -20
           done; continue ;;
    deltamicro) timeout "${PART_TIMEOUT:-150}" python3 bench/delta_decode_bench.py --out "$out/delta_decode.json" \
                  > "$out/delta_decode.log" 2>&1
                echo "deltamicro: rc=$?"; grep -v Warn "$out/delta_decode.log" | tail -8; continue ;;
    prefill) for m in ${MICRO:-kivi fp8 turboquant}; do
             timeout "${PART_TIMEOUT:-150}" python3 bench/quantized_prefill_bench.py --method "$m" --sweep \
               --contexts 32768,131072 --out "$out/${m}_prefill.json" > "$out/${m}_prefill.log" 2>&1
             echo "prefill $m: rc=$?"; grep -v Warn "$out/${m}_prefill.log" | tail -20
           done; continue ;;
    window32) args=(--inputs 32768 --steps "${STEPS:-32}") ;;
    window128) args=(--inputs 131072 --steps "${STEPS:-32}") ;;
    *) echo "unknown part $part"; continue ;;
  esac
  timeout "${PART_TIMEOUT:-280}" python3 -m kvc.runtime.cli bench throughput "${common[@]}" "${args[@]}" \
    --out "$out/throughput_$part.json" > "$out/throughput_$part.md" 2> "$out/throughput_$part.log"
  echo "$part: rc=$?"; cat "$out/throughput_$part.md"; grep -v Warn "$out/throughput_$part.log" | tail -5
done
