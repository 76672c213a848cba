"""kvc's on-disk model cache: folders that kvc builds once (the random tiny model, GGUF conversions)
and loads afterwards, under `$KVC_CACHE_DIR` (default ~/.cache/kvc).

A folder is built in a staging directory beside its target and renamed into place, so a reader
never sees a half-written model, and an interrupted build leaves only a staging folder that the
next build removes. A lock file serialises builders of one target (two servers starting at once,
two test workers): the second waits and then finds the finished folder.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "KVC_CACHE_DIR"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else $KVC_CACHE_DIR, else ~/.cache/kvc."""
    root = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvc"
    return Path(root).expanduser()


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(staging_dir)` unless it exists already (atomically, under a lock)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():  # another process built it while we waited
            return target
        for stale in target.parent.glob(f".{target.name}-*"):  # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            build(staging)
            os.rename(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target
