"""Compiles the `spec` attention module's store, decode and prefill kernels for an H100/H200
(sm90) with FP8 operands, or KIVI's 2-bit ones (keys a block at a time, with the flush kernel), or
TurboQuant's (rotated), or the `delta` module's decode, on a machine without a GPU: Triton's front
end, its passes and ptxas run as they would on the GPU, so a kernel that does not compile for the
hardware fails here too. `python -m tests.kernels.sm90_compile CODES` (fp8e4nv, fp8e5, int2, sphere3
or delta); tests/kernels/test_fp8.py and
tests/methods/test_kivi.py run it in a subprocess (the interpreter, TRITON_INTERPRET=1, replaces
kernels with Python)."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvc.compiler import attention


SHARED_BYTES = 232448  # an H100/H200 block's most shared memory (227 KB)


def build(fn, consts: dict, pointers: dict, aligned: tuple[str, ...] = (), **options) -> str:
    """PTX of `fn` for sm90: constexprs from `consts` (or their defaults), pointer types (or any argument's, e.g. a
    TMA descriptor's) from `pointers` (else fp32 pointers; integers for the rest), launch
    `options` (num_warps, num_stages); fails when the kernel needs more shared memory than a block has.
    Pointers and the integer arguments whose names start with one of `aligned` are divisible by 16, as
    Triton specialises a launch's."""
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name] = "constexpr"
            param = fn.params[i]
            constexprs[(i,)] = consts[name] if name in consts or not param.has_default else param.default
        elif name in pointers or name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*fp32")
        else:
            signature[name] = "i64" if name.startswith("stride") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if aligned and
             not fn.params[i].is_constexpr and (name.endswith("_ptr") or name.startswith(aligned))}
    source = ASTSource if not getattr(fn, "is_gluon", lambda: False)() else _gluon_source()
    kernel = triton.compile(source(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options or None)
    assert kernel.metadata.shared <= SHARED_BYTES, (fn.__name__, options, kernel.metadata.shared)
    return kernel.asm["ptx"]


def _gluon_source():
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource


def delta() -> None:
    """The `delta` variant's decode kernel at DeltaKV's defaults on the Qwen3-30B-A3B shape (head_dim 128,
    4 KV heads of 8 query heads, a code of 4 x 64 channels), bf16, over token plans and over every position."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvc_delta_sm90", attention.locate("delta"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pointers = {n: "*bf16" for n in ("q_ptr", "latent_ptr", "centers_ptr", "sinks_ptr", "window_ptr", "up_ptr",
                                     "bias_ptr")}
    pointers |= {n: "*i32" for n in ("tables_ptr", "lens_ptr", "rows_ptr", "plan_ptr", "last_ptr", "near_ptr")}
    shape = dict(GROUP=8, BLOCK_H=16, HEAD_DIM=128, BLOCK_HALF=64, CODE=256, SHARE=64, BLOCK_C=256, PAGE_SIZE=16,
                 SINK=8, RECENT=128, EVERY=8, COUNT=4, NEAR_SHARE=1, HAS_BIAS=True, BLOCK_N=32, PRECISION="tf32")
    for read in (True, False):
        build(mod._delta_decode_kernel, dict(READ=read, HAS_LAST=read, **shape), pointers, num_warps=8, num_stages=1)
    print("compiled for sm90: delta")


def main(codes: str) -> None:
    import importlib.util

    if codes == "delta":
        return delta()
    path = attention.locate("spec")
    spec = importlib.util.spec_from_file_location("kvc_spec_sm90", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pointers = {f"{x}_{p}_ptr": "*bf16" for x in "kv" for p in ("scale", "zero", "resid", "rot")}
    pointers |= {f"{x}_book_ptr": "*fp32" for x in "kv"}
    code_type = "u8" if codes in ("int2", "sphere3") else codes
    pointers |= {"k_cache_ptr": f"*{code_type}", "v_cache_ptr": f"*{code_type}", "k_ptr": "*bf16", "v_ptr": "*bf16",
                 "q_ptr": "*bf16", "out_ptr": "*bf16", "slot_ptr": "*i64", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16",
                 "x_ptr": "*bf16", "codes_ptr": "*u8", "scale_ptr": "*bf16", "zero_ptr": "*bf16", "resid_ptr": "*bf16"}
    pointers |= {n: "*i32" for n in ("block_tables_ptr", "context_lens_ptr", "kv_starts_ptr", "rows_ptr",
                                     "resid_lens_ptr", "plan_ptr", "last_ptr", "counts_ptr", "cu_seqlens_ptr")}
    ops = {f"{x}_{c}": v for x in "KV" for c, v in (("BITS", 8), ("PER_ELEMENT", 1), ("GROUP", 128), ("ASYM", False),
                                                     ("WINDOW", 0), ("FLUSH", 0), ("BOOK", 0),
                                                     ("FRESH", False), ("ROT", False))}
    shape = dict(HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16)
    if codes == "int2":  # KIVI-2: keys per channel (one scale a channel at every slot), values per 32 channels
        kivi = dict(BITS=2, PER_ELEMENT=4, ASYM=True, WINDOW=129)
        ops = {f"K_{c}": v for c, v in (kivi | dict(GROUP=1, FLUSH=128, BOOK=0, FRESH=True, ROT=False)).items()}
        ops |= {f"V_{c}": v for c, v in (kivi | dict(GROUP=32, FLUSH=0, BOOK=0, FRESH=True, ROT=False)).items()}
        shape["PAGE_SIZE"] = 32
        build(mod._flush_blocks_kernel, dict(HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=32, BITS=2, PER_ELEMENT=4, GROUP=32,
                                             ASYM=True, WINDOW=129, FLUSH=128, HAS_HELD=True), pointers)
    if codes == "sphere3":  # TurboQuant-3: 8 codes in 3 bytes indexing 8 levels, one RMS scale a token, rotated
        ops = {f"{x}_{c}": v for x in "KV" for c, v in (("BITS", 3), ("PER_ELEMENT", 8), ("GROUP", 128),
                                                         ("ASYM", False), ("WINDOW", 0), ("FLUSH", 0), ("BOOK", 8),
                                                         ("FRESH", True), ("ROT", True))}
    ptx = build(mod._store_kv_kernel, dict(NUM_KV_HEADS=8, BLOCK_H=16 if ops["K_ROT"] else 8,
                                           K_BLOCK_G=128 // ops["K_GROUP"], V_BLOCK_G=128 // ops["V_GROUP"], BLOCK_B=1,
                                           CODES=True, DOT_PRECISION="native", **shape, **ops),
                pointers)
    assert codes in ("int2", "sphere3") or "cvt.rn.satfinite" in ptx  # the FP8 cast of the store
    # decode: every way it takes an operand's scales out (`_fold`: 0 dequantize, 1 per tile, 2 per slot, 3 per layer,
    # 4 per page of a tile of pages) that this encoding allows, with the packed codes unpacked by inline PTX (ASM)
    # and without; (K fold, V fold, BLOCK_N)
    folds = {"int2": [(1, 0, 32), (4, 0, 64), (0, 0, 64)], "sphere3": [(2, 2, 32), (0, 0, 32)]}.get(
        codes, [(3, 3, 32), (1, 1, 32), (2, 2, 32), (0, 0, 32)])
    for (k_fold, v_fold, block_n), asm in [(f, True) for f in folds] + [(f, False) for f in folds[:2]]:
        build(mod._decode_split_kernel, dict(EMIT_STATS=False, GROUP=4, BLOCK_H=16, BLOCK_N=block_n, DIRECT_OUT=True,
                                             USE_DOT=True, DOT_PRECISION="native", HAS_STARTS=False, READ=0,
                                             HAS_LAST=False, K_FOLD=k_fold, V_FOLD=v_fold, ASM=asm, TAIL=False,
                                             HAS_COUNTS=False, **shape, **ops),
              pointers)
    # a plan's estimate, one more partial: bf16 pseudo-keys, float32 values, on the tensor cores
    for has_rows in (False, True):  # the index's views over every sequence row, or the decode rows' copies
        build(mod._estimate_kernel, dict(GROUP=8, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_E=64,
                                         DOT_PRECISION="native", USE_DOT=True, HAS_ROWS=has_rows),
              {"q_ptr": "*bf16", "keys_ptr": "*bf16", "values_ptr": "*bf16", "log_w_ptr": "*fp32",
               "rows_ptr": "*i32"})
    # a packed token plan (each head's count, the row's newest slots after it) over gathered slots
    build(mod._decode_split_kernel, dict(EMIT_STATS=False, GROUP=4, BLOCK_H=16, BLOCK_N=32, DIRECT_OUT=False,
                                         USE_DOT=True, DOT_PRECISION="native", HAS_STARTS=False, READ=2,
                                         HAS_LAST=True, K_FOLD=0, V_FOLD=0, ASM=True, TAIL=False, HAS_COUNTS=True,
                                         **shape, **ops),
          pointers)
    if codes == "int2" and mod._MMA is not None:
        # the register-mma decode (Gluon) over the coded pages, and the split kernel over each row's rest (TAIL)
        build(mod._decode_split_kernel, dict(EMIT_STATS=False, GROUP=8, BLOCK_H=16, BLOCK_N=128, DIRECT_OUT=False,
                                             USE_DOT=True, DOT_PRECISION="native", HAS_STARTS=False, READ=0,
                                             HAS_LAST=False, K_FOLD=4, V_FOLD=0, ASM=True, TAIL=True, HAS_COUNTS=False,
                                             **shape, **ops),
              pointers)
        mma = {"q_ptr": "*bf16", "kc_ptr": "*u8", "vc_ptr": "*u8", "table_ptr": "*i32", "context_lens_ptr": "*i32",
               "resid_lens_ptr": "*i32"} | {f"{x}_ptr": "*bf16" for x in ("ks", "kz", "vs", "vz")}
        ptx = build(mod._mma_decode_kernel, dict(GROUP=8, K_WINDOW=129, K_FLUSH=128, V_WINDOW=129, V_FLUSH=0), mma,
                    ("stride", "words"), num_warps=1)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "cp.async" in ptx
        assert "movmatrix.sync.aligned.m8n8.trans.b16" in ptx
    # prefill: the fp32 parity config, and Hopper's (128 x 128 tiles, 3 stages; with a residual window, tiles of
    # mod.PREFILL_WINDOW_BLOCK_N), codes-only tiles folding as the decode's do
    build(mod._prefill_kernel, dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=16, BLOCK_N=64, DOT_PRECISION="ieee",
                                    HAS_STARTS=False, K_FOLD=0, V_FOLD=0, ASM=False, **shape, **ops), pointers)
    windowed = ops["K_WINDOW"] or ops["V_WINDOW"]
    block_n = mod.PREFILL_WINDOW_BLOCK_N if windowed else 128
    for k_fold, v_fold, _ in folds[:2]:
        # tiles of whole pages; codebook levels dequantized (`_prefill_fold`)
        k_fold, v_fold = (0 if ops["K_BOOK"] else 4 if f == 1 and windowed else f for f in (k_fold, v_fold))
        build(mod._prefill_kernel, dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=32, BLOCK_N=block_n, DOT_PRECISION="native",
                                        HAS_STARTS=False, K_FOLD=k_fold, V_FOLD=v_fold, ASM=True, **shape, **ops),
              pointers, num_warps=8, num_stages=3)
    print("compiled for sm90:", codes)


if __name__ == "__main__":
    main(sys.argv[1])
