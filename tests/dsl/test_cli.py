"""`kvc check` and `kvc fmt`: exit codes, output, and in-place formatting."""

from __future__ import annotations

from pathlib import Path

from kvc.dsl import METHODS_DIR
from kvc.runtime.cli import main

GOOD = "method good : eviction\nparam budget: tokens = 64\non step_end:\n  keep last budget\n"


def test_check_the_catalogue(capsys) -> None:
    assert main(["check", str(METHODS_DIR)]) == 0
    assert "no errors" in capsys.readouterr().out


def test_check_reports_every_error_of_every_file(tmp_path: Path, capsys) -> None:
    a = tmp_path / "a.kvm"
    a.write_text("method a : eviction\non step_end:\n  keep last budgt\n  keep last (3 - 5)\n")
    b = tmp_path / "b.kvm"
    b.write_bytes(b"method b : eviction\n\xff\n")
    assert main(["check", str(a), str(b), str(tmp_path / "missing.kvm")]) == 1
    err = capsys.readouterr().err
    assert f"{a}:3:13: error: unknown name 'budgt'" in err
    assert f"{a}:4:14: error: `last` count is negative" in err
    assert f"{b}:2:1: error: invalid UTF-8 byte 0xff" in err
    assert "missing.kvm:1:1: error: no such file or directory" in err
    assert "Traceback" not in err


def test_check_with_overrides(tmp_path: Path, capsys) -> None:
    (tmp_path / "good.kvm").write_text(GOOD)
    assert main(["check", "--param", "budget=32", str(tmp_path / "good.kvm")]) == 0
    assert main(["check", "--param", "budget=-1", str(tmp_path / "good.kvm")]) == 1
    assert "negative" in capsys.readouterr().err


def test_fmt_rewrites_and_check_mode(tmp_path: Path, capsys) -> None:
    path = tmp_path / "good.kvm"
    path.write_text(GOOD.replace("keep last budget", "keep   last budget"))
    assert main(["fmt", "--check", str(tmp_path)]) == 1
    assert path.read_text() != GOOD
    assert main(["fmt", str(path)]) == 0
    assert path.read_text() == GOOD
    assert main(["fmt", "--check", str(path)]) == 0
    capsys.readouterr()


def test_fmt_refuses_broken_files(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.kvm"
    path.write_text("method bad : eviction\non step_end:\n  keep (\n")
    assert main(["fmt", str(path)]) == 1
    assert path.read_text() == "method bad : eviction\non step_end:\n  keep (\n"
    assert "'(' is never closed" in capsys.readouterr().err
