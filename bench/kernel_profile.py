"""Where a decode attention kernel's time goes (a GPU with Nsight Compute): Nsight Compute's report of one
launch of a method's split kernel (bench/decode_profile.py: Qwen3-30B-A3B's attention shape, bf16;
`delta`: DeltaKV's decode kernel over a plan of 2048 tokens, bench/delta_decode_bench.py), its details and
SASS source pages, and the kernel's Triton IR (TTGIR: layouts and conversions), PTX and SASS, packed into
OUT/METHOD.tgz (one file a kernel).

    python bench/kernel_profile.py --method kivi --out OUT [--shape 32x32768]
    python bench/kernel_profile.py --method kivi --knobs mma=1,num_splits=3 --kernel mma_decode_kernel --out OUT
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SHOWN = re.compile(r"Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|"
                   r"Theoretical Occ|Issue Slots|No Eligible")


def run(argv: list[str], log: Path, **kw) -> int:
    with open(log, "w") as f:
        try:
            return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
        except FileNotFoundError:
            f.write(f"{argv[0]}: not found\n")
            return 127
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {kw.get('timeout')} s\n")
            return 124


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", required=True, help="a method of bench/decode_profile.py (kivi, dense, fp8, ...) "
                   "or delta")
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="32x32768", help="BATCHxCONTEXT (default 32x32768)")
    p.add_argument("--knobs", help="paged_decode's launch knobs, e.g. mma=1,num_splits=3")
    p.add_argument("--kernel", help="the kernel's name (default: split_kernel; delta: delta_decode_kernel)")
    p.add_argument("--timeout", type=float, default=150, help="seconds for the profiled run")
    a = p.parse_args()

    out = Path(a.out).resolve()
    folder = out / a.method
    cache = Path(f"/tmp/triton-profile-{a.method}")
    shutil.rmtree(cache, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    if a.method == "delta":
        kernel = a.kernel or "delta_decode_kernel"
        cmd = [sys.executable, "delta_decode_bench.py", "--shapes", a.shape, "--reads", "plan"]
    else:
        kernel = a.kernel or "split_kernel"
        cmd = [sys.executable, "decode_profile.py", "--method", a.method, "--shape", a.shape,
               *(["--knobs", a.knobs] if a.knobs else [])]
    report = folder / "profile"
    rc = run(["ncu", "--clock-control", "none", "--kernel-name", f"regex:{kernel}", "--launch-skip", "1",
              "--launch-count", "1", "--set", "full", "--import-source", "yes", "-o", str(report), "-f", *cmd],
             folder / "ncu.log", cwd=BENCH, env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, timeout=a.timeout)
    print(f"profile {a.method}: rc={rc}")
    print("\n".join((folder / "ncu.log").read_text(errors="replace").splitlines()[-2:]))
    rep = f"{report}.ncu-rep"
    run(["ncu", "--import", rep, "--page", "details"], folder / "details.txt")
    run(["ncu", "--import", rep, "--page", "source", "--csv", "--print-source", "sass"], folder / "source_sass.csv")
    details = (folder / "details.txt").read_text(errors="replace").splitlines()
    print("\n".join([line for line in details if SHOWN.search(line)][:20]))
    for f in cache.rglob(f"*{kernel}*") if cache.exists() else []:
        if f.suffix in (".ttgir", ".ptx", ".cubin"):
            shutil.copy(f, folder / f.name)
            if f.suffix == ".cubin":
                run(["cuobjdump", "-sass", str(f)], folder / f"{f.stem}.sass")
    with tarfile.open(out / f"{a.method}.tgz", "w:gz") as tar:
        tar.add(folder, arcname=a.method)
    shutil.rmtree(folder)
    return rc


if __name__ == "__main__":
    sys.exit(main())
