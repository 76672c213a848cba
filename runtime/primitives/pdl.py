"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (docs/design.md, "Launches").

A decode step is hundreds of short kernels in a CUDA graph; between two of them the GPU drains the first and
launches the second, about a microsecond each. On Hopper and later a kernel launched with `launch_pdl` may be
scheduled while the kernel before it in the stream is still finishing. Each such kernel starts with `gate`:
it waits until the kernel before it has completed and its writes are visible (griddepcontrol.wait), before any
load or store, so what it reads and writes is ordered exactly as without PDL; then it lets the next kernel
launch (griddepcontrol.launch_dependents), whose programs take the SMs this one frees. Before a kernel that
is not launched this way (cuBLAS, torch's), the order is the stream's as always.

`enabled(device)`: CUDA with compute capability 9.0 or later, unless `KVC_PDL=0` (read once, at import). On an
H100 it took 3% off `full`'s 32K decode step at batch 3 and 1% off SnapKV's at 32 (docs/benchmarks.md).
Kernels take `PDL: tl.constexpr = False`, call `gate(PDL)` first, and are launched with
`**options(device)`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

SWITCHED_ON = os.environ.get("KVC_PDL", "1") != "0"


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL (module docstring)."""
    return SWITCHED_ON and device.type == "cuda" and _hopper(device.index)


def options(device: torch.device) -> dict:
    """A launch's PDL arguments for a kernel on `device`: the kernel's `PDL` and the launcher's `launch_pdl`."""
    flag = enabled(device)
    return {"PDL": flag, "launch_pdl": flag}


@functools.cache
def _hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def gate(PDL: tl.constexpr):
    """A kernel's first step under PDL: wait for the kernel before it, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
