#!/usr/bin/env bash
# GPU figures for the generated kernels (issues 4 and 7), in two calls of under 10 minutes:
#   bash bench/gpu_kernels.sh tests "$OUT"   # GPU tests + paged attention regression + decode stats
#   bash bench/gpu_kernels.sh kernels "$OUT" # compaction + SnapKV prefill-end breakdown + fused MoE
# Run on the device machine from the repo root; writes JSON and logs under $OUT.
set -u
part=${1:?tests|kernels}; out=${2:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # lark etc. (the GPU image lacks them)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  date -u; } 2>&1 | tee "$out/env.txt"
if [ "$part" = tests ]; then
  timeout 260 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_gpu_compiled.py tests/runtime/test_gpu_engine.py \
    tests/kernels tests/models 2>&1 | tail -15 | tee "$out/tests.txt"
  timeout 120 python3 bench/attention_bench.py --no-prefill --out "$out/attention.json" 2>&1 | tail -14
  timeout 120 python3 bench/decode_stats_bench.py --out "$out/decode_stats.json" 2>&1 | tail -20
else
  timeout 100 python3 bench/attention_bench.py --no-prefill --out "$out/attention.json" 2>&1 | tail -12
  timeout 200 python3 bench/compaction_bench.py --out "$out/compaction.json" 2>&1 | tail -25
  timeout 300 python3 bench/moe_bench.py --e2e --e2e-layers 12 --out "$out/moe.json" 2>&1 | tail -30
fi
