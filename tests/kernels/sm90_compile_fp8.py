"""Compiles the FP8-weight kernels for an H100/H200 (sm90) on a machine without a GPU (Triton's passes and
ptxas, as tests/kernels/sm90_compile.py): the dense linear (runtime/models/fp8_triton.py) and the routed
experts' gate_up and down GEMMs with FP8 codes and 128-column scales (runtime/models/moe_triton.py), bf16
activations. `python -m tests.kernels.sm90_compile_fp8`; tests/kernels/test_fp8_linear.py runs it."""

from __future__ import annotations

from kvc.runtime.models import fp8_triton, moe_triton
from tests.kernels.sm90_compile import build

POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "ws_ptr": "*fp32",
            "b_ptr": "*bf16", "out_ptr": "*bf16", "route_w_ptr": "*fp32", "sorted_ptr": "*i32",
            "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}


def main() -> None:
    for block_m in (16, 64):
        build(fp8_triton._linear_kernel, dict(SCALE_COLS=128, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=64,
                                              BLOCK_K=64, UPCAST=False), POINTERS, num_warps=4, num_stages=3)
    for even in (False, True):
        tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, DOT_PRECISION="native", SCALE_COLS=128,
                     EVEN=even, TMA=False)
        build(moe_triton._gate_up_kernel, dict(TOP_K=8, **tiles), POINTERS, num_warps=4, num_stages=3)
        build(moe_triton._down_kernel, tiles, POINTERS, num_warps=4, num_stages=3)
    print("FP8 weight kernels compiled for sm90")


if __name__ == "__main__":
    main()
