"""Compiles the `latent` attention module's decode and prefill kernels for an H100/H200 (sm90) on a machine
without a GPU (Triton's passes and ptxas, as tests/kernels/sm90_compile.py does for `spec`): GLM-4.7-Flash's
shape (20 query heads over one latent head of 512 + 64 RoPE channels), bf16 (and FP8 latents for decode), at
the launch defaults and the other tiles bench/latent_decode_bench.py sweeps; prints each build's registers,
spills and shared memory.
`python -m tests.kernels.sm90_compile_latent`; tests/kernels/test_latent_attention.py runs it in a subprocess."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

from kvc.compiler import attention
from tests.kernels.sm90_compile import build

SHAPE = dict(HEADS=20, RANK=512, ROPE=64, PAGE_SIZE=16, BLOCK_P=64, HAS_STARTS=False, SCALED=False,
             PRECISION="native")
POINTERS = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "scale_ptr": "*bf16", "out_ptr": "*bf16", "tables_ptr": "*i32",
            "lens_ptr": "*i32",
            "starts_ptr": "*i32", "cu_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}


def _report(name: str, ptx: str, options: dict) -> None:
    """ptxas -v's registers, spill stores and shared memory of one build."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(source), "-o",
                               str(Path(folder) / "kernel.o")], capture_output=True, text=True, check=True)
    usage = " ".join(m.group(0) for m in re.finditer(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes smem",
                                                       done.stderr))
    print(name, options, usage)


def _tma_decode(mod) -> None:
    """The warp-specialized decodes (Gluon): TMA copies a page at a time, warpgroup MMA in the consumer, and the
    register split between the loader warp and the consumer warpgroup (setmaxnreg); over FP8 latents, the
    converter warpgroup's."""
    gl = mod.gl
    boxes = {"lat_desc": [16, 512], "rope_desc": [16, 64]}
    types = {**POINTERS, "scale_log2": "fp32"}
    types |= {name: f"tensordesc<bf16{box},{gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)!r}>"
              for name, box in boxes.items()}
    shape = dict(HEADS=20, RANK=512, ROPE=64, PAGE_SIZE=16, BLOCK_H=32, BOX=16)
    fp8 = {name: f"tensordesc<fp8e4nv{box},{gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv)!r}>"
           for name, box in boxes.items()}
    for starts in (False, True):
        ptx = build(mod._decode_tma_kernel, dict(shape, HAS_STARTS=starts, STAGES=mod.TMA_STAGES), types,
                    num_warps=4)
        for part in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg"):
            assert part in ptx, f"the TMA decode kernel lost {part}"
        _report(f"decode TMA, warp-specialized, starts={starts}", ptx, dict(num_warps=4))
    consts = dict(HEADS=20, RANK=512, ROPE=64, PAGE_SIZE=16, BLOCK_H=32, BOX=16, STAGES=mod.TMA_STAGES,
                  CODE_STAGES=mod.CODE_STAGES, HAS_STARTS=True, CONVERTER_REGS=mod.CONVERTER_REGS)
    ptx = build(mod._decode_fp8_kernel, consts, {**types, **fp8}, num_warps=4)
    for part in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "cvt.rn.f16x2.e4m3x2"):
        assert part in ptx, f"the FP8 converter kernel lost {part}"
    _report("decode FP8, converter warpgroup", ptx, dict(num_warps=4))


def _column_votes() -> None:
    """SnapKV's prefill-end window scores (`column_votes`) over MLA's absorbed queries and latent keys (576
    channels, padded to 1024) at the heuristic's tiles: within a block's shared memory."""
    from kvc.runtime.primitives import triton_primitives as prims

    for queries in (8, 32, 64):
        cfg = prims.votes_config(queries, True, head_dim=576)
        for fn, rows in ((prims._row_stats, "BLOCK_Q"), (prims._columns, "BLOCK_R")):  # the query rows a program takes
            consts = {"HEAD_DIM": 576, rows: cfg["block_q"], "BLOCK_K": cfg["block_k"], "BLOCK_D": 1024, "IEEE": False,
                      "HEADS_A_BLOCK": cfg["block_q"] // queries if cfg["block_q"] % queries == 0 else 0, **prims.DENSE}
            ptx = build(fn, consts, {"q_ptr": "*bf16", "k_ptr": "*bf16", "scale": "fp32"}, num_warps=cfg["num_warps"])
            _report(f"column votes {fn.__name__}, {queries} queries", ptx, cfg)


def main() -> None:
    spec = importlib.util.spec_from_file_location("kvc_latent_sm90", attention.locate("latent"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    aligned = ("stride_q", "stride_k")  # as a launch specialises them: the copies pipeline (16-byte cp.async)
    for block_n, warps, stages in ((64, 8, 2), (64, 4, 3), (32, 8, 3)):
        options = dict(num_warps=warps, num_stages=stages)
        ptx = build(mod._decode_split_kernel, dict(BLOCK_H=32, BLOCK_N=block_n, **SHAPE), POINTERS, aligned,
                    **options)
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, "the decode kernel lost its warpgroup MMA or pipeline"
        _report(f"decode BLOCK_N={block_n}", ptx, options)
    _tma_decode(mod)
    fp8 = dict(SHAPE, SCALED=True)
    options = dict(num_warps=8, num_stages=2)
    ptx = build(mod._decode_split_kernel, dict(BLOCK_H=32, BLOCK_N=32, **fp8), {**POINTERS, "kv_ptr": "*fp8e4nv"},
                aligned, **options)
    _report("decode FP8 latents BLOCK_N=32", ptx, options)
    options = dict(num_warps=4, num_stages=3)
    ptx = build(mod._decode_balanced_kernel, dict(BLOCK_H=32, BLOCK_N=64, BLOCK_B=32, **SHAPE), POINTERS, aligned,
                **options)
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx, "the balanced decode lost its warpgroup MMA or pipeline"
    _report("decode, balanced schedule, BLOCK_N=64", ptx, options)
    for balanced in (False, True):
        ptx = build(mod._decode_reduce_kernel, dict(HEADS=20, RANK=512, BLOCK_N=64, SPLIT_BLOCK=16, BLOCK_B=32,
                                                    HAS_STARTS=False, BALANCED=balanced), POINTERS, num_warps=4)
        _report(f"decode reduce, balanced={balanced}", ptx, dict(num_warps=4))
    for block_m, block_n, warps, stages in ((32, 32, 8, 2), (64, 32, 8, 1)):
        options = dict(num_warps=warps, num_stages=stages)
        ptx = build(mod._prefill_kernel, dict(BLOCK_M=block_m, BLOCK_N=block_n, **SHAPE), POINTERS, **options)
        _report(f"prefill BLOCK_M={block_m} BLOCK_N={block_n}", ptx, options)
    _column_votes()
    print("latent kernels compiled for sm90")


if __name__ == "__main__":
    main()
