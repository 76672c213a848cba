#!/usr/bin/env bash
# Issue 6: agent-trace replay, chains vs no chains, for `full` and `snapkv` (budget 8192), on a
# random-weight Qwen3-8B served by `kvc serve`. Sessions of long tool results (2K-8K tokens) and
# short answers; every turn resends the whole conversation.
# Usage (repo root, device machine): bash bench/gpu_agent.sh "$OUT"   (carry .whl)
# Env for a CPU dry run: KVC_BENCH_MODEL, KVC_BENCH_DEVICE, AGENT_ARGS, KVC_BENCH_MAX_LEN.
set -u
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import fastapi, lark" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  date -u; } 2>&1 | tee "$out/env.txt"
kvc=(python3 -m kvc.runtime.cli)
model=(--model "${KVC_BENCH_MODEL:-random:qwen3-8b}"); [ "${KVC_BENCH_MODEL:-}" = default ] && model=()  # the embedded model
device=${KVC_BENCH_DEVICE:-cuda}
agent=(${AGENT_ARGS:---num-prompts 16 --num-turns 4 --input-len 512 --output-len 32 --max-concurrency 16})
port=8766; url=http://127.0.0.1:$port
for method in full snapkv; do
  params=(); [ $method = snapkv ] && params=(--method-param budget=8192)
  "${kvc[@]}" serve "${model[@]}" --device "$device" --port $port --method $method "${params[@]}" \
    --max-model-len "${KVC_BENCH_MAX_LEN:-40960}" --served-model-name qwen3-8b-random >"$out/server_$method.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('$url/health', timeout=1).status_code != 200)" 2>/dev/null && break
    kill -0 $pid 2>/dev/null || break; sleep 1
  done
  for mode in plain chains; do
    flag=(); [ $mode = chains ] && flag=(--chains)
    echo "== $method $mode"
    timeout 200 "${kvc[@]}" bench serve --base-url "$url" --no-progress --dataset agent "${agent[@]}" "${flag[@]}" \
      --result-file "$out/agent_${method}_${mode}.json" 2>&1 | tail -4
  done
  kill -TERM $pid; wait $pid
done
python3 - "$out" <<'PY' | tee "$out/table.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| method | chains | duration s | sessions ok | prompt tokens | prefilled tokens | mean session s | TTFT per turn ms |")
print("|---|---|---|---|---|---|---|---|")
for p in sorted(out.glob("agent_*.json")):
    r = json.loads(p.read_text()); a = r["agent"]
    _, method, mode = p.stem.split("_")
    ttft = " / ".join(f"{t:.0f}" for t in a["per_turn"]["mean_ttft_ms"])
    print(f"| {method} | {mode} | {r['duration_s']:.1f} | {a['sessions_completed']} | {a['total_prompt_tokens']} | "
          f"{a['total_prefilled_tokens']} | {a['mean_session_e2e_s']:.2f} | {ttft} |")
PY
