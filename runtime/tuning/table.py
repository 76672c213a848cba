"""The tuning cache file: `kernels_generated/tuned/<gpu-slug>.json`, one per kind of GPU.

Human-readable JSON; one entry per kernel per shape bucket:

    {"format": 1,
     "gpu": {"name": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0"},
     "entries": [
       {"kernel": "attention.plain.decode", "family": "decode",
        "bucket": {"batch": 64, "context": 32768, "q_heads": 32, "kv_heads": 4, "head_dim": 128,
                   "dtype": "bfloat16"},
        "config": {"num_splits": 2, "block_n": 64, "num_warps": 4, "num_stages": 3},
        "untuned_config": {...}, "untuned_ms": 0.412, "tuned_ms": 0.371,
        "source": "kernels_generated/_attention/plain.py", "source_hash": "<sha256>",
        "tuned_at": "2025-01-01T00:00:00Z"}]}

`read` validates everything a launch will use (bucket fields, knob names and values); a file it
cannot read is a `TableError` naming the file, which the lookup turns into one warning and the
heuristics. A file for another GPU (its `gpu` differs from the key asked for) is ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvc.runtime.tuning import buckets
from kvc.runtime.tuning.keys import GpuKey

FORMAT = 1


class TableError(ValueError):
    """A tuning cache file that cannot be used (the message names the file)."""


@dataclass(frozen=True)
class Entry:
    kernel: str  # e.g. "attention.plain.decode", "moe.fused_experts", "kv.compaction"
    family: str  # a key of buckets.FAMILIES
    bucket: tuple  # in the family's field order
    config: dict  # knobs -> values: what the launch uses
    source: str  # the module file holding the kernel (for people)
    source_hash: str  # its sha256 when tuned (what the lookup compares)
    untuned_config: dict = field(default_factory=dict)
    untuned_ms: float | None = None
    tuned_ms: float | None = None
    tuned_at: str = ""

    @property
    def key(self) -> tuple[str, tuple]:
        return (self.kernel, self.bucket)

    def to_json(self) -> dict:
        data = asdict(self)
        data["bucket"] = buckets.as_dict(self.family, self.bucket)
        return data


@dataclass
class Table:
    gpu: GpuKey
    entries: dict[tuple[str, tuple], Entry] = field(default_factory=dict)

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry

    def to_json(self) -> dict:
        ordered = sorted(self.entries.values(), key=lambda e: (e.kernel, [str(v) for v in e.bucket]))
        return {"format": FORMAT, "gpu": self.gpu.to_json(), "entries": [e.to_json() for e in ordered]}


def path_for(directory: Path, gpu: GpuKey) -> Path:
    return Path(directory) / f"{gpu.slug}.json"


def _entry(data: dict) -> Entry:
    family = data["family"]
    if family not in buckets.FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}")
    knobs = buckets.FAMILIES[family].knobs
    config = data["config"]
    if not isinstance(config, dict) or not config:
        raise ValueError("config must be a non-empty object")
    for name, value in config.items():
        if name not in knobs:
            raise ValueError(f"{family} has no knob {name!r} (knobs: {', '.join(knobs)})")
        problem = buckets.check_knob(name, value)
        if problem:
            raise ValueError(problem)
    if not isinstance(data["kernel"], str) or not isinstance(data["source_hash"], str):
        raise ValueError("kernel and source_hash must be strings")
    return Entry(
        kernel=data["kernel"], family=family, bucket=buckets.from_dict(family, data["bucket"]), config=dict(config),
        source=str(data.get("source", "")), source_hash=data["source_hash"],
        untuned_config=dict(data.get("untuned_config") or {}), untuned_ms=data.get("untuned_ms"),
        tuned_ms=data.get("tuned_ms"), tuned_at=str(data.get("tuned_at", "")),
    )


def read(path: Path) -> Table:
    """The table in `path`; TableError (naming the file and the problem) when it cannot be used."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise TableError(f"{path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise TableError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise TableError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"{path}: not a kvc tuning file of format {FORMAT}")
    try:
        table = Table(GpuKey.from_json(data["gpu"]))
    except (KeyError, TypeError, ValueError) as err:
        raise TableError(f"{path}: bad `gpu`: {err}") from None
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise TableError(f"{path}: `entries` must be a list")
    for i, item in enumerate(entries):
        try:
            table.add(_entry(item))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise TableError(f"{path}: entry {i}: {err}") from None
    return table


def write(path: Path, table: Table) -> None:
    """Writes `table` atomically (readers never see a partial file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(table.to_json(), f, indent=1)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def merge(path: Path, gpu: GpuKey, new: list[Entry]) -> Table:
    """The table at `path` (when it is this GPU's and readable) with `new` entries replacing theirs."""
    table = Table(gpu)
    if path.is_file():
        try:
            old = read(path)
        except TableError:
            old = None  # a corrupt file is rewritten from scratch
        if old is not None and old.gpu == gpu:
            table.entries.update(old.entries)
    for entry in new:
        table.add(entry)
    return table
