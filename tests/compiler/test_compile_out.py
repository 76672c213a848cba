"""Methods outside the repository: `kvc compile FILE --out DIR` writes exactly what `kvc compile`
writes for a shipped method into DIR, a user's .kvm without `--out` goes to the compile cache, and
nothing but a shipped method is written into kernels_generated/; `cache.locate(DIR)` serves a
compiled folder only while its files match its manifest and its .kvm is unchanged, and otherwise
refuses with the command that recompiles it."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from kvc.compiler import cache, codegen
from kvc.compiler.cli import OUTPUT_DIR, compile_command
from kvc.dsl import METHODS_DIR
from kvc.errors import KvcError


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "kvc-cache"))
    return tmp_path / "kvc-cache" / "methods"


def _package_tree() -> dict[str, int]:
    return {p.relative_to(OUTPUT_DIR).as_posix(): p.stat().st_mtime_ns for p in OUTPUT_DIR.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def user_method(folder: Path, name: str = "mine") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.kvm"
    path.write_text((METHODS_DIR / "snapkv.kvm").read_text().replace("method snapkv :", f"method {name} :"))
    return path


def test_out_writes_exactly_the_method_files_and_nothing_into_the_package(tmp_path: Path, capsys, cache_root):
    src = user_method(tmp_path / "src")
    before = _package_tree()
    out = tmp_path / "compiled" / "mine"
    assert compile_command([str(src)], out=out) == 0
    assert capsys.readouterr().out == f"compiled {src} into {out} (serve it with --method {out})\n"
    assert sorted(_tree(out)) == ["__init__.py", "hooks.py", "manifest.json", "torch_lowering.py", "triton_kernels.py"]
    assert _tree(out) == {name: text.encode() for name, text in codegen.generate(src).items()}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == src.resolve().as_posix() and manifest["method"] == "mine"
    assert compile_command([str(src)], out=out, check=True, quiet=True) == 0
    assert _package_tree() == before
    assert not cache_root.exists()  # --out compiles nothing into the cache either


def test_a_user_kvm_without_out_goes_to_the_cache(tmp_path: Path, capsys, cache_root):
    src = user_method(tmp_path)
    before = _package_tree()
    assert compile_command([str(src)]) == 0
    [entry] = cache_root.iterdir()
    assert capsys.readouterr().out.startswith(f"compiled {src} into {entry} (serve it with --method {src}")
    assert _tree(entry) == {name: text.encode() for name, text in codegen.generate(src.resolve()).items()}
    assert cache.locate(str(src)).folder == entry  # the engine finds the same entry
    assert _package_tree() == before


def test_out_recompiles_in_place_and_check_sees_a_changed_kvm(tmp_path: Path, capsys):
    src, out = user_method(tmp_path), tmp_path / "out"
    assert compile_command([str(src)], out=out, quiet=True) == 0
    (out / "__pycache__").mkdir()  # what importing the folder leaves: kept
    src.write_text(src.read_text().replace("kernel: int = 5", "kernel: int = 7"))
    assert compile_command([str(src)], out=out, check=True, quiet=True) == 1
    assert f"{out} is stale; run `kvc compile {src} --out {out}`" in capsys.readouterr().err
    assert compile_command([str(src)], out=out, quiet=True) == 0
    assert compile_command([str(src)], out=out, check=True, quiet=True) == 0
    assert json.loads((out / "manifest.json").read_text())["parameters"]["kernel"]["default"] == 7


def test_out_refuses_what_it_would_clobber(tmp_path: Path):
    src = user_method(tmp_path)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine\n")
    with pytest.raises(KvcError, match="not empty and holds no manifest.json"):
        compile_command([str(src)], out=busy)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(KvcError, match="not a folder"):
        compile_command([str(src)], out=busy / "notes.txt")
    with pytest.raises(KvcError, match="exactly one .kvm"):
        compile_command([str(src), str(METHODS_DIR / "tova.kvm")], out=tmp_path / "two")
    with pytest.raises(KvcError, match="exactly one .kvm"):
        compile_command([], everything=True, out=tmp_path / "all")
    with pytest.raises(KvcError, match="give the folder with --out DIR"):
        compile_command([str(src)], check=True)


def _compiled(tmp_path: Path, name: str = "mine") -> tuple[Path, Path]:
    src = user_method(tmp_path / "src", name)
    out = tmp_path / "out" / name
    assert compile_command([str(src)], out=out, quiet=True) == 0
    return src, out


def _fix(src: Path, out: Path) -> str:
    return f"`kvc compile {shlex.quote(str(src))} --out {shlex.quote(str(out))}`"


def test_a_fresh_folder_is_located_as_it_is(tmp_path: Path, cache_root):
    src, out = _compiled(tmp_path)
    found = cache.locate(str(out))
    assert found.folder == out and found.source == src.resolve() and found.manifest["method"] == "mine"
    assert cache.locate(str(out) + "/").folder == out
    assert not cache_root.exists()  # nothing compiled


def test_a_stale_folder_is_refused_with_the_command_that_fixes_it(tmp_path: Path):
    src, out = _compiled(tmp_path)
    src.write_text(src.read_text() + "# changed\n")
    with pytest.raises(cache.FolderError) as info:
        cache.locate(str(out))
    fix = _fix(src.resolve(), out)
    assert str(info.value) == f"{src.resolve()} changed since {out} was compiled from it; recompile it with {fix}"


def test_an_edited_folder_is_refused(tmp_path: Path):
    src, out = _compiled(tmp_path)
    (out / "hooks.py").write_text((out / "hooks.py").read_text() + "# edited\n")
    with pytest.raises(cache.FolderError, match=f"{out / 'hooks.py'} does not match {out / 'manifest.json'}: the "
                       f"folder changed since it was compiled from {src.resolve()}; recompile it with"):
        cache.locate(str(out))
    src.unlink()  # the .kvm is gone: the folder's own hashes still guard it
    with pytest.raises(cache.FolderError, match="which no longer exists"):
        cache.locate(str(out))
    (out / "hooks.py").unlink()
    with pytest.raises(cache.FolderError, match="hooks.py does not match"):
        cache.locate(str(out))


def test_a_folder_from_another_compiler(tmp_path: Path, caplog):
    src, out = _compiled(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "compiler_version": "0.0.1"}))
    with pytest.raises(cache.FolderError, match=r"by another compiler \(generated by kvc.compiler 0.0.1"):
        cache.locate(str(out))
    src.unlink()  # nothing to recompile from: used as it is, with a warning
    with caplog.at_level("WARNING", logger="kvc.compiler.cache"):
        assert cache.locate(str(out)).source is None
    assert "0.0.1" in caplog.text and "used as it is" in caplog.text


def test_a_folder_without_manifest(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(cache.FolderError, match=f"method folder {tmp_path / 'empty'} holds no manifest.json"):
        cache.locate(str(tmp_path / "empty"))


def test_a_shipped_copy_checks_against_the_shipped_kvm(tmp_path: Path):
    copy = tmp_path / "snapkv-copy"
    shutil.copytree(OUTPUT_DIR / "snapkv", copy)
    assert cache.locate(str(copy)).source == METHODS_DIR / "snapkv.kvm"  # "methods/snapkv.kvm": the repository's


def test_a_bare_name_is_a_shipped_method_first_then_a_folder(tmp_path: Path, monkeypatch):
    _, out = _compiled(tmp_path, "tova")
    _compiled(tmp_path, "mine")
    monkeypatch.chdir(tmp_path / "out")
    assert cache.locate("tova").folder == OUTPUT_DIR / "tova"
    assert cache.locate("mine").folder == Path("mine")
    assert cache.locate("./tova").folder == Path("tova") and cache.locate("./tova").manifest == json.loads(
        (out / "manifest.json").read_text())
