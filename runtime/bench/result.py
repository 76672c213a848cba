"""The throughput result object: where and how it was measured (header), and a markdown table.

One JSON object: `benchmark`, `date` (UTC), `command`, `device` (GPU name), `versions` (torch,
triton, transformers, python, git commit when known), `model`, `dtype`, `kv_memory_bytes`,
`page_size`, `output_len`, `steps`, `warmup`, `budget` and `budget_rule` (how each method's
parameters were set), `mode_notes`, then `rows` (per method and input: `method`, `params`,
`input_len`, `output_len`, `batch`, `pages_per_seq`, `decode_tok_s`, `step_ms`, `prefill_s`,
`ttft_s`, `mode`, `busy`, `phases`, `plan`; decode windows also `steps_ms` (each step on the host's clock) and
`slow_steps` (steps.py `slow_steps`: the median step, and the steps over twice it, a decode keep's evicting
ones); with --e2e `step_ms_at_e2e_batch` on decode windows and
`window_step_ratio` on e2e rows; with --busy `busy_profile`; or `error`) and `ratios_vs_full` (per
input, per method: decode tok/s and batch over `full`'s).

`format_table` is the run's markdown summary; `format_profiles` adds, per profiled row, its top
kernels by GPU time (`busy.py`'s `by_kernel`), so a run's stdout shows where a step's time goes.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

MODE_NOTES = {
    "decode_window": "one real request prefilled (prefill_s, ttft_s) and `sources` - 1 more, then the first cloned "
                     "in its method's post-prefill state into the rest of `batch` sequences that own copies of "
                     "its KV; each clone's every layer then takes the KV of a random source (mixed_layers: "
                     "distinct contexts, so MoE layers route like independent requests) and each clone feeds a "
                     "different next token, sampling at `temperature`; `steps` decode steps timed after `warmup`",
    "e2e": "`batch` real prompts prefilled end to end (prefill_s: all of them; ttft_s: mean), then the same "
           "decode window; window_step_ratio = its step time / the decode window's at the same batch "
           "(step_ms_at_e2e_batch: the decode window's batch cut to the e2e batch, timed unprofiled)",
}
BUDGET_RULE = ("from each method's declared parameters: `budget` (tokens) = budget; `recent` (tokens) = budget - "
               "`sink`; fractions `heavy`/`recent` of the prompt = budget/2 tokens each at the input length; "
               "--method-params override")


def versions() -> dict[str, str | None]:
    """torch, Triton, transformers and Python versions, and the git commit (`kvc bench suite` records them too)."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "python": platform.python_version(), "kvc_commit": commit()}


def commit(cwd: Path | None = None) -> str | None:
    """The checkout's short git commit, `+modified` when its tracked files differ from it (a copy of a working
    tree over older git metadata, as a device run gets), or None outside a git checkout."""
    where = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=5)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=where, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("" if clean.returncode == 0 else "+modified")


def device_name(device: str) -> str:
    """The GPU's name (torch.cuda), else `cpu (PROCESSOR)`."""
    if torch.cuda.is_available() and device != "cpu":
        index = torch.device(device).index if device.startswith("cuda:") else None
        return torch.cuda.get_device_name(index)
    return f"cpu ({platform.processor() or platform.machine()})"


def header(cfg, model: str) -> dict:
    """Everything but the rows: what ran, where, with which versions."""
    settings = asdict(cfg)
    return {
        "benchmark": "kvc bench throughput",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": device_name(cfg.device),
        "versions": versions(),
        "model": model,
        "dtype": cfg.dtype,
        "kv_memory_bytes": cfg.kv_memory,
        "page_size": cfg.page_size,
        "output_len": cfg.output_len,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "temperature": cfg.temperature,
        "budget": cfg.budget,
        "budget_rule": BUDGET_RULE,
        "mode_notes": MODE_NOTES,
        "settings": settings,
    }


def _e2e_check(row: dict) -> str:
    """The e2e check's cell: the window's step at the e2e batch, or the e2e step over it."""
    if row.get("window_step_ratio") is not None:
        return f"{row['window_step_ratio']:.2f}x window"
    if row.get("step_ms_at_e2e_batch") is not None:
        return f"{row['step_ms_at_e2e_batch']:.2f} ms @{row['e2e_batch']}"
    return "-"


def format_table(result: dict) -> str:
    """A markdown table of the rows, with the decode tok/s ratio vs full and the step over its memory floor
    (GPU runs)."""
    ratios = result.get("ratios_vs_full", {})
    lines = ["| method | input | mode | batch | pages/seq | step ms | decode tok/s | vs full | vs floor "
             "| prefill s | TTFT s | busy | e2e check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("rows", []):
        if r["mode"] == "offline":  # the whole run's rows: `format_offline`
            continue
        if r["mode"] == "mixed_window" and "error" not in r:  # every method in one batch (mixed.py)
            shares = ", ".join(f"{m} {n}" for m, n in r["shares"].items())
            vs = "-" if r.get("vs_slowest") is None else f"{r['vs_slowest']:.2f}x step of {r['slowest']}"
            lines.append(f"| {r['method']} | {r['input_len']} | mixed_window | {r['batch']} ({shares}) | - | "
                         f"{r['step_ms']:.2f} | {r['decode_tok_s']:.1f} | - | - | - | - | - | {vs} |")
            continue
        if "error" in r:
            lines.append(f"| {r['method']} | {r['input_len']} | {r['mode']} | - | - | - | - | - | - | - | - | - | "
                         f"{r['error']} |")
            continue
        ratio = ratios.get(str(r["input_len"]), {}).get(r["method"], {}).get("decode_tok_s")
        shown = "-" if ratio is None or r["mode"] != "decode_window" else f"{ratio:.2f}x"
        busy = "-" if r.get("busy") is None else f"{r['busy']:.3f} @{r['busy_batch']}"
        floor = "-" if r.get("vs_floor") is None else f"{r['vs_floor']:.2f}x"
        lines.append(f"| {r['method']} | {r['input_len']} | {r['mode']} | {r['batch']} | {r['pages_per_seq']} | "
                     f"{r['step_ms']:.2f} | {r['decode_tok_s']:.1f} | {shown} | {floor} | {r['prefill_s']:.3f} | "
                     f"{r['ttft_s']:.3f} | {busy} | {_e2e_check(r)} |")
    return "\n".join(lines)


def format_offline(result: dict) -> str:
    """A markdown table of the whole-run rows (`--requests`), with the output tok/s ratio vs full; "" without."""
    rows = [r for r in result.get("rows", []) if r["mode"] == "offline"]
    if not rows:
        return ""
    ratios = result.get("ratios_vs_full", {})
    lines = ["| method | input | output | requests | seats | output tok/s | vs full | requests/s | TTFT mean s "
             "| TTFT p99 s | prefill share | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['input_len']} | {r['output_len']} | {r['requests']} | - | - | - | - "
                         f"| - | - | - | {r['error']} |")
            continue
        ratio = ratios.get(str(r["input_len"]), {}).get(r["method"], {}).get("output_tok_s")
        lines.append(f"| {r['method']} | {r['input_len']} | {r['output_len']} | {r['requests']} | {r['batch']} | "
                     f"{r['output_tok_s']:.1f} | {'-' if ratio is None else f'{ratio:.2f}x'} | {r['requests_s']:.3f} "
                     f"| {r['ttft_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['prefill_share']:.2f} | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def format_profiles(result: dict, top: int = 12) -> str:
    """Per profiled row (a decode window's `busy_profile`, a prefill's `prefill_busy`), a heading with its busy
    fraction, per-step times and GPU launches per step, a markdown table of its `top` kernels by GPU time (the
    rest summed in one line), and its host ranges and waits; '' when no row was profiled."""
    blocks = []
    for r in result.get("rows", []):
        for key, what in (("busy_profile", f"{r['mode']}, batch {r.get('busy_batch')}"), ("prefill_busy", "prefill")):
            profile = r.get(key)
            if profile:
                blocks.append(_profile_block(f"{r['method']} @ {r['input_len']} ({what}", profile, top))
    return "\n\n".join(blocks)


def _profile_block(heading: str, profile: dict, top: int) -> str:
    steps = profile["steps"]
    lines = [f"#### {heading}, {steps} profiled steps): busy {profile['busy']:.3f}, step "
             f"{profile['window_ms_per_step']:.2f} ms = GPU {profile['gpu_ms_per_step']:.2f} ms + host gap "
             f"{profile['host_gap_ms_per_step']:.2f} ms" + _launches(profile), "",
             "| kernel | calls | calls/step | total ms | ms/step | share |", "|---|---|---|---|---|---|"]
    kernels = profile.get("by_kernel", [])
    for k in kernels[:top]:
        lines.append(f"| {_cell(k['name'])} | {k['calls']} | {k['calls'] / steps:.1f} | {k['total_ms']:.2f} | "
                     f"{k['ms_per_step']:.3f} | {100 * k['share']:.1f}% |")
    rest = kernels[top:]
    if rest:
        calls, total = sum(k["calls"] for k in rest), sum(k["total_ms"] for k in rest)
        lines.append(f"| ({len(rest)} other kernels) | {calls} | {calls / steps:.1f} | {total:.2f} | "
                     f"{total / steps:.3f} | {100 * sum(k['share'] for k in rest):.1f}% |")
    for key, what in (("host_ranges", "host range"), ("host_waits", "host wait (CUDA runtime)")):
        rows = profile.get(key)
        if rows:
            lines += ["", f"| {what} | calls | calls/step | total ms | ms/step |", "|---|---|---|---|---|"]
            lines += [f"| {_cell(h['name'])} | {h['calls']} | {h['calls'] / steps:.1f} | {h['total_ms']:.2f} | "
                      f"{h['ms_per_step']:.3f} |" for h in rows[:top]]
    return "\n".join(lines)


def _launches(profile: dict) -> str:
    """", N kernel launches + M copies per step" (profiles saved before they were counted: '')."""
    if "launches_per_step" not in profile:
        return ""
    return f", {profile['launches_per_step']:.1f} kernel launches + {profile['copies_per_step']:.1f} copies per step"


def _cell(text: str) -> str:
    """`text` safe inside a markdown table cell."""
    return text.replace("|", "\\|")
