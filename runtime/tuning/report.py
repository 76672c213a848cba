"""The summary `kvc tune` prints and writes: per kernel and bucket, untuned ms, tuned ms, speedup
and the chosen config (a rich table on the terminal; the same rows as JSON for `--out`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvc.runtime.tuning import buckets
from kvc.runtime.tuning.keys import GpuKey
from kvc.runtime.tuning.tuner import Outcome


def _config_text(cfg: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (cfg or {}).items())


def rows(outcomes: list[Outcome]) -> list[dict]:
    out = []
    for o in outcomes:
        row = {"kernel": o.kernel, "bucket": buckets.as_dict(o.family, o.bucket) if o.bucket else None}
        if o.skipped:
            row["skipped"] = o.skipped
        else:
            row.update(untuned_ms=o.untuned_ms, tuned_ms=o.tuned_ms, speedup=o.speedup, config=o.config,
                       untuned_config=o.heuristic, candidates_measured=o.tried, notes=o.notes)
        out.append(row)
    return out


def write_json(path: Path, outcomes: list[Outcome], gpu: GpuKey, meta: dict) -> None:
    data = {"gpu": gpu.to_json(), **meta, "results": rows(outcomes)}
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def print_table(outcomes: list[Outcome], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title="kvc tune: untuned (heuristic) vs tuned launch config")
    for name, justify in (("kernel", "left"), ("bucket", "left"), ("untuned ms", "right"), ("tuned ms", "right"),
                          ("speedup", "right"), ("config", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "config")
    for o in outcomes:
        bucket = buckets.short(o.family, o.bucket) if o.bucket else ""
        if o.skipped:
            table.add_row(o.kernel, bucket, "-", "-", "-", f"skipped: {o.skipped}")
            continue
        same = o.config == o.heuristic
        table.add_row(o.kernel, bucket, f"{o.untuned_ms:.4f}", f"{o.tuned_ms:.4f}", f"{o.speedup:.2f}x",
                      "(heuristic)" if same else _config_text(o.config))
    console.print(table)
    failed = sum(1 for o in outcomes for n in o.notes)
    if failed:
        console.print(f"{failed} candidate(s) skipped (compile/resource failures or differing results); "
                      "see --out for the notes")
