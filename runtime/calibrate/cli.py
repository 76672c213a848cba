"""`kvc calibrate METHOD`: writes the method's [layer, kv_head] input (its gates) for a model.

The method names its input file (`input gate: [layer, kv_head] from "FILE"`) and its streaming
pattern's `sink` and `recent` parameters (tokens at the target context); the calibration context is
shorter, so sink and recent are scaled by context / target (docs/design.md, "Calibrating
DuoAttention's gates"). The file goes into the model directory (what the engine reads first) unless
`--out` says where.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from kvc.runtime.errors import ConfigError

log = logging.getLogger(__name__)


def add_command(sub) -> None:
    p = sub.add_parser("calibrate", help="learn a method's input tensors (DuoAttention's gates) on a model")
    p.add_argument("method", help="a method with a [layer, kv_head] input, e.g. duoattention")
    p.add_argument("--model", default=None, help="model directory, gguf:FILE (default: the embedded model)")
    p.add_argument("--out", default=None, help="the safetensors file to write (default: in the model directory)")
    p.add_argument("--context", type=int, default=1024, help="tokens per synthetic passkey context")
    p.add_argument("--target-context", type=int, default=4096,
                   help="the context the method's sink and recent are meant for (they are scaled to --context)")
    p.add_argument("--sink", type=int, default=None, help="streaming sinks at --context (default: scaled)")
    p.add_argument("--recent", type=int, default=None, help="streaming window at --context (default: scaled)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--samples", type=int, default=8, help="distinct contexts, cycled over the steps")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--l1", type=float, default=0.05, help="weight of the gates' L1 norm in the loss")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--float32", action="store_true", help="no bfloat16 autocast")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from kvc.runtime.calibrate.gates import GateConfig, calibrate
    from kvc.runtime.compiled.folder import resolve
    from kvc.runtime.models.loader import model_directory
    from kvc.runtime.models.method_inputs import save_input

    name, manifest, params, _ = resolve(a.method, None)
    inputs = {k: v for k, v in manifest.get("inputs", {}).items() if v["dims"] == ["layer", "kv_head"]}
    if len(inputs) != 1:
        raise ConfigError(f"method {name!r} has no single [layer, kv_head] input to calibrate", param="method")
    (input_name, decl), = inputs.items()
    missing = [p for p in ("sink", "recent") if p not in params]
    if missing and (a.sink is None or a.recent is None):
        raise ConfigError(f"method {name!r} has no parameter(s) {', '.join(missing)}; pass --sink and --recent",
                          param="method")
    scale = a.context / a.target_context
    sink = a.sink if a.sink is not None else max(1, round(params["sink"] * scale))
    recent = a.recent if a.recent is not None else max(1, round(params["recent"] * scale))
    model_dir = model_directory(a.model)
    if model_dir is None:
        raise ConfigError("calibration needs a model directory (not a random: shape)", param="model")
    out = Path(a.out) if a.out else model_dir / decl["file"]
    cfg = GateConfig(sink=sink, recent=recent, context=a.context, samples=a.samples, steps=a.steps, lr=a.lr,
                     l1=a.l1, seed=a.seed, bf16=not a.float32)
    bar = tqdm(total=cfg.steps, desc=f"kvc: calibrating {name} gates", unit="step")

    def progress(step: int, loss: float) -> None:
        bar.update()
        bar.set_postfix_str(f"distill {loss:.4g}")

    try:
        result = calibrate(model_dir, cfg, progress)
    finally:
        bar.close()
    meta = {"method": name, "input": input_name, "model": str(model_dir), "context": str(cfg.context),
            "sink": str(sink), "recent": str(recent), "steps": str(cfg.steps), "samples": str(cfg.samples),
            "lr": str(cfg.lr), "l1": str(cfg.l1), "seed": str(cfg.seed), "bf16": str(cfg.bf16),
            "seconds": f"{result.seconds:.0f}",
            "loss_first_last": json.dumps([result.losses[0], result.losses[-1]] if result.losses else [])}
    save_input(out, input_name, result.gate, meta)
    gate = result.gate
    print(f"wrote {out}: {input_name} {tuple(gate.shape)} in [{float(gate.min()):.3f}, {float(gate.max()):.3f}], "
          f"mean {float(gate.mean()):.3f}; {cfg.steps} steps in {result.seconds:.0f} s "
          f"(sink {sink}, recent {recent} at {cfg.context} tokens)")
    del torch
    return 0
