#!/usr/bin/env bash
# The next H200 session for issue 7, in one script (about 9 minutes; see the session note):
# 1. the GPU tests, with the new graph tests for H2O/TOVA (state planes in CUDA graphs);
# 2. re-tune compaction (its source changed: the committed entries are stale);
# 3. throughput at 32K for full, snapkv, h2o, tova (host-time work since the first run), the e2e
#    check at batch 64 and the busy fraction.
# Usage (device machine, after installing .whl as bench/gpu_tune.sh's callers do): bash bench/gpu_issue7_next.sh "$OUT"
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
timeout 150 python3 -m pytest -q -x tests/runtime/test_gpu_graphs.py tests/runtime/test_gpu_compiled.py \
  tests/runtime/test_gpu_engine.py > "$out/gpu_tests.log" 2>&1
echo "gpu tests: rc=$? $(tail -1 "$out/gpu_tests.log")"
timeout 60 python3 -m kvc.runtime.cli tune --model random:qwen3-30b-a3b --dtype bfloat16 --effort quick \
  --kernels compaction --out "$out/tune_compaction.json" > "$out/tune_compaction.log" 2>&1
echo "tune compaction: rc=$?"; cp -r kernels_generated/tuned "$out/"
METHODS=full,snapkv PART_TIMEOUT=100 bash bench/gpu_throughput.sh "$out" window32
METHODS=h2o,tova STEPS=8 TAG=_h2o_tova PART_TIMEOUT=120 bash bench/gpu_throughput.sh "$out" window32
PART_TIMEOUT=200 bash bench/gpu_throughput.sh "$out" e2e
