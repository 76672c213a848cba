"""Filling a materialized kvc model from safetensors shards, one tensor at a time.

The model's `CheckpointLayout` says where every Hugging Face tensor name goes (a parameter, or a
slice of a fused one). Loading reads each tensor straight onto the target device, checks its
shape against the destination, copies it (casting to the model dtype), and counts how many
elements of each parameter were written, so that a parameter left partly empty is reported with
the names of the checkpoint tensors that should have filled it.

A model cut for one tensor-parallel rank before loading (`model.shard_plan`,
runtime/distributed/shard.py) is filled through the whole model's layout: of each tensor only the
rows or columns the rank's parameter keeps are read (a contiguous run through the file's slice, no
more) and written where the parameter holds them.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

import torch
from rich.progress import track
from safetensors import SafetensorError, safe_open

from kvc.runtime.errors import ModelLoadError
from kvc.runtime.models.base import CausalLM, CheckpointLayout
from kvc.runtime.models.fp8_weights import add_scale_targets

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def find_shards(path: Path) -> dict[Path, list[str] | None]:
    """Shard files of a checkpoint directory -> the tensor names the index assigns them (None:
    read every tensor of the file)."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({err})") from None
        grouped: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            grouped.setdefault(path / str(file), []).append(name)
        missing = sorted(str(f.name) for f in grouped if not f.is_file())
        if missing:
            raise ModelLoadError(f"{index_path} lists shard files that do not exist: {', '.join(missing)}")
        return {file: names for file, names in grouped.items()}
    if (path / SINGLE_FILE).is_file():
        return {path / SINGLE_FILE: None}
    files = sorted(path.glob("*.safetensors"))
    if files:
        return {f: None for f in files}
    hint = ""
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        hint = " (found PyTorch .bin/.pt weights: kvc reads only safetensors; convert them first)"
    raise ModelLoadError(f"{path}: no safetensors weights found{hint}")


def load_checkpoint(model: CausalLM, path: Path, device: torch.device) -> None:
    plan = getattr(model, "shard_plan", None)  # a rank's cut (module docstring)
    layout = model.checkpoint_layout() if plan is None else plan.layout
    if model.fp8_weights is not None:  # each FP8 weight's block scales (runtime/models/fp8_weights.py)
        add_scale_targets(layout, *model.fp8_weights)
    params = dict(model.named_parameters())
    written: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    unused: list[str] = []
    shards = find_shards(path)
    # safe_open memory-maps on CPU; for CUDA it reads straight into device memory.
    open_device = "cpu" if device.type == "cpu" else str(device)
    progress = track(
        shards.items(),
        description="Loading weights",
        total=len(shards),
        disable=len(shards) < 2 or not sys.stderr.isatty(),
        transient=True,
    )
    for file, names in progress:
        try:
            with safe_open(str(file), framework="pt", device=open_device) as f:
                for name in names if names is not None else list(f.keys()):
                    if name in layout.ignored:
                        continue
                    target = layout.targets.get(name)
                    if target is None:
                        unused.append(name)
                        continue
                    if plan is not None and (target.param in plan.kept or target.param in plan.dropped):
                        if target.param in plan.kept:
                            written[target.param] += _copy_kept(f, name, params[target.param].data, target.index,
                                                                plan.shapes[target.param], plan.kept[target.param],
                                                                file.name)
                        seen.add(name)
                        continue
                    dest = params[target.param].data[target.index]
                    shape = tuple(f.get_slice(name).get_shape())
                    want = tuple(dest.shape)
                    if target.expand_rows:  # block scales: one row a block of the region's rows
                        want = (-(-want[0] // target.expand_rows), *want[1:])
                    if shape != want:
                        raise ModelLoadError(
                            f"{file.name}: tensor {name} has shape {list(shape)}, but the model "
                            f"expects {list(want)} (for {target.param}); does config.json "
                            "match the weights?"
                        )
                    tensor = f.get_tensor(name)
                    if target.expand_rows:
                        tensor = tensor.repeat_interleave(target.expand_rows, dim=0)[: dest.shape[0]]
                    dest.copy_(tensor)
                    seen.add(name)
                    written[target.param] += dest.numel()
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: cannot read safetensors file ({err})") from None
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        logger.warning("%s: ignoring %d tensors the model does not use: %s", path, len(unused), shown)
    _check_complete(layout, params, written, seen, path)


def _copy_kept(f, name: str, dest: torch.Tensor, region: tuple, shape: tuple[int, ...],
               kept: dict[int, torch.Tensor], file: str) -> int:
    """Copies what a cut parameter `dest` keeps of checkpoint tensor `name`, which fills `region` (ints and
    slices over the leading axes) of the whole parameter of `shape`; `kept[axis]`: the whole parameter's
    indices `dest` holds along a cut axis, in its order. The elements written (0: none of it is this rank's)."""
    reads, writes, want = [], [], []  # per axis of the checkpoint tensor / of dest
    for axis, size in enumerate(shape):
        r = region[axis] if axis < len(region) else slice(None)
        index = kept.get(axis)
        if isinstance(r, int):
            if index is None:
                writes.append(r)
                continue
            at = (index == r).nonzero().flatten()
            if at.numel() == 0:
                return 0
            writes.append(int(at[0]))
            continue
        start, stop, _ = r.indices(size)
        want.append(stop - start)
        if index is None:
            reads.append(slice(None))
            writes.append(slice(start, stop))
            continue
        inside = (index >= start) & (index < stop)
        at, source = inside.nonzero().flatten(), index[inside] - start
        if at.numel() == 0:
            return 0
        reads.append(_as_slice(source))
        writes.append(_as_slice(at))
    got = tuple(f.get_slice(name).get_shape())
    if got != tuple(want):
        raise ModelLoadError(f"{file}: tensor {name} has shape {list(got)}, but the model expects {list(want)}; "
                             "does config.json match the weights?")
    ranged = tuple(r if isinstance(r, slice) else slice(None) for r in reads)
    tensor = f.get_slice(name)[ranged]  # contiguous runs read alone
    for axis, r in enumerate(reads):
        if not isinstance(r, slice):
            tensor = tensor.index_select(axis, r.to(tensor.device))
    spread = [w for w in writes if isinstance(w, torch.Tensor)]
    if len(spread) > 1:
        raise ModelLoadError(f"{file}: tensor {name}: a cut along two axes at once is not supported")
    writes = [w.to(dest.device) if isinstance(w, torch.Tensor) else w for w in writes]
    dest[tuple(writes)] = tensor.to(dest.dtype)
    return tensor.numel()


def _as_slice(index: torch.Tensor) -> slice | torch.Tensor:
    """A run of consecutive indices as a slice; any other index as it is."""
    first, n = int(index[0]), index.numel()
    if bool((index == torch.arange(first, first + n, device=index.device)).all()):
        return slice(first, first + n)
    return index


def _check_complete(
    layout: CheckpointLayout,
    params: dict[str, torch.nn.Parameter],
    written: dict[str, int],
    seen: set[str],
    path: Path,
) -> None:
    overfull = sorted(p for p, n in written.items() if n > params[p].numel())
    if overfull:
        raise ModelLoadError(
            f"{path}: the checkpoint fills {', '.join(overfull)} more than once "
            "(it holds both per-expert and fused expert tensors?)"
        )
    incomplete = {p for p, t in params.items() if written[p] < t.numel()}
    if not incomplete:
        return
    missing = [
        name
        for name, target in layout.targets.items()
        if target.param in incomplete and name not in seen and not target.alternative
    ]
    if not missing:  # only partly covered by fused tensors
        missing = sorted(incomplete)
    shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
    raise ModelLoadError(f"{path}: missing tensors in the checkpoint: {shown}")
