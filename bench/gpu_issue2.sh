#!/usr/bin/env bash
# One GPU call for issue 2's figures: GPU tests, decode throughput vs HF, paged decode bandwidth.
# Usage on the device machine (repo root): bash bench/gpu_issue2.sh "$OUT"
set -u
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  date -u; } | tee "$out/env.txt"
timeout 150 python3 -m pytest -q -x tests/runtime/test_gpu_engine.py tests/kernels 2>&1 | tail -15 | tee "$out/tests.txt"
timeout 330 python3 bench/decode_throughput.py --model random:qwen3-8b --batch 1 32 --context 8192 --out "$out/decode.json" 2>&1 | grep -v Warning | tail -20
timeout 120 python3 bench/attention_bench.py --no-prefill --out "$out/attention.json" 2>&1 | tail -20
