"""`kvc calibrate METHOD`: writes a method's input tensors for a model.

Four kinds, told apart by the compiled method's manifest (no method names here): a method whose KV
spec stores K/V as low-rank latents gets its projections from the model's weights (lowrank.py,
seconds); one that stores a code relative to nearest centers (`delta`) gets its compressor by
training through the frozen model (deltakv.py, minutes); one that stores keys relative to an offset
gets each layer and head's mean key over calibration text (offsets.py, seconds); otherwise a method with one [layer,
kv_head] input gets it (its gates) by optimisation (gates.py).

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
DOCS = Path(__file__).resolve().parents[2] / "docs"  # the default calibration text (a source checkout's)
HELD_OUT = 2  # calibration sequences a trained compressor is evaluated on, not trained on


def add_command(sub) -> None:
    p = sub.add_parser("calibrate", help="learn a method's input tensors (DuoAttention's gates) on a model")
    p.add_argument("method", help="a method with a [layer, kv_head] input (duoattention), low-rank K/V (palu), "
                   "a delta code (deltakv) or key offsets (bench/variants/turboquant_offsets.kvm)")
    p.add_argument("--method-param", action="append", metavar="KEY=VALUE", default=None,
                   help="a method parameter the inputs depend on (a low-rank ratio), repeatable")
    p.add_argument("--model", default=None, help="model directory, gguf:FILE (default: the embedded model)")
    p.add_argument("--out", default=None, help="the safetensors file to write (default: in the model directory)")
    p.add_argument("--context", type=int, default=1024, help="tokens per calibration context (gates: synthetic "
                   "passkey contexts; low-rank: sequences of the calibration text)")
    p.add_argument("--target-context", type=int, default=4096,
                   help="the context the method is meant for (gates: its sink and recent are scaled to --context; "
                   "key offsets: the calibration sequences' length)")
    p.add_argument("--sink", type=int, default=None, help="streaming sinks at --context (default: scaled)")
    p.add_argument("--recent", type=int, default=None, help="streaming window at --context (default: scaled)")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default: gates 200, a delta "
                   "compressor 80)")
    p.add_argument("--samples", type=int, default=8, help="distinct contexts (gates: cycled over the steps)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: gates 0.02 with Adam, a delta "
                   "compressor 2e-4 with AdamW)")
    p.add_argument("--l1", type=float, default=0.05, help="weight of the gates' L1 norm in the loss")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--decompose", choices=["whiten", "svd"], default="whiten",
                   help="low-rank projections: of keys and values over calibration text (whiten, Palu's default), "
                   "or of the projection weights alone (svd)")
    p.add_argument("--calibration", nargs="+", metavar="FILE",
                   help="text files a whitened decomposition reads (default: kvc's docs/*.md); --samples "
                   "sequences of --context tokens")
    p.add_argument("--device", default="cpu", help="where a low-rank method's SVDs run (cpu: float32 weights; a GPU: "
                   "bfloat16, for models larger than host memory), or a delta compressor trains")
    p.add_argument("--float32", action="store_true", help="no bfloat16 autocast")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from kvc.runtime.calibrate.gates import GateConfig, calibrate
    from kvc.runtime.compiled.folder import resolve
    from kvc.runtime.models.loader import model_directory
    from kvc.runtime.models.method_inputs import save_input

    from kvc.runtime.server.launch import parse_method_params

    name, manifest, params, folder = resolve(a.method, parse_method_params(a.method_param) or None, lowered=False)
    spec = manifest.get("kv_spec") or {}
    if any(spec.get(w, {}).get("kind") == "low_rank" for w in ("keys", "values")):
        return _low_rank(a, name, manifest, params, folder)
    if spec.get("keys", {}).get("kind") == "delta":
        return _delta(a, name, manifest, params)
    if spec.get("keys", {}).get("offset"):
        return _offsets(a, name, manifest, params, spec["keys"]["offset"])
    if not manifest.get("lowered", False):
        raise ConfigError(f"method {name!r} is not lowered by the compiler yet: {manifest.get('reason')}",
                          param="method")
    a.steps = 200 if a.steps is None else a.steps
    a.lr = 0.02 if a.lr is None else a.lr
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


def _low_rank(a: argparse.Namespace, name: str, manifest: dict, params: dict, folder: Path) -> int:
    """Projections of a low-rank K/V spec (lowrank.py: whitened by calibration text, or of the
    weights alone), written as the method's inputs."""
    import time

    import torch

    from kvc.runtime.calibrate import lowrank
    from kvc.runtime.compiled.method import CompiledMethod
    from kvc.runtime.kv.spec import LowRank
    from kvc.runtime.models.method_inputs import save_inputs

    start = time.perf_counter()
    model_dir, loaded = _load(a, "the projections")
    mspec = loaded.spec
    spec = CompiledMethod(name, manifest, params, folder).kv_spec(mspec.num_kv_heads, mspec.head_dim, torch.float32, 16)
    after_rope = isinstance(spec.keys, LowRank) and not spec.keys.prerope
    if a.decompose == "svd" and after_rope:
        raise ConfigError(f"method {name!r} stores keys after RoPE, which the K weights' SVD does not span: use "
                          "--decompose whiten", param="decompose")
    if a.decompose == "whiten":
        batches, source = _calibration_ids(a, model_dir, mspec.vocab_size, loaded.model.embed_tokens.weight.device)
        moments = lowrank.covariances(loaded.model, batches, prerope=not after_rope)
        how = f"whitened by {sum(len(b) for b in batches)} tokens of {source}"
    else:
        how = "SVD of the K/V projection weights"
    tensors, files = {}, set()
    for which, enc in (("k", spec.keys), ("v", spec.values)):
        if not isinstance(enc, LowRank):
            continue
        rank = spec.tensor(enc.down).shape[-1]
        if a.decompose == "whiten":
            basis = lowrank.whitened(moments[which], mspec.num_kv_heads, enc.group, rank)
        else:
            basis = lowrank.weight_projections(loaded.model, enc.group, rank)[which]
        tensors[enc.down] = tensors[enc.up] = basis
        files |= {manifest["inputs"][enc.down]["file"], manifest["inputs"][enc.up]["file"]}
    if len(files) != 1:
        raise ConfigError(f"method {name!r}: its projections come from {len(files)} files; one is written at a time",
                          param="method")
    out = Path(a.out) if a.out else model_dir / files.pop()
    meta = {"method": name, "model": str(model_dir or a.model), "params": json.dumps(params, sort_keys=True),
            "decompose": how, "seconds": f"{time.perf_counter() - start:.1f}"}
    save_inputs(out, tensors, meta)
    shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in sorted(tensors.items()))
    print(f"wrote {out}: {shapes} ({how}, {time.perf_counter() - start:.1f} s)")
    return 0


def _offsets(a: argparse.Namespace, name: str, manifest: dict, params: dict, input_name: str) -> int:
    """Key offsets (offsets.py): each layer and KV head's mean key over `--samples` sequences of
    `--target-context` tokens of the calibration text, written as the method's input."""
    import time

    from kvc.runtime.calibrate.offsets import key_means
    from kvc.runtime.models.method_inputs import save_input

    start = time.perf_counter()
    model_dir, loaded = _load(a, "the key offsets")
    a.context = a.target_context  # the mean over the positions the method serves (RoPE turns keys with them)
    batches, source = _calibration_ids(a, model_dir, loaded.spec.vocab_size, loaded.model.embed_tokens.weight.device)
    means = key_means(loaded.model, batches)
    out = Path(a.out) if a.out else model_dir / manifest["inputs"][input_name]["file"]
    how = f"mean key over {sum(len(b) for b in batches)} tokens of {source}, {a.context} a sequence"
    save_input(out, input_name, means, {"method": name, "model": str(model_dir or a.model), "input": input_name,
                                        "calibration": how, "seconds": f"{time.perf_counter() - start:.1f}"})
    print(f"wrote {out}: {input_name} {tuple(means.shape)} ({how}, {time.perf_counter() - start:.1f} s)")
    return 0


def _load(a: argparse.Namespace, what: str):
    """(the model directory or None, the loaded model) of `--model` on `--device`, float32 on the CPU and
    bfloat16 on a GPU; a random: shape (benchmarks: its seeded weights) only with `--out` for `what`."""
    import torch

    from kvc.runtime.models.loader import load_model, model_directory, resolve_model

    model_dir = model_directory(a.model)
    if model_dir is None and not a.out:
        raise ConfigError(f"a random: model has no directory to write {what} into: give --out", param="out")
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    loaded = load_model(model_dir, a.device, dtype) if model_dir is not None else resolve_model(a.model, a.device,
                                                                                                  dtype)
    return model_dir, loaded


def _delta(a: argparse.Namespace, name: str, manifest: dict, params: dict) -> int:
    """The compressor of a `delta` store (deltakv.py), trained on the calibration text through the frozen
    model and written as the method's inputs: projections [layers, Hkv, 2 D, code] (each head's key rows,
    then its value rows) and biases [layers, Hkv, 2 D]; zeros in the layers the store leaves dense."""
    import math

    import sympy
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig

    from kvc.runtime.calibrate.deltakv import DeltaConfig, as_inputs, calibrate
    from kvc.runtime.models.loader import model_directory
    from kvc.runtime.models.method_inputs import save_inputs

    enc = manifest["kv_spec"]["keys"]
    model_dir = model_directory(a.model)
    if model_dir is None:
        raise ConfigError("a delta compressor is trained on a model directory (not a random: shape)", param="model")
    torch.manual_seed(a.seed)
    config = AutoConfig.from_pretrained(str(model_dir))
    heads, layers_n = config.num_key_value_heads, config.num_hidden_layers
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    env = {"head_dim": dim, "kv_heads": heads,
           **{k: v for k, v in params.items() if isinstance(v, (int, float))}}

    def value(text) -> int:
        return int(sympy.sympify(str(text)).subs(env))

    group = math.gcd(value(enc["group"]), heads)
    if group != heads:
        raise ConfigError(f"method {name!r}: the trainer codes whole tokens (group = kv_heads), not groups of "
                          f"{group} of {heads} KV heads", param="method")
    which = enc["layers"]
    layers = [layer for layer in range(layers_n)
              if not which or (layer in params[which["param"]]) == which["member"]]
    cfg = DeltaConfig(layers=layers, code=group * value(enc["share"]), sink=value(enc["sink"]),
                      recent=value(enc["recent"]), stride=value(enc["every"]), neighbours=value(enc["count"]),
                      steps=DeltaConfig.steps if a.steps is None else a.steps,
                      lr=DeltaConfig.lr if a.lr is None else a.lr,
                      bf16=not a.float32)
    if a.context < cfg.sink + 2 * cfg.recent:
        raise ConfigError(f"--context {a.context} leaves no block to compress: the method keeps sink {cfg.sink} and "
                          f"up to 2 x recent {cfg.recent} tokens raw; give --context >= {cfg.sink + 2 * cfg.recent}",
                          param="context")
    batches, source = _calibration_ids(a, model_dir, config.vocab_size, a.device, extra=HELD_OUT)
    if len(batches) <= HELD_OUT:
        raise ConfigError(f"the calibration text holds {len(batches)} sequences of {a.context} tokens; training needs "
                          f"more than the {HELD_OUT} held out", param="calibration")
    batches, held = batches[:-HELD_OUT], batches[-HELD_OUT:]
    bar = tqdm(total=cfg.steps, desc=f"kvc: training {name}'s compressor", unit="step")

    def progress(step: int, loss: float) -> None:
        bar.update()
        bar.set_postfix_str(f"cross-entropy {loss:.4g}")

    try:
        result = calibrate(model_dir, batches, cfg, progress, held)
    finally:
        bar.close()
    trained = as_inputs(result.tensors)
    tensors = {enc[part]: trained[part] for part in ("down", "up")}
    if enc["bias"] is not None:
        tensors[enc["bias"]] = trained["bias"]
    files = {manifest["inputs"][n]["file"] for n in tensors}
    out = Path(a.out) if a.out else model_dir / files.pop()
    meta = {"method": name, "model": str(model_dir), "params": json.dumps(params, sort_keys=True),
            "source": f"{sum(len(b) for b in batches)} tokens of {source} ({HELD_OUT} more sequences held out)",
            "steps": str(cfg.steps),
            "lr": str(cfg.lr), "layers": json.dumps(layers), "seconds": f"{result.seconds:.0f}",
            "cross_entropy": json.dumps(result.ce), "relative_error": json.dumps(result.errors)}
    save_inputs(out, tensors, meta)
    print(f"wrote {out}: code of {cfg.code} channels for {len(layers)} layers, {cfg.steps} steps in "
          f"{result.seconds:.0f} s; held-out cross-entropy full {result.ce['full']:.4f}, PCA {result.ce['pca']:.4f}, "
          f"trained {result.ce['final']:.4f}; relative error PCA {result.errors['pca']:.4f}, trained "
          f"{result.errors['final']:.4f}")
    return 0


def _calibration_ids(a: argparse.Namespace, model_dir: Path | None, vocab: int, device,
                     extra: int = 0) -> tuple[list, str]:
    """`--samples` (+ `extra`) sequences of `--context` token ids: the calibration text files tokenized end
    to end (default: kvc's docs/*.md), or seeded random ids for a model without a tokenizer (random: shapes)."""
    import torch

    from kvc.runtime.tokenizer import load_tokenizer

    tokenizer = None if model_dir is None else load_tokenizer(model_dir)
    if tokenizer is None:
        gen = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, vocab, ((a.samples + extra) * a.context,), generator=gen)
        source = "random ids (the model has no tokenizer)"
    else:
        files = [Path(f) for f in a.calibration] if a.calibration else sorted(DOCS.glob("*.md"))
        missing = [str(f) for f in files if not f.is_file()]
        if not files or missing:
            raise ConfigError(f"calibration text not found: {', '.join(missing) or DOCS}; give --calibration FILE...",
                              param="calibration")
        text = "\n\n".join(f.read_text() for f in files)
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
        source = f"{len(files)} calibration file(s)"
        if ids.numel() < a.context:
            raise ConfigError(f"the calibration text has {ids.numel()} tokens, fewer than --context {a.context}",
                              param="calibration")
    count = min(a.samples + extra, ids.numel() // a.context)
    return [ids[i * a.context:(i + 1) * a.context].to(device) for i in range(count)], source
