#!/usr/bin/env bash
# Issue 7 on the H200, session 5, in one call (about 9 minutes): per-kernel GPU profiles to explain
# the e2e vs decode-window gap and PyramidKV's step, random-weight Qwen3-30B-A3B in bf16, 60 GiB of KV.
#  (a) re-tune compaction (quick), as bench/gpu_issue7_next.sh does;
#  (b) snapkv at 32K: decode window, again at the e2e batch (64), and 64 real prompts end to end,
#      both windows profiled at batch 64 (--busy: busy fraction, host gap per step, top kernels);
#  (c) pyramidkv and snapkv decode windows at 32K, 16 steps, profiled at their whole batch;
#  (d) h2o and tova decode windows at 32K, 8 steps (eager per-step compaction may be slow);
#  (w) full and snapkv decode windows at 32K, 32 steps (the acceptance's 32K ratio); (x) the same at 128K.
# Next session (faithful windows: --sources, mixed layers): (t) GPU tests + the MoE align bench;
#  (e) the e2e check in one run with an 8-source window; (f) full, snapkv, pyramidkv, adakv at 32K with
#  8 sources, each profiled at its own batch; (g) full, snapkv at 128K with 4 sources; (h) streamingllm, h2o, tova at 32K (8 steps).
#  Suggested calls: PARTS="t e", then PARTS="f h", then PARTS="g" (each under 10 minutes).
# Each part runs under `timeout` and writes into a scratch folder; after each part $OUT is repacked
# (the device returns at most 8 files): results.tar.gz (every log, JSON, markdown table and the tuned
# cache) and summary.md (each part's exit status, tables and last log lines). A call cut short
# still returns the parts that finished.
# Usage (device machine, kvc installed): bash bench/gpu_issue7_s5.sh "$OUT"
# Env, to check the script on a CPU: MODEL ('' = the embedded default model), DTYPE, KV_MEMORY,
# INPUT, OUTPUT_LEN, E2E_BATCH, E2E_STEPS, EXTRA (more arguments of every bench run, e.g.
# "--device cpu --attention-backend torch"), PYTHON, PARTS (default "a b c d"; w on demand), and per-part limits
# TUNE_TIMEOUT, E2E_TIMEOUT, PROFILE_TIMEOUT, EAGER_TIMEOUT (seconds).
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/kvc_s5.XXXXXX")
py=${PYTHON:-python3}
model=${MODEL-random:qwen3-30b-a3b}
dtype=${DTYPE:-bfloat16}
model_args=(); [ -n "$model" ] && model_args=(--model "$model")
read -r -a extra <<< "${EXTRA:-}"
common=("${model_args[@]+"${model_args[@]}"}" --dtype "$dtype" --kv-memory "${KV_MEMORY:-60GiB}"
        --inputs "${INPUT:-32768}" --output "${OUTPUT_LEN:-2048}" --no-progress "${extra[@]+"${extra[@]}"}")
summary=$work/summary.md
{ echo "# issue 7, session 5: $(date -u +%FT%TZ), kvc $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  echo; } > "$summary"

pack() {  # $OUT <- results.tar.gz of the scratch folder + summary.md (written aside, then moved)
  tar czf "$out/results.tar.gz.tmp" -C "$work" . && mv "$out/results.tar.gz.tmp" "$out/results.tar.gz"
  cp "$summary" "$out/summary.md"
}

note() {  # part name, its exit status, its table (markdown) and log files
  local name=$1 rc=$2 table=$3 log=$4
  { echo "## $name: rc=$rc"; echo; [ -n "$table" ] && cat "$table"; echo; echo '```'; tail -n 6 "$log"; echo '```'
    echo; } >> "$summary"
  echo "== $name: rc=$rc"; [ -n "$table" ] && cat "$table"; tail -n 6 "$log"
  pack
}

bench() {  # name, time limit, arguments of `kvc bench throughput`
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$py" -m kvc.runtime.cli bench throughput "${common[@]}" "$@" --out "$work/$name.json" \
    > "$work/$name.md" 2> "$work/$name.log"
  note "$name" $? "$work/$name.md" "$work/$name.log"
}

for part in ${PARTS:-a b c d}; do
  case $part in
    a) timeout "${TUNE_TIMEOUT:-60}" "$py" -m kvc.runtime.cli tune "${model_args[@]+"${model_args[@]}"}" \
         --dtype "$dtype" --effort quick --kernels compaction --out "$work/tune_compaction.json" \
         > "$work/tune_compaction.log" 2>&1
       rc=$?; cp -r kernels_generated/tuned "$work/" 2>/dev/null
       note tune_compaction "$rc" "" "$work/tune_compaction.log" ;;
    b) bench e2e32_snapkv "${E2E_TIMEOUT:-250}" --methods snapkv --steps "${E2E_STEPS:-32}" --e2e \
         --e2e-batch "${E2E_BATCH:-64}" --busy --busy-batch "${E2E_BATCH:-64}" ;;
    t) timeout "${TEST_TIMEOUT:-200}" "$py" -m pytest -q tests/runtime/test_gpu_graphs.py tests/runtime/test_gpu_compiled.py \
         tests/runtime/test_gpu_engine.py tests/kernels/test_moe_triton.py > "$work/gpu_tests.log" 2>&1
       rc=$?; timeout 60 "$py" bench/moe_align_bench.py --out "$work/moe_align.json" > "$work/moe_align.md" 2>&1
       note gpu_tests "$rc" "$work/moe_align.md" "$work/gpu_tests.log" ;;
    e) bench e2e32_sources8 "${E2E_TIMEOUT:-330}" --methods snapkv --steps 32 --sources 8 --e2e \
         --e2e-batch "${E2E_BATCH:-64}" --busy --busy-batch "${E2E_BATCH:-64}" ;;
    f) bench window32_sources8 "${WINDOW_TIMEOUT:-240}" --methods full,snapkv,pyramidkv,adakv --steps 32 --sources 8 \
         --busy --busy-batch 1024 ;;
    g) bench window128_sources4 "${WINDOW_TIMEOUT:-300}" --methods "${G_METHODS:-full,snapkv}" --steps 32 --sources 4 \
         --inputs 131072 ;;
    h) bench window32_eviction "${EAGER_TIMEOUT:-240}" --methods streamingllm,h2o,tova --steps 8 --sources 8 ;;
    w) bench window32 "${WINDOW_TIMEOUT:-100}" --methods full,snapkv --steps 32 ;;
    x) bench window128 "${WINDOW_TIMEOUT:-100}" --methods full,snapkv --steps 32 --inputs 131072 ;;
    c) bench window32_profile "${PROFILE_TIMEOUT:-120}" --methods pyramidkv,snapkv --steps 16 --busy \
         --busy-batch 1024 ;;
    d) bench window32_h2o_tova "${EAGER_TIMEOUT:-100}" --methods h2o,tova --steps 8 ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "== $out: $(ls "$out" | tr '\n' ' ')"
rm -rf "$work"
