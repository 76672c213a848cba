#!/usr/bin/env bash
# Issue 7 on the H200, session 6, in one call on two GPUs (`nvidia-h200-x2`, under 10 minutes): every
# method's ratio at 32K and at 128K, random-weight Qwen3-30B-A3B in bf16, 60 GiB of KV, output 2048.
#  lane 0 (GPU 0): (t) the GPU tests of graphs, compiled methods and the engine;
#                  (a) 32K, all seven methods, 8-source windows;
#                  (i) 32K, full + the decode-time evictions with --evict-interval 16, when the CLI has it.
#  lane 1 (GPU 1): (s) `kvc tune --kernels scores` (the window-score kernel `column_votes`, new to the
#                  tuner; quick effort, at most 6 candidates a bucket), then its cache file is kept;
#                  (b) 128K, all seven methods, 2-source windows (each source is a 21 s prefill).
# With one GPU (LANES="0" or "1"), the lanes run one after the other on it.
# Every bench run writes its JSON after each method (`complete: false` until it ends), so a part cut
# by its time limit keeps the methods it finished. After each part a lane repacks its scratch folder
# into $OUT/laneN.tar.gz and appends to $OUT/laneN.md (the device returns at most 8 files).
# Usage (device machine, kvc installed): bash bench/gpu_issue7_s6.sh "$OUT"
# Env: PYTHON, MODEL ('' = the embedded default model), KV_MEMORY, EXTRA (more arguments of every
# bench run, e.g. "--device cpu --attention-backend torch" to check the script on a CPU), INPUTS_A,
# INPUTS_B (input lengths of parts a and b), SOURCES_A, SOURCES_B, STEPS, LANES (default "0 1"),
# PARTS0 / PARTS1 (each lane's parts, default "t a i" / "s b"),
# and the limits T_TESTS, T_A, T_I, T_B, T_S (seconds).
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
py=${PYTHON:-python3}
model=${MODEL-random:qwen3-30b-a3b}
model_args=(); [ -n "$model" ] && model_args=(--model "$model")
read -r -a extra <<< "${EXTRA:-}"
all=${METHODS:-full,streamingllm,snapkv,pyramidkv,h2o,tova,adakv}
common=("${model_args[@]+"${model_args[@]}"}" --dtype "${DTYPE:-bfloat16}" --kv-memory "${KV_MEMORY:-60GiB}"
        --output "${OUTPUT_LEN:-2048}" --steps "${STEPS:-32}" --no-progress "${extra[@]+"${extra[@]}"}")

lane() {  # lane number, then its parts
  local n=$1; shift
  local work; work=$(mktemp -d "${TMPDIR:-/tmp}/kvc_s6_$n.XXXXXX")
  local summary=$out/lane$n.md
  { echo "# issue 7, session 6, lane $n: $(date -u +%FT%TZ), kvc $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed -n "$((n + 1))p"; echo; } > "$summary"
  note() {  # part name, exit status, table, log
    { echo "## $1: rc=$2"; echo; [ -f "$3" ] && cat "$3"; echo; echo '```'; tail -n 12 "$4"; echo '```'; echo; } >> "$summary"
    tar czf "$out/lane$n.tar.gz.tmp" -C "$work" . && mv "$out/lane$n.tar.gz.tmp" "$out/lane$n.tar.gz"
  }
  bench() {  # part name, time limit, arguments of `kvc bench throughput`
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$py" -m kvc.runtime.cli bench throughput "${common[@]}" "$@" --out "$work/$name.json" \
      > "$work/$name.md" 2> "$work/$name.log"
    note "$name" $? "$work/$name.md" "$work/$name.log"
  }
  for part in "$@"; do
    case $part in
      t) timeout "${T_TESTS:-110}" "$py" -m pytest -q tests/runtime/test_gpu_graphs.py tests/runtime/test_gpu_compiled.py \
           tests/runtime/test_gpu_engine.py > "$work/gpu_tests.log" 2>&1
         note gpu_tests $? "" "$work/gpu_tests.log" ;;
      s) timeout "${T_S:-100}" "$py" -m kvc.runtime.cli tune "${model_args[@]+"${model_args[@]}"}" \
           --dtype "${DTYPE:-bfloat16}" --effort quick --kernels scores --max-candidates 6 \
           --out "$work/tune_scores.json" > "$work/tune_scores.log" 2>&1
         rc=$?; cp -r kernels_generated/tuned "$work/"
         note tune_scores "$rc" "" "$work/tune_scores.log" ;;
      a) bench window32_all "${T_A:-300}" --methods "$all" --inputs "${INPUTS_A:-32768}" --sources "${SOURCES_A:-8}" ;;
      i) if "$py" -m kvc.runtime.cli bench throughput --help 2>/dev/null | grep -q -- --evict-interval; then
           bench window32_interval16 "${T_I:-150}" --methods full,streamingllm,h2o,tova --inputs "${INPUTS_A:-32768}" \
             --sources 4 --evict-interval 16
         else echo "## window32_interval16: skipped (no --evict-interval)" >> "$summary"; fi ;;
      b) bench window128_all "${T_B:-460}" --methods "$all" --inputs "${INPUTS_B:-131072}" --sources "${SOURCES_B:-2}" ;;
      *) echo "unknown part $part" >> "$summary" ;;
    esac
  done
  rm -rf "$work"
}

read -r -a lanes <<< "${LANES:-0 1}"
if [ "${#lanes[@]}" -gt 1 ]; then
  CUDA_VISIBLE_DEVICES=0 lane 0 ${PARTS0:-t a i} &
  CUDA_VISIBLE_DEVICES=1 lane 1 ${PARTS1:-s b} &
  wait
else
  lane "${lanes[0]}" ${PARTS0:-t a i} ${PARTS1:-s b}
fi
echo "== $out: $(ls "$out" | tr '\n' ' ')"
