"""Compiles norm_triton.py's fused residual add + RMSNorm (`add_rms_norm`) or silu(gate) * up (`silu_mul`)
kernel for an H100/H200 (sm90) on a machine without a GPU (Triton's passes and ptxas, as
tests/kernels/sm90_compile.py does for attention): bf16 rows of 2048 (Qwen3-30B-A3B's hidden size; one
part or eight summed), or a
program's 1024 columns of silu_mul, at the launch's own warps; silu_mul with CUDA's expf and a correctly
rounded division (torch's silu), not Triton's approximate `/`.
`python -m tests.kernels.sm90_compile_norm [add_rms_norm|silu_mul|norm_rope]`; tests/kernels/test_add_rms_norm.py
and test_silu_mul.py run it in a subprocess."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvc.runtime.models import norm_triton

HIDDEN = 2048


def compile_kernel(fn, constexprs: dict[str, int | bool], warps: int):
    """`fn` for sm90 with bf16 pointers (16-byte aligned), i32 N, fp32 eps, i64 strides."""
    types = {"N": "i32", "eps": "fp32"}
    signature, consts = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name] = "constexpr"
            consts[(i,)] = constexprs[name] if name in constexprs else fn.params[i].default  # e.g. PDL's False
        else:
            signature[name] = "*bf16" if name.endswith("_ptr") else types.get(name, "i64")
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
    return triton.compile(ASTSource(fn, signature, constexprs=consts, attrs=aligned),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def main(which: str = "add_rms_norm") -> None:
    if which == "add_rms_norm":
        block = triton.next_power_of_2(HIDDEN)
        warps = max(1, min(8, block // 256))  # as `add_rms_norm` launches it
        for parts in (1, 8):  # a plain add; an MoE layer's 8 expert rows per token summed in the launch
            kernel = compile_kernel(norm_triton._add_rms_norm_kernel, {"BLOCK": block, "PARTS": parts}, warps)
            assert ".entry _add_rms_norm_kernel" in kernel.asm["ptx"]
    elif which == "silu_mul":
        block = norm_triton.SILU_MUL_BLOCK
        warps = max(1, min(8, block // 256))  # as `silu_mul` launches it
        kernel = compile_kernel(norm_triton._silu_mul_kernel, {"BLOCK": block, "LIBDEVICE": True}, warps)
        ptx = kernel.asm["ptx"]
        assert ".entry _silu_mul_kernel" in ptx
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx, "the division is not IEEE"
    elif which == "norm_rope":
        block, warps = norm_triton.NORM_ROPE_TOKENS, 4  # a prefill's token blocks; decode steps take blocks of one
        for tokens, w in ((block, warps), (1, 1)):
            kernel = compile_kernel(norm_triton._norm_rope_kernel,
                                    {"D": 128, "HALF": 64, "NORM": True, "BLOCK_T": tokens}, w)
            assert ".entry _norm_rope_kernel" in kernel.asm["ptx"]
        print(f"norm_rope compiled for sm90: blocks of {block} tokens and of one")
        return
    else:
        raise SystemExit(f"unknown kernel {which!r}: add_rms_norm, silu_mul or norm_rope")
    print(f"{which} compiled for sm90: {block} bf16 columns a program, {warps} warps, "
          f"{kernel.metadata.shared} bytes smem")


if __name__ == "__main__":
    main(*sys.argv[1:])
