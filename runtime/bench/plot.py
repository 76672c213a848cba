"""`kvc bench plot RESULT.json`: the PNG of a throughput result, rendered from the JSON alone (so it
runs anywhere, the GPU run only writes JSON). Bars of decode tokens/s per method, grouped by input
length (decode-window rows), each annotated with its batch and its ratio to `full` at that input.
matplotlib is the optional `bench` extra: without it, a clear error says how to install it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvc.runtime.errors import KvcError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise KvcError("plotting needs matplotlib: pip install 'kvc[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def load_result(path: str | Path) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except OSError as e:
        raise KvcError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise KvcError(f"{path}:{e.lineno}:{e.colno}: not a JSON result: {e.msg}") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise KvcError(f"{path} is not a `kvc bench throughput` result (no rows)")
    return result


def render(result: dict, out: str | Path) -> Path:
    """Writes the bar chart of `result` to `out` (PNG); returns the path."""
    plt = _pyplot()
    rows = [r for r in result["rows"] if r.get("mode") == "decode_window" and r.get("decode_tok_s")]
    if not rows:
        raise KvcError("the result has no measured decode-window rows to plot")
    inputs = sorted({r["input_len"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ratios = result.get("ratios_vs_full", {})
    width = 0.8 / len(methods)
    labelled: set[str] = set()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(methods) * len(inputs)), 4.8))
    for i, method in enumerate(methods):
        for j, input_len in enumerate(inputs):
            row = next((r for r in rows if r["method"] == method and r["input_len"] == input_len), None)
            if row is None:
                continue
            x = j + (i - (len(methods) - 1) / 2) * width
            ax.bar(x, row["decode_tok_s"], width, color=f"C{i}", label=None if method in labelled else method)
            labelled.add(method)
            ratio = ratios.get(str(input_len), {}).get(method, {}).get("decode_tok_s")
            note = f"B={row['batch']}" + ("" if ratio is None else f"\n{ratio:.1f}x")
            ax.annotate(note, (x, row["decode_tok_s"]), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(inputs)), [f"{n // 1024}K input" if n % 1024 == 0 else f"{n} input" for n in inputs])
    ax.set_ylabel("decode tokens/s")
    mib = result.get("kv_memory_bytes", 0) / 2**30
    ax.set_title(f"{result.get('model', '?')} on {result.get('device', '?')}: largest batch in {mib:.1f} GiB of KV, "
                 f"output {result.get('output_len', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
