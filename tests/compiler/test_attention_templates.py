"""The engine's attention kernels as templates (compiler/attention.py): deterministic rendering, one
shared module per variant in kernels_generated/_attention/, manifests naming their variant, the
header, freshness (`kvc compile --check`, the runtime's `locate`), and no kernel code left by hand
in runtime/attention/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvc.compiler import attention, cache
from kvc.compiler.cli import OUTPUT_DIR, compile_command
from kvc.dsl import METHODS_DIR

RUNTIME_ATTENTION = Path(attention.__file__).resolve().parent.parent / "runtime" / "attention"


def _fresh_render(name: str, sources: list[str]) -> str:
    attention.render_body.cache_clear()  # render from the templates again, not from the memo
    return attention.render(name, sources)


@pytest.mark.parametrize("name", sorted(attention.VARIANTS))
def test_rendering_twice_gives_identical_bytes(name):
    first = _fresh_render(name, ["methods/a.kvm"]).encode()
    second = _fresh_render(name, ["methods/a.kvm"]).encode()
    assert first == second
    compile(first, f"{name}.py", "exec")  # valid Python


def test_compile_all_twice_is_byte_identical(tmp_path: Path):
    out = tmp_path / "out"
    assert compile_command([], everything=True, output=out, quiet=True) == 0
    first = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert compile_command([], everything=True, output=out, quiet=True) == 0
    second = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert first == second
    # every variant, also those no manifest names (`spec`, `latent`: the engine picks them by KV spec)
    variants = ["_attention/decode_stats.py", "_attention/delta.py", "_attention/latent.py", "_attention/lowrank.py",
                "_attention/plain.py", "_attention/spec.py"]
    assert sorted(n for n in first if n.startswith("_attention/")) == variants
    for name in variants:
        assert first[name] == (OUTPUT_DIR / name).read_bytes()  # the committed modules are these


def test_check_sees_a_stale_missing_or_extra_variant(tmp_path: Path):
    out = tmp_path / "out"
    assert compile_command([], everything=True, output=out, quiet=True) == 0
    plain = out / "_attention" / "plain.py"
    plain.write_text(plain.read_text().replace("BLOCK_N", "BLOCK_K"))
    assert compile_command([], everything=True, check=True, output=out, quiet=True) == 1
    assert compile_command([], everything=True, output=out, quiet=True) == 0
    (out / "_attention" / "old_variant.py").write_text("# left over\n")
    assert compile_command([], everything=True, check=True, output=out, quiet=True) == 1
    assert compile_command([], everything=True, output=out, quiet=True) == 0
    assert not (out / "_attention" / "old_variant.py").exists()
    (out / "_attention" / "decode_stats.py").unlink()
    assert compile_command([], everything=True, check=True, output=out, quiet=True) == 1
    # compiling a few files leaves the shared variants alone
    assert compile_command([str(METHODS_DIR / "h2o.kvm")], output=out, quiet=True) == 0
    assert not (out / "_attention" / "decode_stats.py").exists()


def test_manifests_name_their_variant():
    want = {"full": ("plain", None), "snapkv": ("plain", None), "pyramidkv": ("plain", None),
            "adakv": ("plain", None), "streamingllm": ("plain", None),
            "h2o": ("decode_stats", {"reduce": "group", "fn": "mean"}),
            "tova": ("decode_stats", {"reduce": "head", "fn": "mean"})}
    for method, (variant, fold) in want.items():
        manifest = json.loads((OUTPUT_DIR / method / "manifest.json").read_text())
        assert manifest["attention"] == {"variant": variant, "module": f"_attention/{variant}.py",
                                         "decode_stats": fold}
        for template in attention.VARIANTS[variant].templates:  # a template edit makes the method stale
            assert template in manifest["templates"]
        assert not list((OUTPUT_DIR / method).glob("*attention*.py"))  # no per-method copy


def test_headers_name_the_templates_and_the_methods():
    plain = (OUTPUT_DIR / "_attention" / "plain.py").read_text()
    stats = (OUTPUT_DIR / "_attention" / "decode_stats.py").read_text()
    for text, variant in ((plain, "plain"), (stats, "decode_stats")):
        header = text[: text.index('"""')]
        assert f"attention variant `{variant}`" in header
        assert all(t in header for t in attention.VARIANTS[variant].templates)
    assert "methods/full.kvm" in plain and "methods/snapkv.kvm" in plain and "methods/h2o.kvm" not in plain
    assert "methods/h2o.kvm" in stats and "methods/tova.kvm" in stats and "methods/full.kvm" not in stats


def test_plain_has_no_spliced_code_and_variants_share_the_kernels():
    plain = attention.body_of((OUTPUT_DIR / "_attention" / "plain.py").read_text())
    stats = attention.body_of((OUTPUT_DIR / "_attention" / "decode_stats.py").read_text())
    assert "EMIT_STATS" not in plain and "scores_ptr" not in plain and "EMIT_STATS" in stats
    # every line of plain's kernels is in the variant (it only adds spliced lines), up to the names
    skip = ("VARIANT", "EMITS_DECODE_STATS", '"""Paged attention', "    asks for the step's", "    if stats is not",
            "        raise ValueError(f\"attention variant", "                         \"reads `attn`")
    missing = [line for line in plain.splitlines() if line not in stats.splitlines() and not line.startswith(skip)]
    assert missing == []
    for text in (plain, stats):  # the performance-relevant structure stays
        assert "block_h = max(16, triton.next_power_of_2(group)) if cfg.use_dot" in text
        assert "HAS_STARTS: tl.constexpr" in text and "def decode_num_splits" in text


def test_no_kernel_code_by_hand_in_the_runtime():
    for path in RUNTIME_ATTENTION.glob("*.py"):
        assert "@triton.jit" not in path.read_text(), path
    assert not (RUNTIME_ATTENTION / "decode_stats_triton.py").exists()


def test_variant_for_reads_the_hook_facts():
    assert attention.variant_for({}) == "plain"
    assert attention.variant_for({"decode_after_attention": {"attention": None}}) == "plain"
    assert attention.variant_for({"decode_after_attention": {"attention": {"reduce": "none", "fn": None}}}) == \
        "decode_stats"


def test_locate_uses_the_shipped_module_when_fresh_else_renders_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    assert attention.locate("plain") == OUTPUT_DIR / "_attention" / "plain.py"
    generated = tmp_path / "generated"
    shutil.copytree(OUTPUT_DIR / "_attention", generated / "_attention")
    stale = generated / "_attention" / "plain.py"
    stale.write_text(stale.read_text().replace("MAX_SPLITS = 128", "MAX_SPLITS = 64"))
    path = attention.locate("plain", generated)
    assert path.parent == tmp_path / "cache" / "attention"
    assert attention.body_of(path.read_text()) == attention.render_body("plain")
    assert attention.locate("plain", generated) == path
    with pytest.raises(KeyError, match="unknown attention variant"):
        attention.locate("fp8_dequant")
