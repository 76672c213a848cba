"""Compiles the fused residual add + RMSNorm kernel (runtime/models/norm_triton.py `add_rms_norm`) for an
H100/H200 (sm90) on a machine without a GPU (Triton's passes and ptxas, as tests/kernels/sm90_compile.py does
for attention): bf16 rows of 2048 (Qwen3-30B-A3B's hidden size) at the launch's own warps.
`python -m tests.kernels.sm90_compile_norm`; tests/kernels/test_add_rms_norm.py runs it in a subprocess."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvc.runtime.models import norm_triton

HIDDEN = 2048


def main() -> None:
    fn = norm_triton._add_rms_norm_kernel
    types = {"N": "i32", "eps": "fp32"}
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", triton.next_power_of_2(HIDDEN)
        else:
            signature[name] = "*bf16" if name.endswith("_ptr") else types.get(name, "i64")
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
    warps = max(1, min(8, triton.next_power_of_2(HIDDEN) // 256))  # as `add_rms_norm` launches it
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert ".entry _add_rms_norm_kernel" in kernel.asm["ptx"]
    print(f"add_rms_norm compiled for sm90: H={HIDDEN} bf16, {warps} warps, {kernel.metadata.shared} bytes smem")


if __name__ == "__main__":
    main()
