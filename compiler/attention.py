"""Attention variants: the engine's paged-attention kernels rendered from templates.

Pipeline position: beside `codegen`. `codegen` asks `variant_for(hook facts)` which variant a
method runs and writes it into the manifest (`manifest["attention"]`); `kvc compile --all` renders
each variant the shipped methods name once, into `kernels_generated/_attention/<variant>.py`
(never one copy per method); the engine (runtime/attention/triton_ops.py) loads the module for
its method through `locate(variant)`.

A variant is the module template `paged_attention.py.jinja` (which includes one template per kernel
family: `paged_store_kv`, `paged_decode`, `paged_prefill`) plus the code a variant template splices
in at named points, or a module template of its own (`lowrank`: low-rank latents,
paged_lowrank.py.jinja; `delta`: DeltaKV codes, paged_delta.py.jinja; `latent`: MLA's latent cache,
paged_latent.py.jinja). `plain` splices nothing
(every method that only reads the cache, `full` included); `decode_stats` (methods whose decode hook
reads `attn`: H2O, TOVA) makes the decode kernels emit the attention statistics; `spec` is rendered
`by_spec`: K and V each dense or quantized (codes, scales, zero points, residual windows), read-plan
decode, quantizing store, and the statistics, every encoding parameter a constexpr of the launch, plus
the register-mma decode (paged_spec_mma.py.jinja, Gluon) for the encodings it fits.
`variant_for_spec` picks one from a KV spec (runtime/kv/spec.py) alone. Splice points and what is in scope there:

- `module_doc`, `module_imports`, `module_end`: the module docstring, imports, last code;
- `store_rows` (store_kv, after loading the new rows): `k`, `v` [BLOCK_H, BLOCK_D], `mask`;
- `k_tile`, `v_tile` (decode and prefill, after a K / V tile load, decoded already in `by_spec` variants):
  `k` / `v` [BLOCK_N, BLOCK_D], `tokens`, `pages`, `in_page`, `kv_mask`;
- `decode_scores` (decode split kernel, after the QK^T tile): `qk` [BLOCK_H, BLOCK_N] float32
  scaled base-2 logits (-inf where masked), `seq`, `heads`, `head_mask`, `tokens`, `token_mask`,
  `num_q_heads`;
- `prefill_scores` (prefill tile, after QK^T and the causal mask): `qk` [BLOCK_M, BLOCK_N],
  `tokens`, `rows_pos`;
- `decode_params`, `decode_args`: extra parameters of both decode kernels / their launch
  arguments (the wrapper's locals);
- `decode_split_end`, `decode_reduce_end`: after the split loop (`m_i`, `l_i`, `acc`, `heads`) /
  after the reduce (`m`, `total`, `head`);
- `decode_prepare`, `decode_finish`: `paged_decode` before / after the launches (`stats`, `batch`,
  `num_q_heads`, `group`, `starts`, `stride_sb`).

Rendering is deterministic: the same templates give the same bytes; the header names the
templates and the .kvm files whose manifests name the variant.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

MODULE_TEMPLATE = "paged_attention.py.jinja"
FAMILY_TEMPLATES = ("paged_store_kv.py.jinja", "paged_decode.py.jinja", "paged_prefill.py.jinja")
SPEC_TEMPLATES = ("paged_spec.py.jinja", "paged_spec_mma.py.jinja")  # the helpers of variants rendered by_spec
FOLDER = "_attention"  # kernels_generated/_attention/<variant>.py
SPLICE_POINTS = ("module_doc", "module_imports", "module_end", "store_rows", "k_tile", "v_tile", "decode_scores",
                 "prefill_scores", "decode_params", "decode_args", "decode_split_end", "decode_reduce_end",
                 "decode_prepare", "decode_finish")


@dataclass(frozen=True)
class Variant:
    name: str
    splices: str | None  # the template whose macros fill splice points (None: nothing spliced)
    emits_decode_stats: bool  # paged_decode(..., stats=...) fills the decode statistics
    # K/V as a KV spec stores them: quantized sources, residual windows, read plans (else dense
    # caches over whole contexts, and the kernels exactly as they were before specs)
    by_spec: bool = False
    reads: tuple[str, ...] = ()  # templates the splices import
    module: str = MODULE_TEMPLATE  # a whole module of its own (`lowrank`) instead of the families

    @property
    def templates(self) -> list[str]:
        if self.module != MODULE_TEMPLATE:
            return [self.module]
        return [MODULE_TEMPLATE, *FAMILY_TEMPLATES, *(SPEC_TEMPLATES if self.by_spec else ()),
                *([self.splices] if self.splices else []), *self.reads]


VARIANTS = {
    "plain": Variant("plain", None, False),
    "decode_stats": Variant("decode_stats", "paged_variant_decode_stats.py.jinja", True),
    "spec": Variant("spec", "paged_variant_spec.py.jinja", True, by_spec=True,
                    reads=("paged_variant_decode_stats.py.jinja",)),
    "lowrank": Variant("lowrank", None, False, module="paged_lowrank.py.jinja"),
    "delta": Variant("delta", None, False, module="paged_delta.py.jinja"),
    "latent": Variant("latent", None, False, module="paged_latent.py.jinja"),
}


def variant_for(hook_facts: dict, dense: bool = True, low_rank: bool = False, delta: bool = False) -> str:
    """The variant a method runs (`dense`: K and V stored as they are), from its hook facts (`compiler/hook_facts.py`):
    `spec` when a hook answers with read plans, the one emitting decode statistics when
    decode_after_attention reads `attn`, else `plain` (the engine picks by its KV spec:
    `variant_for_spec`)."""
    after = hook_facts.get("decode_after_attention") or {}
    reads = any(facts.get("reads") for facts in hook_facts.values())
    return variant_for_spec(dense, bool(after.get("attention")), reads, low_rank, delta)


def variant_for_spec(dense: bool, decode_stats: bool = False, read_plan: bool = False, low_rank: bool = False,
                     delta: bool = False, latent: bool = False) -> str:
    """The variant that reads a KV spec's K/V: `dense` is `KVSpec.dense` (runtime/kv/spec.py: keys
    and values both `Dense`), `decode_stats` whether decode emits statistics, `read_plan` whether
    decode may take a ReadPlan. Dense K/V over whole contexts keep the kernels they always ran
    (`plain`, `decode_stats`); anything else runs `spec`, whose launches take the encodings (bits,
    group, zero point, packing, residual window) as constexprs: one module for every encoding;
    low-rank latents (`low_rank`: K or V a `LowRank`) run `lowrank`, a module of its own, and DeltaKV
    codes (`delta`: the spec's `Delta`) `delta`; MLA's latent cache (`latent`: `KVSpec.latent`, values a
    view of the keys) `latent`, whose decode hands statistics and read plans to the torch ops."""
    if latent:
        return "latent"
    if delta:
        return "delta"
    if low_rank:
        return "lowrank"
    if dense and not read_plan:
        return "decode_stats" if decode_stats else "plain"
    return "spec"


def manifest_entry(hook_facts: dict, dense: bool = True, low_rank: bool = False, delta: bool = False) -> dict:
    """manifest["attention"]: the variant, its module, and the statistics its decode emits (`dense`:
    the method's K and V are stored as they are)."""
    name = variant_for(hook_facts, dense, low_rank, delta)
    after = hook_facts.get("decode_after_attention") or {}
    return {"variant": name, "module": f"{FOLDER}/{name}.py",
            "decode_stats": after.get("attention") if VARIANTS[name].emits_decode_stats else None}


def _variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise KeyError(f"unknown attention variant {name!r}; this compiler has {', '.join(sorted(VARIANTS))} "
                       "(run `kvc compile --all`)") from None


def _env() -> jinja2.Environment:
    from kvc.compiler.codegen import _ENV

    return _ENV


def _splicer(variant: Variant):
    """`splice(point, indent)` for the templates: the variant's macro of that name, indented, each
    line preceded by a newline (so `{{- splice(...) }}` on its own line vanishes when empty)."""
    module = _env().get_template(variant.splices).module if variant.splices else None
    if module is not None:
        unknown = sorted(n for n in dir(module) if not n.startswith("_") and n not in SPLICE_POINTS)
        if unknown:
            raise ValueError(f"{variant.splices} defines {', '.join(unknown)}, not splice points ({SPLICE_POINTS})")

    def splice(point: str, indent: int) -> str:
        if point not in SPLICE_POINTS:
            raise ValueError(f"template uses an undeclared splice point {point!r}")
        macro = getattr(module, point, None) if module is not None else None
        if macro is None:
            return ""
        lines = textwrap.dedent(str(macro())).rstrip().split("\n")
        return "".join("\n" + (" " * indent + line if line.strip() else "") for line in lines)

    return splice


def template_names() -> list[str]:
    return sorted({t for v in VARIANTS.values() for t in v.templates})


@lru_cache(maxsize=None)
def render_body(name: str) -> str:
    """The variant's module without its header (what freshness compares)."""
    from kvc.compiler.codegen import _tidy

    variant = _variant(name)
    text = _env().get_template(variant.module).render(
        header="", variant=name, emits_decode_stats=variant.emits_decode_stats, by_spec=variant.by_spec,
        splice=_splicer(variant))
    return _tidy(text).lstrip("\n")


def header(name: str, sources: list[str]) -> str:
    from kvc.compiler.codegen import COMPILER_VERSION

    lines = [f"# Generated by kvc.compiler {COMPILER_VERSION}: attention variant `{name}`, from the templates"]
    lines += [f"#   {t}" for t in _variant(name).templates]
    lines.append("# for the methods whose manifests name it:")
    lines += [f"#   {s}" for s in sorted(sources)] or ["#   (none)"]
    lines.append("# Do not edit: change the templates and run `kvc compile --all`.")
    return "\n".join(lines) + "\n"


def render(name: str, sources: list[str]) -> str:
    """The whole module of one variant; `sources` are the .kvm paths that name it."""
    return header(name, sources) + render_body(name)


def body_of(text: str) -> str:
    """A rendered module without its header comment lines."""
    lines = text.split("\n")
    first = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "\n".join(lines[first:])


def render_all(users: dict[str, list[str]]) -> dict[str, str]:
    """`{relative path: text}` of kernels_generated/_attention/ for `{variant: [.kvm paths]}`: every
    variant, those no manifest names too (the engine picks `spec` by a method's KV spec)."""
    return {f"{FOLDER}/{name}.py": render(name, users.get(name, [])) for name in sorted(VARIANTS)}


def locate(name: str, generated: Path | None = None) -> Path:
    """The file of variant `name` for this compiler: the shipped kernels_generated/_attention/
    module when its body is what the templates render now, else a copy rendered into the compile
    cache ($KVC_CACHE_DIR/attention/<variant>-<hash>.py), written once and atomically."""
    from kvc.compiler import cache

    body = render_body(name)
    shipped = (generated or cache.GENERATED_DIR) / FOLDER / f"{name}.py"
    if shipped.is_file() and body_of(shipped.read_text()) == body:
        return shipped
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    target = cache.cache_dir().parent / "attention" / f"{name}-{digest}.py"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        with os.fdopen(fd, "w") as f:
            f.write(render(name, ["(rendered on demand: the shipped module is stale or missing)"]))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    return target
