#!/usr/bin/env bash
# Palu (low-rank K/V) on the H200: its GPU tests (the generated `lowrank` kernels compiled for real,
# decode graphs), the decode kernel against dense over the bytes the cache holds, and decode
# throughput against full at 32K and 128K (random-weight Qwen3-30B-A3B, bf16, 60 GiB of KV, full in
# the same run). The random model's projections come from its own seeded weights (`kvc calibrate
# palu --model random:... --device cuda`, the SVDs on the GPU) into $OUT/palu-inputs, one file per
# low-rank method of METHODS (NAME.safetensors for methods/NAME.kvm or a variant's NAME.kvm);
# MICRO_METHODS: the methods the kernel micro-benchmark times (default palu); EXTRA: more arguments
# for `kvc bench throughput`; CALIBRATE_PARAMS: for `kvc calibrate` (the same method parameters, e.g.
# "--method-param heads_per_group=1" with EXTRA="--method-params palu_postrope:heads_per_group=1").
# Usage (device machine): bash bench/gpu_palu.sh "$OUT" "tests micro window32 window128"
#   METHODS=full,palu,bench/variants/palu_postrope.kvm MICRO_METHODS="palu bench/variants/palu_postrope.kvm" ...
set -uo pipefail
out=${1:?output folder}; parts=${2:-tests micro window32 window128}
model=random:qwen3-30b-a3b
inputs="$out/palu-inputs"
methods=${METHODS:-full,palu}
common=(--model "$model" --dtype bfloat16 --kv-memory 60GiB --output 2048 --no-progress --methods "$methods"
        --method-inputs "$inputs")
extra=(${EXTRA:-})
for part in $parts; do
  case $part in
    tests) timeout "${PART_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/methods/test_palu.py \
             -k "triton or decode_kernel" > "$out/tests.log" 2>&1; echo "tests: rc=$?"; tail -3 "$out/tests.log"
           continue ;;
    micro) for m in ${MICRO_METHODS:-palu}; do
             name=$(basename "$m" .kvm)
             for g in ${GROUPS_MICRO:-4 1}; do  # KV heads a latent group: Palu's G-LRD (4) and M-LRD (1)
               log="$out/${name}_decode_g$g"
               timeout "${PART_TIMEOUT:-200}" python3 bench/lowrank_decode_bench.py --sweep --shapes 32x32768,8x131072 \
                 --method "$m" --method-param "heads_per_group=$g" --out "$log.json" > "$log.log" 2>&1
               echo "micro $name heads_per_group=$g: rc=$?"; grep -v Warn "$log.log" | tail -40
             done
           done; continue ;;
    window32) args=(--inputs 32768 --steps "${STEPS:-32}") ;;
    window128) args=(--inputs 131072 --steps "${STEPS:-32}") ;;
    *) echo "unknown part $part"; continue ;;
  esac
  for m in ${methods//,/ }; do
    name=$(basename "$m" .kvm)
    [[ $name == full || -f "$inputs/$name.safetensors" ]] && continue
    timeout 300 python3 -m kvc.runtime.cli calibrate "$m" --model "$model" --device cuda ${CALIBRATE_PARAMS:-} \
      --out "$inputs/$name.safetensors" > "$out/calibrate_$name.log" 2>&1
    echo "calibrate $name: rc=$?"; tail -1 "$out/calibrate_$name.log"
  done
  timeout "${PART_TIMEOUT:-280}" python3 -m kvc.runtime.cli bench throughput "${common[@]}" "${args[@]}" "${extra[@]}" \
    --out "$out/throughput_$part.json" > "$out/throughput_$part.md" 2> "$out/throughput_$part.log"
  echo "$part: rc=$?"; cat "$out/throughput_$part.md"; grep -v Warn "$out/throughput_$part.log" | tail -5
done
