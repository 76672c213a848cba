"""The SASS of a decode attention kernel for sm90, compiled on this machine (no GPU needed): shared memory,
registers and spills (ptxas -v), and the instruction mix of its main loop's body per warp and tile. A proxy
for iterating on a kernel between GPU runs: this machine's Triton may differ from the GPU image's (compare
with `bench/kernel_profile.py`, which keeps the GPU's SASS); the counts are static, per loop trip.

    python bench/kernel_sass.py --method kivi                      # the spec kernel at KIVI-2's bench shape
    python bench/kernel_sass.py --method kivi --window 0 --block-n 64 --warps 8
    python bench/kernel_sass.py --method kivi-mma                  # the register-mma decode (Gluon) instead
    python bench/kernel_sass.py --sass path/to/kernel.sass         # the loop mix of a SASS listing
    KVC_SPEC_PATH=/tmp/spec.py python bench/kernel_sass.py          # an edited copy of the generated module
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import tempfile

LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the longest backward branch's body: the main loop's trip."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(LINE.match, sass.splitlines()) if m]
    best = None
    for addr, text in ins:
        if "BRA" not in text:
            continue
        target = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if target and int(target.group(1), 16) < addr:
            span = (int(target.group(1), 16), addr)
            best = span if best is None or span[1] - span[0] > best[1] - best[0] else best
    if best is None:
        return 0, collections.Counter()
    body = [t for a, t in ins if best[0] <= a <= best[1]]
    ops = collections.Counter()
    for t in body:
        words = t.split()
        op = words[1] if words[0].startswith("@") else words[0]
        ops[op.split(".")[0]] += 1
    return len(body), ops


def _spec_module():
    """The generated `spec` module (`KVC_SPEC_PATH`: an edited copy instead)."""
    from kvc.compiler import attention

    spec = importlib.util.spec_from_file_location("kvc_spec_sass", os.environ.get("KVC_SPEC_PATH")
                                                  or attention.locate("spec"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(fn, consts: dict, pointers: dict, default_pointer: str, **options):
    """`fn` compiled for sm90: constexprs from `consts`, pointer types from `pointers` (else `default_pointer`),
    `qk_scale` fp32, other scalars i32; pointers, strides and word strides divisible by 16, as Triton specialises
    the real launch's (else no vector loads or 16-byte copies)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", consts.get(name, fn.params[i].default)
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, default_pointer)
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if not fn.params[i].is_constexpr and (name.endswith("_ptr") or name.startswith(("stride", "words")))}
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    return triton.compile(source(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def compile_spec_decode(method: str, block_n: int, warps: int, stages: int, window: int, group: int):
    """The `spec` decode split kernel at the method's Qwen3-30B-A3B bench shape (head_dim 128, GQA 8, bf16)."""
    if method != "kivi":
        raise SystemExit(f"--method {method}: only kivi's config is spelled out here")
    kivi = dict(BITS=2, PER_ELEMENT=4, ASYM=True, WINDOW=window, BOOK=0, FRESH=False, ROT=False)
    ops = {f"K_{k}": v for k, v in (kivi | dict(GROUP=1, FLUSH=128 if window else 0)).items()}
    ops |= {f"V_{k}": v for k, v in (kivi | dict(GROUP=32, FLUSH=0)).items()}
    consts = dict(EMIT_STATS=False, GROUP=group, BLOCK_H=16, BLOCK_N=block_n, DIRECT_OUT=False, USE_DOT=True,
                  DOT_PRECISION="native", HAS_STARTS=False, READ=0, HAS_LAST=False, K_FOLD=4, V_FOLD=0, ASM=True,
                  TAIL=False, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=32, **ops)
    pointers = {f"{x}_{p}_ptr": "*bf16" for x in "kv" for p in ("scale", "zero", "resid", "rot")}
    pointers |= {f"{x}_book_ptr": "*fp32" for x in "kv"} | {"q_ptr": "*bf16", "out_ptr": "*bf16",
                                                            "k_cache_ptr": "*u8", "v_cache_ptr": "*u8"}
    return _compile(_spec_module()._decode_split_kernel, consts, pointers, "*i32", num_warps=warps,
                    num_stages=stages)


def compile_mma_decode(maxnreg: int | None = None):
    """The `spec` module's register-mma decode (`_mma_decode_kernel`, Gluon) at KIVI-2's bench shape: 8 query heads a
    KV head, windows of 129 slots (keys flushed in blocks of 128)."""
    pointers = {"kc_ptr": "*u8", "vc_ptr": "*u8", "table_ptr": "*i32", "context_lens_ptr": "*i32",
                "resid_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    consts = dict(GROUP=8, K_WINDOW=129, K_FLUSH=128, V_WINDOW=129, V_FLUSH=0)
    return _compile(_spec_module()._mma_decode_kernel, consts, pointers, "*bf16", num_warps=1, maxnreg=maxnreg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="kivi")
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--window", type=int, default=129, help="the residual window's slots (0: none)")
    p.add_argument("--group", type=int, default=8, help="query heads a KV head")
    p.add_argument("--sass", help="a SASS listing to read instead of compiling")
    p.add_argument("--maxnreg", type=int, help="kivi-mma: ptxas's register cap")
    a = p.parse_args()
    if a.sass:
        with open(a.sass) as f:
            n, ops = loop_mix(f.read())
        print(f"{a.sass}: loop body {n} instructions\n  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))
        return
    import triton

    if a.method == "kivi-mma":
        kernel = compile_mma_decode(a.maxnreg)
    else:
        kernel = compile_spec_decode(a.method, a.block_n, a.warps, a.stages, a.window, a.group)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(kernel.asm["cubin"])
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(90)
        ptxas = subprocess.run([getattr(tool, "path", None) or tool[0], "-v", "--gpu-name=sm_90a",
                                os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")], capture_output=True, text=True)
    usage = " ".join(line.split(":", 1)[-1].strip() for line in ptxas.stderr.splitlines()
                     if "registers" in line or "spill" in line)
    n, ops = loop_mix(sass)
    print(f"triton {triton.__version__}, sm90: shared {kernel.metadata.shared} bytes; {usage}")
    print(f"loop body {n} instructions a warp and tile\n  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))


if __name__ == "__main__":
    main()
