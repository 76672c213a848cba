"""Compiles router_triton.py's gate-fused softmax router (`_gate_softmax_topk_kernel`) for an H100/H200 (sm90) on a
machine without a GPU (Triton's passes and ptxas, as tests/kernels/sm90_compile.py does for attention), at
Qwen3-30B-A3B's router (128 experts, top 8, hidden 2048, bf16) and the launch's own block and warps, and fails on
a register spill (ptxas -v). `python -m tests.kernels.sm90_compile_router`; tests/models/test_router_triton.py runs
it in a subprocess."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvc.runtime.models import router_triton as r

TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32"}


def main() -> None:
    fn = r._gate_softmax_topk_kernel
    consts = r._launch(128, 8) | {"BLOCK_T": r.GATE_BLOCK_TOKENS, "BLOCK_K": r.GATE_BLOCK_K, "RENORMALIZE": True,
                                  "UPCAST": False, "LIBDEVICE": True, "PDL": True}  # PDL: as on a Hopper
    warps = 8  # as `gate_softmax_topk` launches it
    signature = {n: ("constexpr" if fn.params[i].is_constexpr else TYPES.get(n, "i32")) for i, n in
                 enumerate(fn.arg_names)}
    constexprs = {(i,): consts[n] for i, n in enumerate(fn.arg_names) if fn.params[i].is_constexpr}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(kernel.asm["ptx"])
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(source), "-o",
                               str(Path(folder) / "kernel.o")], capture_output=True, text=True, check=True)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    registers = re.findall(r"Used (\d+) registers", done.stderr)
    print(f"gate router compiled for sm90: {warps} warps, {registers} registers, spill stores {spills}")
    assert spills and not any(spills), f"the gate router spills: {done.stderr}"


if __name__ == "__main__":
    main()
