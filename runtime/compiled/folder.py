"""A compiled method's folder: where it is, what it declares, and its generated code behind typed names.

First stage of the compiled-method adapter (docs/design.md, "Compiled methods"): `resolve` finds
the folder through the compile cache (`kvc.compiler.cache.locate`; docs/compiler.md, "Compiled on
start") and checks the user's parameters against the .kvm's declarations; `GeneratedCode` is the
one place that reads the names of the generated modules (`torch_lowering.py`, `hooks.py`,
`triton_kernels.py`), so a folder from an older compiler fails here, with a ConfigError saying how
to recompile it.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from kvc.compiler import cache as method_cache
from kvc.dsl import METHODS_DIR, KvmError
from kvc.runtime.attention.metadata import StatsFold
from kvc.runtime.errors import ConfigError
from kvc.runtime.method_api import AttentionKernels
from kvc.runtime.primitives.torch_primitives import clamp_count

GENERATED = method_cache.GENERATED_DIR
ALL_QUERIES = -1  # a query window of every prompt query (H2O's column sums over the prompt)


def available() -> list[str]:
    """Shipped method names: generated folders and methods/*.kvm (compiled on start when stale)."""
    shipped = {p.parent.name for p in GENERATED.glob("*/manifest.json")}
    return sorted(shipped | {p.stem for p in METHODS_DIR.glob("*.kvm")})


def served() -> list[str]:
    """Shipped methods the engine runs (generated manifests marked lowered), the baseline without
    hooks first: the tools' default set (`kvc eval`, `kvc bench throughput`)."""
    names = [p.parent.name for p in sorted(GENERATED.glob("*/manifest.json"))
             if (method_cache.read_manifest(p.parent) or {}).get("lowered")]
    baseline = [n for n in names if not (method_cache.read_manifest(GENERATED / n) or {}).get("hooks")]
    return baseline + [n for n in names if n not in baseline]


def resolve(spec: str, params: dict[str, Any] | None, lowered: bool = True) -> tuple[str, dict, dict[str, Any], Path]:
    """A shipped method name, compiled folder or .kvm path -> (name, manifest, checked parameters,
    folder) of its (possibly just compiled) code; user errors become `ConfigError`s. `lowered`: a
    method the compiler did not lower is an error (False: its manifest is enough, as for training
    its inputs)."""
    compiled = _locate(spec)
    if compiled is None:
        raise ConfigError(f"unknown method {spec!r}; available: {', '.join(available())} (or the path of a .kvm "
                          "file or of a compiled folder)", param="method")
    manifest = compiled.manifest
    if lowered and not manifest.get("lowered", False):
        reason = manifest.get("reason", "no reason given")
        raise ConfigError(f"method {spec!r} is not lowered by the compiler yet: {reason}", param="method")
    name = manifest.get("method", spec)
    return name, manifest, check_params(name, manifest, dict(params or {}), compiled.source), compiled.folder


def _locate(spec: str) -> method_cache.CompiledFolder | None:
    try:
        return method_cache.locate(spec, generated=GENERATED)
    except FileNotFoundError:
        raise ConfigError(f"method file {spec!r} does not exist (give a shipped method name, the path of "
                          "a .kvm file or a folder compiled by `kvc compile FILE --out DIR`)", param="method") from None
    except method_cache.FolderError as e:
        raise ConfigError(e.message, param="method") from None
    except KvmError as e:
        raise ConfigError(f"method {spec!r} does not compile:\n{e}", param="method") from None
    except OSError as e:
        raise ConfigError(f"cannot compile method {spec!r} into {method_cache.cache_dir()}: {e}; set "
                          f"{method_cache.CACHE_ENV} to a writable folder", param="method") from None


def check_params(name: str, manifest: dict, params: dict[str, Any], source: Path | None = None) -> dict[str, Any]:
    """`params` over the manifest's defaults; unknown names, and (when the .kvm is known) values out
    of its declared ranges and types, are `ConfigError`s pointing at the .kvm line."""
    declared = manifest.get("parameters", {})
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise ConfigError(f"method {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; "
                          f"its parameters: {', '.join(sorted(declared)) or 'none'}", param="method_params")
    try:
        from kvc.dsl import check_file

        if source is not None:
            check_file(source, dict(params))
    except ConfigError:
        raise
    except Exception as e:  # KvmError: a clear diagnostic pointing at the .kvm line
        raise ConfigError(f"method {name!r}: bad method_params {params!r}: {e}", param="method_params") from None
    return {**{k: v["default"] for k, v in declared.items()}, **params}


class GeneratedCode:
    """One method's generated folder, loaded by file path (docs/compiler.md, "What is generated per
    method"). `lowering` and `hooks` are the modules themselves; everything the adapter calls is
    read here, by name, once."""

    def __init__(self, name: str, folder: Path, manifest: dict) -> None:
        self.name, self.folder, self.manifest = name, folder, manifest
        self.lowering: ModuleType = method_cache.load_module(folder, "torch_lowering")
        self.hooks: ModuleType = method_cache.load_module(folder, "hooks")
        self.facts: dict[str, dict] = manifest.get("hooks", {})  # hook -> its facts (compiler/hook_facts.py)
        self.states: list[str] = list(getattr(self.lowering, "STATES", []))  # per-token states, declaration order
        # the torch lowering of each hook the method has (None: it has none)
        self.chunk_hook: Callable | None = self.optional("prefill_chunk")
        # the parameters each hook reads (a state no parameter shapes is the same under every one)
        self.hook_params: dict[str, list[str]] | None = getattr(self.lowering, "HOOK_PARAMS", None)
        self.end_scores: Callable | None = self.optional("prefill_end_scores")
        self.end_select: Callable | None = self.optional("prefill_end_select")
        self.score: Callable | None = self.optional("score")  # a whole prompt's prefill_end scores
        self.end_reads_v = "v" in self.facts.get("prefill_end", {}).get("inputs", ["v"])  # does prefill_end read v?
        # the contract code of hooks.py (compiler/contract_code.py), which every method has
        self.query_window_of: Callable[[dict], int | None] = self._contract("query_window")
        self.decode_query_window: Callable[[dict], int] = self._contract("decode_query_window")  # step_end's q
        self.held_tokens: Callable = self._contract("held_tokens")
        self.keep_tails: dict[str, Callable] = self._contract("KEEP_TAILS")  # keeping hook -> its `+ last N`
        self.keep_periods: dict[str, Callable] = self._contract("KEEP_PERIODS")  # `where step % n == 0` -> n
        self.kv_spec: Callable = self._contract("kv_spec")
        self.page_tokens: Callable = self._contract("page_tokens")
        self.dense_operands: Callable = self._contract("dense_operands")
        self.attention = _attention_kernels(name, manifest)
        self.fused_names = _fused_kernels(manifest)  # hook -> its fused Triton kernel
        self.fused_kernels: dict[str, Callable] | None = None  # loaded on first GPU use

    def optional(self, function: str) -> Callable | None:
        """A function of the torch lowering, None when the method has no such hook."""
        return getattr(self.lowering, function, None)

    def required(self, function: str) -> Callable:
        """A function of the torch lowering that the manifest's facts say exists."""
        value = self.optional(function)
        if value is None:
            raise ConfigError(f"the generated torch_lowering.py of method {self.name!r} has no `{function}`, which its "
                              "manifest's hook facts need; run `kvc compile --all` (or recompile the method's folder)",
                              param="method")
        return value

    def _contract(self, attr: str) -> Any:
        value = getattr(self.hooks, attr, None)
        if value is None:
            raise ConfigError(f"the generated hooks.py of method {self.name!r} predates `{attr}`; run `kvc compile "
                              "--all` (or recompile the method's folder)", param="method")
        return value

    def query_window(self, params: dict[str, Any]) -> int:
        """How many trailing prompt queries prefill_end reads (ALL_QUERIES: every one)."""
        window = self.query_window_of(params)
        return ALL_QUERIES if window is None else int(window)

    def kept_tail(self, hook: str, sym: dict, params: dict[str, Any], length: int) -> int:
        """How many of the newest of `length` stored tokens `hook`'s keep always keeps (`+ last N`)."""
        tail = self.keep_tails.get(hook)
        return 0 if tail is None else clamp_count(tail(sym, params), length)

    def fused(self, hook: str) -> Callable | None:
        """The fused Triton entry point computing `hook` (None: not fused); triton_kernels.py is
        imported on the first call."""
        if hook not in self.fused_names:
            return None
        if self.fused_kernels is None:
            kernels = method_cache.load_module(self.folder, "triton_kernels")
            self.fused_kernels = {h: getattr(kernels, name) for h, name in self.fused_names.items()}
        return self.fused_kernels[hook]


def _fused_kernels(manifest: dict) -> dict[str, str]:
    """hook -> the fused kernel computing all of it: a prefill_end or step_end kernel that is the keep's
    whole score (not accumulating), a prefill_chunk kernel that is the hook's only statement, or a read's
    page scores (decode_before_attention)."""
    fused = {}
    for kernel in manifest.get("kernels", []):
        hook, flags = kernel.get("hook"), kernel.get("flags", {})
        if hook in ("prefill_end", "step_end") and not flags.get("ACCUMULATE", False):
            for name in (hook, *kernel.get("also", ())):
                fused[name] = kernel["name"]
        elif hook == "prefill_chunk" and flags.get("ACCUMULATE", False) and flags.get("WHOLE_HOOK", False):
            fused[hook] = kernel["name"]
        elif hook == "decode_before_attention" and kernel.get("family") == "page_scores":
            fused[hook] = kernel["name"]  # the read's page scores (the plan's pages stay the torch lowering's)
    return fused


def _attention_kernels(name: str, manifest: dict) -> AttentionKernels:
    """The manifest's `attention` entry: the attention variant and the decode statistics it emits."""
    entry = manifest.get("attention")
    if entry is None:
        raise ConfigError(f"the generated manifest of method {name!r} predates attention variants; run "
                          "`kvc compile --all`", param="method")
    fold = entry.get("decode_stats")
    return AttentionKernels(entry["variant"], None if fold is None else StatsFold(fold["reduce"], fold["fn"]))
