"""Compiles the routed experts' prefill tiles for an H100/H200 (sm90) on a machine without a GPU (Triton's
passes and ptxas, as tests/kernels/sm90_compile.py): `moe_triton.default_config` for an 8K-token chunk, bf16,
the gate_up and down GEMMs with their weight tiles through TMA descriptors and by pointer, and the pair sum.
`python -m tests.kernels.sm90_compile_moe`; tests/kernels/test_moe_triton.py runs it."""

from __future__ import annotations

import torch

from kvc.runtime.models import moe_triton
from tests.kernels.sm90_compile import build

POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "out_ptr": "*bf16",
            "route_w_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
            "src_ptr": "*bf16"}


def main() -> None:
    config = moe_triton.default_config(8192, 8, 128, torch.bfloat16)
    assert config.tma and config.block_m == 128, config
    for tile, extra in ((config, dict(TOP_K=8)), (config.down(), {})):
        kernel = moe_triton._gate_up_kernel if extra else moe_triton._down_kernel
        for tma in (True, False):
            consts = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                          DOT_PRECISION="native", SCALE_COLS=0, EVEN=True, TMA=tma, **extra)
            pointers = dict(POINTERS, w_ptr=f"tensordesc<bf16[{tile.block_n}, {tile.block_k}]>") if tma else POINTERS
            ptx = build(kernel, consts, pointers, aligned=("stride", "N", "K"), num_warps=tile.num_warps,
                        num_stages=tile.num_stages)
            assert "wgmma" in ptx, (kernel.__name__, tma)
            assert ("cp.async.bulk.tensor" in ptx) == tma, (kernel.__name__, tma)
    build(moe_triton._sum_pairs_kernel, dict(TOP_K=8, BLOCK_H=2048), POINTERS, num_warps=4)
    print("MoE prefill kernels compiled for sm90")


if __name__ == "__main__":
    main()
