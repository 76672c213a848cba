"""The tuner: times every candidate of each bench, keeps the fastest, writes the cache file.

Per bench (one kernel at one shape bucket, benches.py): the heuristic config is measured first,
then every candidate (a candidate that fails to compile, exceeds the GPU's resources, or computes
a different result than the heuristic is skipped with a note); the heuristic and the three best
are measured again, twice, interleaved, with longer repeats, and the best of those is kept only
if it beats the heuristic by `min_gain` (else the heuristic itself is recorded). Both numbers
come from the same process and the same timing (timing.py), so a tuned entry is never slower
than the untuned launch it replaces, as far as the measurement can tell.
"""

from __future__ import annotations

import datetime
import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path
import torch

from kvc.runtime.tuning import table
from kvc.runtime.tuning.benches import Bench, Planned, Skip
from kvc.runtime.tuning.keys import GpuKey
from kvc.runtime.tuning.timing import median_ms

log = logging.getLogger(__name__)
FINALISTS = 3


@dataclass
class Outcome:
    kernel: str
    family: str
    bucket: tuple | None
    label: str
    untuned_ms: float | None = None
    tuned_ms: float | None = None
    config: dict | None = None
    heuristic: dict | None = None
    tried: int = 0
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None  # why the bucket was not measured
    source: str = ""
    source_hash: str = ""

    @property
    def speedup(self) -> float | None:
        return self.untuned_ms / self.tuned_ms if self.untuned_ms and self.tuned_ms else None


def _describe(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tune_bench(bench: Bench, device: torch.device, rep_ms: int = 25, min_gain: float = 0.01,
               max_candidates: int | None = None) -> Outcome:
    out = Outcome(bench.kernel, bench.family, bench.bucket, bench.label, heuristic=dict(bench.heuristic),
                  source=str(bench.source), source_hash=bench.source_hash)
    reference = bench.result(bench.heuristic)
    _sync(device)
    measured = [(median_ms(bench.launch(bench.heuristic), device, rep_ms), dict(bench.heuristic))]
    candidates = bench.candidates[1:]
    if max_candidates is not None:
        candidates = candidates[: max(0, max_candidates - 1)]
    for cand in candidates:
        try:
            got = bench.result(cand)
            _sync(device)
            if got.shape != reference.shape or not torch.allclose(got, reference, **bench.tolerance):
                out.notes.append(f"{_describe(cand)}: result differs from the heuristic's; skipped")
                continue
            measured.append((median_ms(bench.launch(cand), device, rep_ms), cand))
        except Exception as err:  # noqa: BLE001 -- OutOfResources, CompilationError, ...: skip the candidate
            first = (str(err).strip().splitlines() or [""])[0][:160]
            out.notes.append(f"{_describe(cand)}: {type(err).__name__}: {first}; skipped")
    out.tried = len(measured)
    ranked = sorted(measured[1:], key=lambda m: m[0])[:FINALISTS]
    finalists = [bench.heuristic, *[cfg for _, cfg in ranked]]
    best = {i: float("inf") for i in range(len(finalists))}
    for _ in range(2):
        for i, cfg in enumerate(finalists):
            best[i] = min(best[i], median_ms(bench.launch(cfg), device, 2 * rep_ms))
    winner = min(best, key=best.get)
    if best[winner] > best[0] * (1 - min_gain):
        winner = 0  # not a real gain: keep the heuristic
    out.untuned_ms, out.tuned_ms, out.config = best[0], best[winner], dict(finalists[winner])
    return out


def run(planned: list[Planned], device: torch.device, *, rep_ms: int = 25, min_gain: float = 0.01,
        max_candidates: int | None = None, progress: bool = True) -> list[Outcome]:
    """Builds and tunes each bench in turn (one bucket's inputs alive at a time), with a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    outcomes = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, disable=not progress) as bar:
        task = bar.add_task("tuning", total=len(planned))
        for plan in planned:
            bar.update(task, description=f"tuning {plan.label}")
            try:
                bench = plan.build()
            except Skip as why:
                outcomes.append(Outcome(plan.kernel, plan.family, plan.bucket, plan.label, skipped=str(why)))
                bar.advance(task)
                continue
            outcomes.append(tune_bench(bench, device, rep_ms, min_gain, max_candidates))
            del bench
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            bar.advance(task)
    return outcomes


def entries(outcomes: list[Outcome]) -> list[table.Entry]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [
        table.Entry(kernel=o.kernel, family=o.family, bucket=o.bucket, config=o.config,
                    source=relative_source(o.source), source_hash=o.source_hash, untuned_config=o.heuristic or {},
                    untuned_ms=round(o.untuned_ms, 5), tuned_ms=round(o.tuned_ms, 5), tuned_at=now)
        for o in outcomes if o.skipped is None and o.config is not None
    ]


def save(outcomes: list[Outcome], directory: Path, gpu: GpuKey) -> Path:
    """Merges the outcomes into this GPU's cache file (other entries kept); returns its path."""
    path = table.path_for(directory, gpu)
    table.write(path, table.merge(path, gpu, entries(outcomes)))
    return path


def relative_source(path: str) -> str:
    """A source path relative to the repository when it lies inside it (for the JSON)."""
    from kvc.compiler.cache import GENERATED_DIR

    try:
        return Path(path).resolve().relative_to(GENERATED_DIR.parent.resolve()).as_posix()
    except ValueError:
        return path
