"""Where a method's input tensors come from (`input NAME: [dims] from "FILE"` in a .kvm).

Pipeline position: read by the compiled-method adapter when the engine binds a model
(runtime/compiled/inputs.py). A method input is a float32 safetensors file, looked up:
1. in the model's directory (`<model dir>/FILE`): what `kvc calibrate` writes for a model;
2. else in the shipped defaults: `runtime/models/method_inputs/<GGUF stem>/FILE`, for a model
   converted from that GGUF file (its `kvc_conversion.json` names the source), which is how the
   embedded default model (SmolLM2-135M-Instruct) runs DuoAttention out of the box.
docs/design.md, "Method inputs".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHIPPED = Path(__file__).resolve().parent / "method_inputs"


def find_input(model_dir: Path | None, file: str) -> Path | None:
    """The file of a method input for the model in `model_dir` (module docstring), or None."""
    if model_dir is None:
        return None
    model_dir = Path(model_dir)
    own = model_dir / file
    if own.is_file():
        return own
    shipped = shipped_dir(model_dir)
    if shipped is not None and (shipped / file).is_file():
        return shipped / file
    return None


def shipped_dir(model_dir: Path) -> Path | None:
    """The shipped inputs' folder of a model converted from a GGUF file, or None."""
    try:
        source = json.loads((Path(model_dir) / "kvc_conversion.json").read_text()).get("source_name", "")
    except (OSError, ValueError):
        return None
    folder = SHIPPED / Path(source).stem
    return folder if source and folder.is_dir() else None


def load_input(path: Path, name: str) -> torch.Tensor:
    """Method input `name` (float32, CPU): the file's tensor of that name (docs/language.md, Inputs),
    or its only tensor."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if name in tensors:
        return tensors[name].float()
    if len(tensors) == 1:
        return next(iter(tensors.values())).float()
    raise ValueError(f"{path}: no tensor named {name!r} (found {', '.join(sorted(tensors)) or 'none'})")


def save_input(path: Path, name: str, value: torch.Tensor, metadata: dict[str, str] | None = None) -> None:
    """Writes method input `name` (float32) as `load_input` reads it."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: value.detach().float().contiguous().cpu()}, str(path), metadata=metadata or {})


def save_inputs(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Writes several method inputs (float32) into one file, each read back by `load_input`."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    # one stored copy per tensor: inputs that share a value (an orthonormal down = up) are cloned
    save_file({n: t.detach().float().contiguous().cpu().clone() for n, t in tensors.items()}, str(path),
              metadata=metadata or {})
