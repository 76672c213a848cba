"""`kvc bench serve` loads against a `kvc serve` this script starts: wait for /health, an unrecorded
warm-up load, each load's JSON (OUT/NAME.json), optionally the server's /metrics, then SIGTERM (the
drain must exit 0) and a markdown table of the loads (OUT/table[_PREFIX].md, also printed).

    python bench/serve_loads.py --out OUT --serve="--model random:qwen3-8b --device cuda --max-model-len 8192" \\
        --warmup="--num-prompts 16 --input-len 256 --output-len 16" \\
        --load "random_c64=--num-prompts 256 --input-len 1024 --output-len 128 --max-concurrency 64" --metrics

Loads of `--dataset agent` get the agent table (sessions, prompt and prefilled tokens, TTFT per turn);
others the request metrics (throughput, TTFT, TPOT, ITL, E2E). Exit code 0 when the server came up,
every load exited 0 and the server exited 0 after SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

KVC = [sys.executable, "-m", "kvc.runtime.cli"]
METRICS = ("kvc:prefix_cache_hit_rate", "kvc:num_preemptions_total", "kvc:kv_pages_total", "kvc:engine_steps_total")


def wait_for_health(url: str, server: subprocess.Popen, seconds: float) -> bool:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            return False
        time.sleep(1)
    return False


def bench(url: str, args: list[str], timeout: float, result: Path | None = None) -> tuple[int, str]:
    argv = [*KVC, "bench", "serve", "--base-url", url, "--no-progress", *args]
    if result is not None:
        argv += ["--result-file", str(result)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g} s"
    return done.returncode, (done.stdout + done.stderr).strip()


def request_table(runs: list[tuple[str, dict]]) -> str:
    rows = [("requests ok / failed", lambda r: f"{r['completed']} / {r['failed']}"),
            ("duration s", lambda r: f"{r['duration_s']:.1f}"),
            ("input / output tokens", lambda r: f"{r['total_input_tokens']} / {r['total_output_tokens']}"),
            ("request throughput req/s", lambda r: f"{r['request_throughput']:.2f}"),
            ("output throughput tok/s", lambda r: f"{r['output_throughput']:.0f}"),
            ("total token throughput tok/s", lambda r: f"{r['total_token_throughput']:.0f}")]
    for key, label in [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")]:
        rows.append((f"{label} ms mean / median / p99",
                     lambda r, k=key: f"{r[f'mean_{k}_ms']:.1f} / {r[f'median_{k}_ms']:.1f} / {r[f'p99_{k}_ms']:.1f}"))
    lines = ["| metric | " + " | ".join(name for name, _ in runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(fmt(r) for _, r in runs) + " |" for label, fmt in rows]
    lines += [f"\n{name} errors: {r['errors']}" for name, r in runs if r.get("errors")]
    return "\n".join(lines)


def agent_table(runs: list[tuple[str, dict]]) -> str:
    lines = ["| load | duration s | sessions ok | prompt tokens | prefilled tokens | mean session s "
             "| TTFT per turn ms |", "|---|---|---|---|---|---|---|"]
    for name, r in runs:
        a = r["agent"]
        ttft = " / ".join(f"{t:.0f}" for t in a["per_turn"]["mean_ttft_ms"])
        lines.append(f"| {name} | {r['duration_s']:.1f} | {a['sessions_completed']} | {a['total_prompt_tokens']} | "
                     f"{a['total_prefilled_tokens']} | {a['mean_session_e2e_s']:.2f} | {ttft} |")
    return "\n".join(lines)


def stop(server: subprocess.Popen, wait: float) -> tuple[int, float]:
    """SIGTERM, then SIGKILL after `wait` seconds; the exit code and the seconds it took."""
    start = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        print(f"still running {wait:g} s after SIGTERM: killing")
        server.kill()
        rc = server.wait()
    return rc, time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the loads' JSON, the server log and the table")
    p.add_argument("--serve", required=True, help="`kvc serve` arguments, one string (--port is added)")
    p.add_argument("--load", action="append", required=True, metavar="NAME=ARGS",
                   help="a recorded `kvc bench serve` load (repeatable), its JSON OUT/NAME.json")
    p.add_argument("--warmup", help="`kvc bench serve` arguments of an unrecorded warm-up load")
    p.add_argument("--prefix", default="", help="names this server's log and table (several servers, one folder)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--verbose-server", action="store_true", help="start the server with `kvc -v`")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--load-timeout", type=float, default=200)
    p.add_argument("--metrics", action="store_true", help="save the server's /metrics after the loads")
    p.add_argument("--sigterm-wait", type=float, default=60, help="seconds the drain may take after SIGTERM")
    a = p.parse_args()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{a.prefix}" if a.prefix else ""
    url = f"http://127.0.0.1:{a.port}"
    loads = []
    for item in a.load:
        name, eq, args = item.partition("=")
        if not eq or not name:
            p.error(f"--load takes NAME=ARGS, got {item!r}")
        loads.append((name, shlex.split(args)))
    argv = [*KVC, *(["-v"] if a.verbose_server else []), "serve", *shlex.split(a.serve), "--port", str(a.port)]
    log = out / f"server{tag}.log"
    with open(log, "w") as log_file:
        server = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    start = time.monotonic()
    try:
        if not wait_for_health(url, server, a.startup_timeout):
            print("server did not come up; its log ends:\n" + "\n".join(log.read_text().splitlines()[-30:]))
            return 1
        print(f"server up after {time.monotonic() - start:.0f} s")
        if a.warmup:
            rc, _ = bench(url, shlex.split(a.warmup), 60)
            print(f"warm-up: rc={rc}")
        failed = False
        for name, args in loads:
            print(f"== {name}: {shlex.join(args)}")
            rc, text = bench(url, args, a.load_timeout, out / f"{name}.json")
            failed |= rc != 0
            print(f"rc={rc}\n" + "\n".join(text.splitlines()[-3:]))
        if a.metrics:
            import httpx

            text = httpx.get(f"{url}/metrics", timeout=10).text
            lines = [line for line in text.splitlines() if not line.startswith("#")]
            (out / f"metrics{tag}.txt").write_text("\n".join(lines) + "\n")
            print("\n".join(line for line in lines if line.startswith(METRICS)))
    finally:
        if server.poll() is None:
            rc, seconds = stop(server, a.sigterm_wait)
            note = f"SIGTERM: exit code {rc} after {seconds:.0f} s"
            (out / f"sigterm{tag}.txt").write_text(note + "\n")
            print(note)
            failed_stop = rc != 0
        else:
            failed_stop = True
    runs = [(name, json.loads((out / f"{name}.json").read_text())) for name, _ in loads
            if (out / f"{name}.json").exists()]
    if runs:
        table = agent_table(runs) if all("agent" in r for _, r in runs) else request_table(runs)
        (out / f"table{tag}.md").write_text(table + "\n")
        print(table)
    return 1 if failed or failed_stop or len(runs) < len(loads) else 0


if __name__ == "__main__":
    sys.exit(main())
