"""Methods compiled on start: `LLM(model, method="path/to/mine.kvm")` and a stale shipped method
recompiled into the compile cache ($KVC_CACHE_DIR), on a tiny random Llama, float32 CPU; broken
or missing .kvm files give the DSL's file:line:col diagnostic through LLM(...) and `kvc generate`.
A folder from `kvc compile FILE --out DIR` serves as it is, and is refused once its .kvm changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvc.compiler import cache
from kvc.compiler.cli import OUTPUT_DIR
from kvc.dsl import METHODS_DIR
from kvc.runtime.compiled import folder as compiled_folder
from kvc.runtime.cli import main
from kvc.runtime.errors import ConfigError
from kvc.runtime.methods import resolve_method
from tests.models.tiny import make_tiny_llama
from tests.runtime.test_compiled_methods import LENGTHS, generate, make_llm, prompts_of

SNAP = {"budget": 32, "window": 8, "kernel": 5}
BAD = "method bad : eviction\n\non prefill_end:\n  keep top(windw, 4, per kv_head)\n"


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "kvc-cache"))
    return tmp_path / "kvc-cache" / "methods"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def user_method(folder: Path) -> Path:
    """snapkv under another name, its defaults changed to SNAP."""
    text = (METHODS_DIR / "snapkv.kvm").read_text()
    for old, new in (("method snapkv :", "method mine :"), ("budget: tokens = 2048", "budget: tokens = 32"),
                     ("window: tokens = 32", "window: tokens = 8")):
        assert old in text
        text = text.replace(old, new)
    path = folder / "mine.kvm"
    path.write_text(text)
    return path


def test_a_user_kvm_serves_like_the_shipped_method(model_dir, tmp_path, cache_root):
    path = user_method(tmp_path)
    shipped_before = sorted(p.as_posix() for p in OUTPUT_DIR.rglob("*") if "__pycache__" not in p.parts)
    mine = make_llm(model_dir, str(path), None)
    method = mine.engine.method
    assert method.name == "mine" and method.params == {**SNAP, "pooling": "avg", "every": 0}
    assert Path(method.lowering.__file__).parent.parent == cache_root
    assert all(method.budget.kept(101, layer) == 32 for layer in range(2))  # the user's defaults apply
    prompts = prompts_of(LENGTHS, seed=21)
    assert generate(mine, prompts) == generate(make_llm(model_dir, "snapkv", SNAP), prompts)
    shipped_after = sorted(p.as_posix() for p in OUTPUT_DIR.rglob("*") if "__pycache__" not in p.parts)
    assert shipped_after == shipped_before  # nothing written into the package


def test_user_params_are_checked_by_the_user_kvm(tmp_path):
    path = user_method(tmp_path)
    assert resolve_method(str(path), {"budget": 40}).params["budget"] == 40
    with pytest.raises(ConfigError, match="no parameter.*'heavy'"):
        resolve_method(str(path), {"heavy": 0.2})
    with pytest.raises(ConfigError, match=f"{path}:.*window"):
        resolve_method(str(path), {"window": -3})


@pytest.fixture
def generated_copy(tmp_path, monkeypatch) -> Path:
    """A temporary kernels_generated/ the resolver reads instead of the real one."""
    copy = tmp_path / "generated"
    for name in ("snapkv", "tova", "kivi"):
        shutil.copytree(OUTPUT_DIR / name, copy / name)
    monkeypatch.setattr(compiled_folder, "GENERATED", copy)
    return copy


def test_a_stale_shipped_method_is_recompiled_once(generated_copy, cache_root, caplog):
    manifest = json.loads((generated_copy / "snapkv" / "manifest.json").read_text())
    manifest["source_sha256"] = "0" * 64
    (generated_copy / "snapkv" / "manifest.json").write_text(json.dumps(manifest))
    fresh = resolve_method("tova", {"budget": 28})
    assert Path(fresh.lowering.__file__).parent == generated_copy / "tova"
    before = cache.compiles
    with caplog.at_level("INFO", logger="kvc.compiler.cache"):
        method = resolve_method("snapkv", SNAP)
    assert cache.compiles == before + 1
    assert [r.getMessage().split(" into ")[0] for r in caplog.records] == [
        "compiled method snapkv from methods/snapkv.kvm (stale: snapkv.kvm changed since snapkv/ was generated)"]
    entry = Path(method.lowering.__file__).parent
    assert entry.parent == cache_root
    stamp = (entry / "torch_lowering.py").stat().st_mtime_ns
    again = resolve_method("snapkv", SNAP)  # a cache hit: not compiled again
    assert cache.compiles == before + 1 and Path(again.lowering.__file__).parent == entry
    assert (entry / "torch_lowering.py").stat().st_mtime_ns == stamp
    assert json.loads((generated_copy / "snapkv" / "manifest.json").read_text())["source_sha256"] == "0" * 64
    shutil.rmtree(generated_copy / "tova")  # a missing folder: compiled too
    assert Path(resolve_method("tova").lowering.__file__).parent.parent == cache_root


def test_a_stale_method_serves_the_same_tokens(model_dir, generated_copy):
    (generated_copy / "snapkv" / "hooks.py").write_text("raise RuntimeError('a stale file must not load')\n")
    prompts = prompts_of(LENGTHS[-2:], seed=22)
    recompiled = make_llm(model_dir, "snapkv", SNAP)
    assert Path(recompiled.engine.method.lowering.__file__).parent != generated_copy / "snapkv"
    tokens = generate(recompiled, prompts)
    assert tokens == generate(make_llm(model_dir, str(user_method(generated_copy.parent)), None), prompts)


def test_errors_through_llm(model_dir, tmp_path):
    bad = tmp_path / "bad.kvm"
    bad.write_text(BAD)
    with pytest.raises(ConfigError) as info:
        make_llm(model_dir, str(bad), None)
    message = str(info.value)
    assert f"{bad}:4:12: error: unknown name 'windw'" in message
    assert "    4 |   keep top(windw, 4, per kv_head)" in message and "|            ^^^^^" in message
    with pytest.raises(ConfigError, match="does not exist"):
        make_llm(model_dir, str(tmp_path / "missing.kvm"), None)
    variant = tmp_path / "turboquant_prod.kvm"  # QJL sketches: not lowered
    shutil.copy(METHODS_DIR.parent / "bench" / "variants" / "turboquant_prod.kvm", variant)
    with pytest.raises(ConfigError, match=r"not lowered.*qjl.*turboquant_prod.kvm:10:1"):
        make_llm(model_dir, str(variant), None)


def test_errors_through_the_cli(model_dir, tmp_path, capsys):
    (tmp_path / "bad.kvm").write_text(BAD)
    env = {**os.environ, cache.CACHE_ENV: str(tmp_path / "kvc-cache")}
    done = subprocess.run([sys.executable, "-m", "kvc.runtime.cli", "generate", "--model", str(model_dir),
                           "--device", "cpu", "--method", "bad.kvm"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "bad.kvm:4:12: error: unknown name 'windw'" in done.stderr and "^^^^^" in done.stderr
    # the same path in-process (a subprocess per case is slow on a shared machine)
    bad = str(tmp_path / "bad.kvm")
    cases = {"serve": (bad, f"{bad}:4:12: error: unknown name 'windw'"),
             "generate": (str(tmp_path / "nothere.kvm"), f"method file '{tmp_path / 'nothere.kvm'}' does not exist")}
    for command, (method, expected) in cases.items():
        assert main([command, "--method", method, "--model", str(model_dir), "--device", "cpu"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("kvc: error: ") and expected in err and "Traceback" not in err, err


def test_the_cli_serves_a_user_kvm(model_dir, tmp_path, cache_root, capsys):
    path = user_method(tmp_path)
    prompt = " ".join(str(t) for t in range(5, 45))
    assert main(["generate", "--model", str(model_dir), "--device", "cpu", "--method", str(path),
                 "--prompt-ids", prompt, "--max-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert any(p.name.startswith("mine-") for p in cache_root.iterdir())


def test_a_compiled_folder_serves_like_its_kvm(model_dir, tmp_path, cache_root, capsys):
    path = user_method(tmp_path)
    folder = tmp_path / "compiled"
    assert main(["compile", str(path), "--out", str(folder)]) == 0
    assert capsys.readouterr().out == f"compiled {path} into {folder} (serve it with --method {folder})\n"
    served = make_llm(model_dir, str(folder), None)
    assert Path(served.engine.method.lowering.__file__).parent == folder and served.engine.method.name == "mine"
    assert not cache_root.exists()  # used as it is: nothing compiled
    prompts = prompts_of(LENGTHS[-2:], seed=23)
    assert generate(served, prompts) == generate(make_llm(model_dir, str(path), None), prompts)
    assert resolve_method(str(folder), {"budget": 40}).params["budget"] == 40
    with pytest.raises(ConfigError, match=f"{path}:.*window"):  # params still checked by the .kvm
        resolve_method(str(folder), {"window": -3})


def test_a_stale_folder_is_refused_through_llm_and_the_cli(model_dir, tmp_path, capsys):
    path = user_method(tmp_path)
    folder = tmp_path / "compiled"
    assert main(["compile", str(path), "--out", str(folder)]) == 0
    capsys.readouterr()
    path.write_text(path.read_text().replace("kernel: int = 5", "kernel: int = 7"))
    expected = (f"{path.resolve()} changed since {folder} was compiled from it; recompile it with "
                f"`kvc compile {path.resolve()} --out {folder}`")
    with pytest.raises(ConfigError) as info:
        make_llm(model_dir, str(folder), None)
    assert str(info.value) == expected and info.value.param == "method"
    assert main(["generate", "--model", str(model_dir), "--device", "cpu", "--method", str(folder)]) == 1
    err = capsys.readouterr().err
    assert err == f"kvc: error: {expected}\n"
    assert main(["compile", str(path), "--out", str(folder)]) == 0  # the command it names fixes it
    assert make_llm(model_dir, str(folder), None).engine.method.params["kernel"] == 7
