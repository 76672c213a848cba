"""What a tuned config is valid for: the GPU it was measured on and the source of its kernel.

Pipeline position: under `runtime/tuning/` (see its `__init__`). A tuned entry is reused only on
the same GPU model (device name + compute capability) with the same Triton version, and only
while the module file that holds the kernel is byte-for-byte the one that was tuned (its sha256),
so `kvc compile` or an edit invalidates it. Off the GPU (the interpreter runs of the tests) the
device is the nominal "cpu" with capability (0, 0).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch


@dataclass(frozen=True)
class GpuKey:
    """One kind of GPU, as far as kernel tuning cares."""

    name: str  # torch.cuda.get_device_name, e.g. "NVIDIA H200"
    capability: tuple[int, int]
    triton: str  # triton.__version__

    @property
    def slug(self) -> str:
        """The cache file's stem: `nvidia-h200-sm90-triton-3.6.0`."""
        name = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "device"
        triton = re.sub(r"[^A-Za-z0-9.]+", "-", self.triton).strip("-")
        return f"{name}-sm{self.capability[0]}{self.capability[1]}-triton-{triton}"

    def to_json(self) -> dict:
        return {"name": self.name, "capability": list(self.capability), "triton": self.triton}

    @classmethod
    def from_json(cls, data: dict) -> GpuKey:
        cap = data["capability"]
        if not isinstance(data["name"], str) or not isinstance(data["triton"], str) or len(cap) != 2:
            raise ValueError("gpu needs a name, a [major, minor] capability and a triton version")
        return cls(data["name"], (int(cap[0]), int(cap[1])), data["triton"])


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


def gpu_key(device: torch.device | str | None = None) -> GpuKey:
    """The key of `device` (default: the current CUDA device, or "cpu" without CUDA)."""
    device = torch.device(device) if device is not None else None
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return GpuKey("cpu", (0, 0), triton_version())
    index = device.index if device.index is not None else torch.cuda.current_device()
    return GpuKey(torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)), triton_version())


@lru_cache(maxsize=None)
def _hash(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def source_hash(path: str | Path) -> str:
    """sha256 of the module file that holds a kernel (memoised per path, mtime and size)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _hash(str(path), stat.st_mtime_ns, stat.st_size)
