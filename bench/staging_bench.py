"""What a step's host inputs cost to stage for the GPU (runtime/transfer.py): `to_device` (pinned through
torch's caching host allocator, then an async copy), the pinning alone, and a plain pageable `.to`, warm,
per call, for the shapes a 32K prompt's 8K chunk sends on Qwen3-30B-A3B (slot mapping [48, 8192] int64, page
tables [48, 1, 2048] int32, positions [8192] int64). The host time of a step's preparation is exposed
before its first kernel (docs/benchmarks.md, issue 23's prefill: the wall over the kernels).

    python bench/staging_bench.py --out staging.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

SHAPES = (((48, 8192), np.int64), ((48, 1, 2048), np.int32), ((8192,), np.int64))


def per_call_ms(fn, reps: int, sync) -> float:
    for _ in range(5):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    seconds = time.perf_counter() - start
    sync()
    return seconds / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the plain conversions")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()

    from kvc.runtime.transfer import to_device

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for shape, dtype in SHAPES:
        host = np.zeros(shape, dtype)
        paths = {"to_device": lambda: to_device(host, device),
                 "pageable .to": lambda: torch.from_numpy(host).to(device)}
        if cuda:
            paths["pin_memory"] = lambda: torch.from_numpy(host).pin_memory()
        for name, fn in paths.items():
            ms = per_call_ms(fn, a.reps, sync)
            rows.append({"path": name, "shape": list(shape), "mib": host.nbytes / 2**20, "host_ms": ms})
            print(f"{name:14s} {str(shape):14s} {host.nbytes / 2**20:6.2f} MiB  {ms:.3f} ms a call (host)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
