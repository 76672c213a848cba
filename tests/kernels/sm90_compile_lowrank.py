"""Compiles the `lowrank` attention module's decode kernel for an H100/H200 (sm90) on a machine without
a GPU (Triton's passes and ptxas, as tests/kernels/sm90_compile.py does for `spec`): the GLM/Qwen3-30B
shape (head_dim 128, 8 query heads a KV head) with four KV heads a latent group at half rank, keys
before RoPE. `python -m tests.kernels.sm90_compile_lowrank`; tests/methods/test_palu.py runs it in a
subprocess."""

from __future__ import annotations

import importlib.util

from kvc.compiler import attention
from tests.kernels.sm90_compile import build


def main() -> None:
    path = attention.locate("lowrank")
    spec = importlib.util.spec_from_file_location("kvc_lowrank_sm90", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "k_up_ptr": "*bf16", "freq_ptr": "*fp32",
                "tables_ptr": "*i32", "lens_ptr": "*i32", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
    for rope in (True, False):
        consts = dict(QUERY_GROUP=8, GROUP=4, SHARE=64, RANK=256, HEAD_DIM=128, PAGE_SIZE=16, ROPE=rope, BLOCK_H=16,
                      BLOCK_R=256, BLOCK_N=64, BLOCK_HALF=64, PRECISION="tf32")
        build(mod._decode_split_kernel, consts, pointers)
    print("lowrank decode kernel compiled for sm90")


if __name__ == "__main__":
    main()
