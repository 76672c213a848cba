"""`kvc eval`'s outputs (runtime/eval/, docs/accuracy.md): the result JSON, rewritten atomically after
every cell (`complete: false` until the run ends, so an interrupted run keeps its finished cells and
a rerun with the same `--out` continues it), the markdown table, and the PNG plot of accuracy
against budget, one line per method (kvpress's dashed beside kvc's, `full` as a flat line).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from kvc.runtime.errors import ConfigError

FORMAT = 1


def header(evaluation) -> dict[str, Any]:
    """What the run measured and on what: enough to reproduce it and to refuse mixing runs."""
    import torch
    import transformers

    cfg = evaluation.cfg
    return {
        "kvc_eval": FORMAT,
        "date": datetime.date.today().isoformat(),
        "model": cfg.model or "default (SmolLM2-135M-Instruct)",
        "model_path": str(evaluation.loaded.path),
        "device": str(evaluation.device),
        "device_name": _device_name(evaluation.device),
        "dtype": str(evaluation.loaded.spec.dtype).removeprefix("torch."),
        "seed": cfg.seed,
        "cases": cfg.cases,
        "evict_interval": cfg.evict_interval,
        "tasks": {name: evaluation.tasks[name].description for name in cfg.tasks},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "kvc_commit": _commit()},
        "complete": False,
        "cells": [],
    }


def same_run(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a previous result holds cells of this run (same model, device, dtype, seed, cases,
    eviction interval; a file from before the interval was recorded ran at 1)."""
    keys = ("kvc_eval", "model_path", "device", "dtype", "seed", "cases")
    return all(old.get(k) == new.get(k) for k in keys) and old.get("evict_interval", 1) == new.get("evict_interval", 1)


def load_previous(path: Path | None, fresh: dict[str, Any]) -> dict[tuple, dict]:
    """The finished cells of an earlier, interrupted run into the same file (none if it differs);
    the file's task descriptions join `fresh["tasks"]`."""
    if path is None or not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the previous result ({err}); remove it or pick another --out",
                          param="out") from None
    if not same_run(old, fresh):
        raise ConfigError(f"{path} holds another run (model, device, dtype, seed, cases or eviction interval "
                          "differ); remove it or pick another --out", param="out")
    cells = {(c["engine"], c["method"], c["budget"], c["task"], c["length"]): c for c in old.get("cells", [])}
    if cells:  # the file's tasks stay described: a continued run may name fewer or others
        fresh["tasks"] = {**old.get("tasks", {}), **fresh["tasks"]}
    return cells


def write_json(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def summary(cells: list[dict]) -> list[dict]:
    """The cells without their per-item outputs."""
    return [{k: v for k, v in c.items() if k != "items"} for c in cells]


def _row_label(cell: dict) -> str:
    name = cell["method"] if cell["budget"] is None else f"{cell['method']}@{cell['budget']}"
    return name if cell["engine"] == "kvc" else f"{name} (kvpress)"


def markdown(result: dict[str, Any]) -> str:
    """One row per method and budget (kvpress's under kvc's), one column per task and length:
    accuracy in %, its 95% interval and the number of questions."""
    cells = result["cells"]
    tasks = list(result["tasks"])
    columns = sorted({(c["task"], c["length"]) for c in cells},
                     key=lambda tl: (tasks.index(tl[0]) if tl[0] in tasks else len(tasks), tl[1]))
    rows: dict[str, dict[tuple, dict]] = {}
    order = sorted(cells, key=lambda c: (c["method"] != "full", c["method"], c["budget"] or 0, c["engine"]))
    for c in order:
        rows.setdefault(_row_label(c), {})[c["task"], c["length"]] = c
    head = "| method | " + " | ".join(f"{t} {n // 1024}K" if n % 1024 == 0 else f"{t} {n}" for t, n in columns) + " |"
    lines = [head, "|" + " --- |" * (len(columns) + 1)]
    for label, by_col in rows.items():
        entries = []
        for col in columns:
            c = by_col.get(col)
            if c is None:
                entries.append("—")
                continue
            low, high = c["ci95"]
            entries.append(f"{100 * c['accuracy']:.0f} [{100 * low:.0f}–{100 * high:.0f}] n={c['n']}")
        lines.append(f"| {label} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Accuracy against budget, one panel per task and length, one line per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvc[bench]' (or pip install matplotlib)",
                          param="plot") from None
    cells = result["cells"]
    panels = sorted({(c["task"], c["length"]) for c in cells}, key=lambda tl: (tl[0], tl[1]))
    if not panels:
        raise ConfigError("nothing to plot: the result has no cells", param="plot")
    order = list(result.get("tasks", {}))  # the run's task order, as the table's columns
    tasks = sorted({t for t, _ in panels}, key=lambda t: (order.index(t) if t in order else len(order), t))
    lengths = sorted({n for _, n in panels})
    fig, axes = plt.subplots(len(tasks), len(lengths), figsize=(4.2 * len(lengths), 3.2 * len(tasks)),
                             squeeze=False, sharey=True)
    methods = sorted({c["method"] for c in cells if c["budget"] is not None})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for r, task in enumerate(tasks):
        for col, length in enumerate(lengths):
            ax = axes[r][col]
            here = [c for c in cells if (c["task"], c["length"]) == (task, length)]
            for c in here:
                if c["budget"] is None:
                    style = "-" if c["engine"] == "kvc" else ":"
                    ax.axhline(100 * c["accuracy"], color="black", linestyle=style, linewidth=1,
                               label=_row_label(c))
            for method in methods:
                for engine, style, marker in (("kvc", "-", "o"), ("kvpress", "--", "x")):
                    points = sorted((c["budget"], 100 * c["accuracy"]) for c in here
                                    if c["method"] == method and c["engine"] == engine and c["budget"] is not None)
                    if points:
                        ax.plot(*zip(*points), style, marker=marker, color=colors[method],
                                label=method if engine == "kvc" else f"{method} (kvpress)")
            ax.set_xscale("log", base=2)
            budgets = sorted({c["budget"] for c in here if c["budget"] is not None})
            if budgets:
                ax.set_xticks(budgets, [str(b) for b in budgets])
                ax.minorticks_off()
            ax.set_title(f"{task}, {length} tokens", fontsize=10)
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("accuracy (%)")
            if r == len(tasks) - 1:
                ax.set_xlabel("KV budget (tokens per KV head)")
    legend: dict[str, Any] = {}  # every panel's lines, once each (panels may hold different methods)
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.suptitle(f"kvc eval · {result['model']} · {result['device']} {result['dtype']} · {result['date']}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend(list(legend.values()), list(legend), loc="center left", bbox_to_anchor=(1.0, 0.5),
               ncol=1 + len(legend) // 16, fontsize=8, frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend sits right of the panels
    plt.close(fig)


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
