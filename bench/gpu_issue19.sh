#!/usr/bin/env bash
# Issue 19 on the H200: Quest's GPU tests (fused page scores, graph decode) and decode throughput
# against full at 32K and 128K (random-weight Qwen3-30B-A3B, bf16, 60 GiB of KV, full in the same run).
# Usage (device machine): bash bench/gpu_issue19.sh "$OUT" "tests micro window32 window128 busy128"
# METHODS (default full,quest) picks the methods of the throughput parts; EXTRA adds options. DuoAttention's gates for
# the random-weight model are random too (seed 0, written to $OUT/inputs): with random weights only
# how many heads stream, and where, matters for speed.
set -uo pipefail
out=${1:?output folder}; parts=${2:-tests window32 window128}
mkdir -p "$out/inputs"
python3 -c "import torch, pathlib; from kvc.runtime.models.method_inputs import save_input
from kvc.runtime.models.named_configs import named_config
c = named_config('qwen3-30b-a3b')
save_input(pathlib.Path('$out/inputs/duo_attention_heads.safetensors'), 'gate',
           torch.rand(c.num_hidden_layers, c.num_key_value_heads, generator=torch.Generator().manual_seed(0)))"
methods=${METHODS:-full,quest}
common=(--model random:qwen3-30b-a3b --dtype bfloat16 --kv-memory 60GiB --output 2048 --no-progress
        --methods "$methods" --method-inputs "$out/inputs")
case ",$methods," in *,quest,*) common+=(--method-params quest:budget=4096) ;; esac
read -ra extra <<< "${EXTRA:-}"  # more throughput options, e.g. EXTRA="--evict-interval 64"
common+=("${extra[@]}")
for part in $parts; do
  case $part in
    tests) timeout "${PART_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_quest.py \
             tests/methods/test_quest.py tests/kernels/test_triton_plans.py tests/kernels/test_summary_append.py \
             tests/models/test_norm_triton.py tests/models/test_gpu_models.py tests/runtime/test_gpu_graphs.py tests/runtime/test_gpu_sparse_graphs.py tests/runtime/test_gpu_omnikv.py > "$out/tests.log" 2>&1; echo "tests: rc=$?"; tail -3 "$out/tests.log"; continue ;;
    micro) timeout "${PART_TIMEOUT:-280}" python3 bench/sparse_decode_bench.py --sweep --out "$out/sparse_decode.json" \
             > "$out/sparse_decode.log" 2>&1; echo "micro: rc=$?"; grep -v "^skip" "$out/sparse_decode.log" | tail -20; continue ;;
    busy128) timeout "${PART_TIMEOUT:-280}" python3 -m kvc.runtime.cli bench throughput "${common[@]}" --inputs 131072 \
             --steps "${STEPS:-32}" --busy --busy-batch 4 --out "$out/busy128.json" > "$out/busy128.md" 2> "$out/busy128.log"
           echo "busy128: rc=$?"; head -4 "$out/busy128.md"; continue ;;
    window32) args=(--inputs 32768 --steps "${STEPS:-32}") ;;
    window128) args=(--inputs 131072 --steps "${STEPS:-32}") ;;
    *) echo "unknown part $part"; continue ;;
  esac
  timeout "${PART_TIMEOUT:-280}" python3 -m kvc.runtime.cli bench throughput "${common[@]}" "${args[@]}" \
    --out "$out/throughput_$part.json" > "$out/throughput_$part.md" 2> "$out/throughput_$part.log"
  echo "$part: rc=$?"; cat "$out/throughput_$part.md"; tail -5 "$out/throughput_$part.log"
done
