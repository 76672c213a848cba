#!/usr/bin/env bash
# One GPU call for issue 5: `kvc bench serve` against `kvc serve` (random-weight Qwen3-8B, bf16,
# method full) on one GPU, then SIGTERM (the drain must exit 0).
# Usage on the device machine (repo root): bash bench/gpu_issue5.sh "$OUT"
# Writes $OUT/{env.txt, server.log, metrics.txt, <run>.json, table.md}; prints table.md.
set -u
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # fastapi, uvicorn, pydantic, ... (the GPU image lacks them)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers, fastapi, uvicorn; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__)'
  date -u; } 2>&1 | tee "$out/env.txt"

port=8765
url=http://127.0.0.1:$port
kvc=(python3 -m kvc.runtime.cli)
model=${KVC_BENCH_MODEL:-random:qwen3-8b}  # overridable for a dry run on CPU
device=${KVC_BENCH_DEVICE:-cuda}
"${kvc[@]}" -v serve --model "$model" --device "$device" --port $port --max-model-len "${KVC_BENCH_MAX_LEN:-8192}" \
  --served-model-name qwen3-8b-random --shutdown-timeout 10 >"$out/server.log" 2>&1 &
pid=$!
up=0
for _ in $(seq 300); do
  if python3 -c "import httpx,sys; sys.exit(httpx.get('$url/health', timeout=1).status_code != 200)" 2>/dev/null; then
    up=1; break
  fi
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
if [ $up != 1 ]; then
  echo "server did not come up"; tail -30 "$out/server.log"; kill -9 $pid 2>/dev/null; exit 1
fi
echo "server up after ${SECONDS}s"

bench() {  # name, then kvc bench serve arguments
  local name=$1; shift
  echo "== $name: $*"
  timeout 200 "${kvc[@]}" bench serve --base-url "$url" --no-progress --result-file "$out/$name.json" "$@" \
    2>&1 | tail -3
}
# warm-up (CUDA graphs, allocator), not recorded
timeout 60 "${kvc[@]}" bench serve --base-url "$url" --no-progress --num-prompts 16 --input-len 256 \
  --output-len 16 >/dev/null 2>&1
bench random_c64 --num-prompts 256 --input-len 1024 --output-len 128 --range-ratio 0.25 --max-concurrency 64
bench random_rate8 --num-prompts 160 --input-len 1024 --output-len 128 --range-ratio 0.25 --request-rate 8
bench multi_turn_c32 --dataset multi-turn --num-prompts 32 --num-turns 4 --input-len 512 --output-len 64 \
  --max-concurrency 32
python3 -c "import httpx; print(httpx.get('$url/metrics').text)" | grep -v '^#' >"$out/metrics.txt"

t0=$SECONDS
kill -TERM $pid
for _ in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
kill -0 $pid 2>/dev/null && { echo "still running 60 s after SIGTERM: killing"; kill -9 $pid; }
wait $pid; rc=$?
echo "SIGTERM: exit code $rc after $((SECONDS - t0)) s" | tee "$out/sigterm.txt"

python3 - "$out" <<'EOF' | tee "$out/table.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = [(p.stem, json.loads(p.read_text())) for p in sorted(out.glob("*.json"))]
rows = [("requests ok / failed", lambda r: f"{r['completed']} / {r['failed']}"),
        ("duration s", lambda r: f"{r['duration_s']:.1f}"),
        ("input / output tokens", lambda r: f"{r['total_input_tokens']} / {r['total_output_tokens']}"),
        ("request throughput req/s", lambda r: f"{r['request_throughput']:.2f}"),
        ("output throughput tok/s", lambda r: f"{r['output_throughput']:.0f}"),
        ("total token throughput tok/s", lambda r: f"{r['total_token_throughput']:.0f}")]
for key, label in [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")]:
    rows.append((f"{label} ms mean / median / p99",
                 lambda r, k=key: f"{r[f'mean_{k}_ms']:.1f} / {r[f'median_{k}_ms']:.1f} / {r[f'p99_{k}_ms']:.1f}"))
print("| metric | " + " | ".join(name for name, _ in runs) + " |")
print("|---|" + "---|" * len(runs))
for label, fmt in rows:
    print(f"| {label} | " + " | ".join(fmt(r) for _, r in runs) + " |")
for name, r in runs:
    if r.get("errors"):
        print(f"\n{name} errors: {r['errors']}")
EOF
grep -E '^kvc:(prefix_cache_hit_rate|num_preemptions_total|kv_pages_total|engine_steps_total)' "$out/metrics.txt"
