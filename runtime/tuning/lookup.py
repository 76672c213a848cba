"""The launch-time side of tuning: which config a kernel launch uses.

`tuned(kernel, bucket, source_hash)` is what the generated attention wrappers, `moe_triton` and
`compaction_triton` call before a launch: a dict probe into the table loaded once per process for
the current GPU, returning the tuned knobs or None (then the caller keeps its heuristic). None,
silently (one debug line per kernel and bucket), when the entry is missing or was tuned for
another version of the kernel's module file (its sha256 differs: a recompile invalidates). Configs
are host-side choices fixed per bucket, so a captured CUDA graph keeps the config it was captured
with.

Loading: `load_for_device(device)` (the engine at start; it logs how many entries it loaded), or
lazily at the first lookup for the current device. A file for another GPU is ignored; a corrupt one
gives one warning naming it, then heuristics. `KVC_TUNED_DIR` points at another folder than
`kernels_generated/tuned/`; `activate(table)` installs a table directly (the tuner, tests).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvc.runtime.tuning import table as table_io
from kvc.runtime.tuning.keys import gpu_key, source_hash  # noqa: F401 -- source_hash: for the kernel modules

log = logging.getLogger(__name__)

_ACTIVE: dict[tuple[str, tuple], table_io.Entry] | None = None
_NOTED: set = set()  # (kernel, bucket, why) already debug-logged


def tuned_dir() -> Path:
    """Where the tuning cache files live: $KVC_TUNED_DIR, else kernels_generated/tuned/."""
    override = os.environ.get("KVC_TUNED_DIR")
    if override:
        return Path(override).expanduser()
    from kvc.compiler.cache import GENERATED_DIR

    return GENERATED_DIR / "tuned"


def load(path: Path, device: torch.device | str | None = None) -> dict[tuple[str, tuple], table_io.Entry]:
    """The entries of `path` usable on `device` ({} when missing, for another GPU, or corrupt)."""
    key = gpu_key(device)
    if not path.is_file():
        log.debug("no tuning file %s for %s: heuristic launch configs", path, key.name)
        return {}
    try:
        table = table_io.read(path)
    except table_io.TableError as err:
        log.warning("ignoring the tuning file: %s (launch configs fall back to heuristics; rerun `kvc tune`)", err)
        return {}
    if table.gpu != key:
        log.debug("tuning file %s is for %s, not %s: ignored", path, table.gpu, key)
        return {}
    return table.entries


def load_for_device(device: torch.device | str | None = None, directory: Path | None = None) -> int:
    """Installs this GPU's tuning table for the process; returns (and logs) how many entries."""
    global _ACTIVE
    key = gpu_key(device)
    path = table_io.path_for(directory or tuned_dir(), key)
    _ACTIVE = load(path, device)
    _NOTED.clear()
    if _ACTIVE:
        log.info("tuned kernel configs: %d entries loaded from %s", len(_ACTIVE), path)
    else:
        log.info("tuned kernel configs: none for %s (%s); heuristic launch configs", key.name, path.name)
    return len(_ACTIVE)


def activate(entries: dict[tuple[str, tuple], table_io.Entry] | None) -> None:
    """Installs `entries` as the process's table (None: load lazily again at the next lookup)."""
    global _ACTIVE
    _ACTIVE = None if entries is None else dict(entries)
    _NOTED.clear()


def active() -> dict[tuple[str, tuple], table_io.Entry]:
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = load(table_io.path_for(tuned_dir(), gpu_key()))
    return _ACTIVE


def tuned(kernel: str, bucket: tuple, digest: str) -> dict | None:
    """The tuned knobs of `kernel` at `bucket` when tuned for the module file whose sha256 is
    `digest` (the caller's SOURCE_HASH), or None (the caller's heuristic applies)."""
    entries = _ACTIVE if _ACTIVE is not None else active()
    if not entries:
        return None
    entry = entries.get((kernel, bucket))
    if entry is None:
        _note(kernel, bucket, "no tuned entry")
        return None
    if entry.source_hash != digest:
        _note(kernel, bucket, "tuned for another version of its source (stale hash)")
        return None
    return entry.config


def _note(kernel: str, bucket: tuple, why: str) -> None:
    if (kernel, bucket, why) not in _NOTED:
        _NOTED.add((kernel, bucket, why))
        log.debug("%s at %s: %s, heuristic config", kernel, bucket, why)
