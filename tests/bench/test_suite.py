"""`kvc bench suite` (runtime/bench/suite.py) on the CPU: a small suite of every kind of run writes its
result folder (logs, the throughput table, suite.json, summary.md), skips what the folder records
as done, runs `--only` a part; a bad suite file is one line and exit code 2. Every shipped suite
(bench/suites/) parses, names files that exist and options its commands take, and every suite
command in docs/benchmarks.md names a suite and runs it has."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from kvc.runtime.bench.suite import load_suite, missing_files
from kvc.runtime.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
SUITES = sorted((ROOT / "bench" / "suites").glob("*.toml"))

THROUGHPUT = """
[[run]]
name = "tp"
timeout = 300
[run.throughput]
model = "random:tiny"
methods = "full"
inputs = [40]
output = 8
kv-memory = "200000"
steps = 2
warmup = 1
device = "cpu"
sources = 1
no-progress = true
"""


def write_suite(tmp_path: Path) -> Path:
    script = tmp_path / "hello.py"
    script.write_text("import sys\nopen(sys.argv[2], 'w').write('hello')\nprint('wrote', sys.argv[2])\n")
    quick = tmp_path / "test_quick.py"
    quick.write_text("def test_quick():\n    assert 1 + 1 == 2\n")
    suite = tmp_path / "small.toml"
    suite.write_text(f'''title = "A small suite"
description = "Every kind of run."
{THROUGHPUT}
[[run]]
name = "script"
script = "{script}"
args = ["--out", "{{out}}/hello.txt"]

[[run]]
name = "fail"
command = ["python", "-c", "import sys; print('boom'); sys.exit(3)"]

[[run]]
name = "tests"
timeout = 120
pytest = ["{quick}"]

[[run]]
name = "slow"
timeout = 1
command = ["python", "-c", "import time; time.sleep(60)"]
''')
    return suite


def test_a_suite_writes_its_folder_skips_what_is_done_and_runs_only_a_part(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    suite, out = write_suite(tmp_path), tmp_path / "out"
    assert main(["bench", "suite", str(suite), "--out", str(out)]) == 1  # `fail` and `slow` failed
    printed = capsys.readouterr()
    summary = (out / "summary.md").read_text()
    assert printed.out.strip() == summary.strip()
    assert {"tp.json", "tp.md", "tp.log", "script.log", "hello.txt", "fail.log", "tests.log", "slow.log",
            "suite.json", "summary.md"} <= {p.name for p in out.iterdir()}
    assert (out / "hello.txt").read_text() == "hello"

    data = json.loads((out / "suite.json").read_text())
    assert data["title"] == "A small suite" and data["file"] == suite.read_text()
    assert data["device"] and {"torch", "triton", "transformers", "kvc_commit"} <= set(data["versions"])
    runs = {r["name"]: r for r in data["runs"]}
    assert [r["name"] for r in data["runs"]] == ["tp", "script", "fail", "tests", "slow"]
    assert {n: r["rc"] for n, r in runs.items()} == {"tp": 0, "script": 0, "fail": 3, "tests": 0, "slow": 124}
    assert runs["slow"]["timed_out"] and not runs["tp"]["timed_out"]
    assert runs["tp"]["argv"][1:5] == ["-m", "kvc.runtime.cli", "bench", "throughput"]
    assert runs["tp"]["argv"][-2:] == ["--out", str(out.resolve() / "tp.json")]
    assert "--no-progress" in runs["tp"]["argv"] and runs["tp"]["argv"][0] == sys.executable
    assert runs["script"]["argv"][-1] == str(out.resolve() / "hello.txt")  # {out} replaced
    assert runs["script"]["files"] == ["hello.txt", "script.log"] and runs["tp"]["files"] == ["tp.json", "tp.log",
                                                                                              "tp.md"]
    assert all(r["seconds"] >= 0 for r in runs.values())
    result = json.loads((out / "tp.json").read_text())
    assert [r["mode"] for r in result["rows"]] == ["decode_window"]

    assert summary.startswith("# A small suite\n") and "Every kind of run." in summary
    assert "## tp: rc=0" in summary and "| full | 40 | decode_window |" in summary
    assert "## fail: rc=3" in summary and "boom" in summary
    assert "## tests: rc=0" in summary and "1 passed" in summary
    assert "## slow: rc=124 (timed out)" in summary and "stopped after the run's timeout of 1 s" in summary

    # again: every run is recorded, so nothing runs; the exit code still reports the failed ones
    stamp = (out / "tp.json").stat().st_mtime_ns
    assert main(["bench", "suite", str(suite), "--out", str(out)]) == 1
    assert capsys.readouterr().err.count("skipped, done before") == 5
    assert (out / "tp.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "suite.json").read_text())["runs"] == data["runs"]

    # --only with --force runs that run again, and only it
    (out / "hello.txt").unlink()
    assert main(["bench", "suite", str(suite), "--out", str(out), "--only", "script", "--force"]) == 0
    assert "script: running" in capsys.readouterr().err
    again = {r["name"]: r for r in json.loads((out / "suite.json").read_text())["runs"]}
    assert (out / "hello.txt").exists() and again["script"]["started"] >= runs["script"]["started"]
    assert {n: again[n] for n in again if n != "script"} == {n: runs[n] for n in runs if n != "script"}
    assert (out / "tp.json").stat().st_mtime_ns == stamp


def test_list_prints_the_commands_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    suite, out = write_suite(tmp_path), tmp_path / "out"
    assert main(["bench", "suite", str(suite), "--out", str(out), "--list", "--only", "tp,fail"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"A small suite ({suite}): 5 runs; results in {out}")
    assert "  tp (throughput, timeout 300 s)" in text and "  fail (command, no timeout)" in text
    assert f"--out {out.resolve() / 'tp.json'}" in text and "script" not in text.split("\n", 1)[1]
    assert not out.exists()


def bad_suite(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


TITLE = 'title = "t"\n'
BAD = {
    "bad TOML": (TITLE + "[[run]\nname = 1\n", "not valid TOML"),
    "unknown key": (TITLE + "colour = 1\n[[run]]\nname = 'a'\ncommand = ['true']\n", "unknown key 'colour'"),
    "unknown run key": (TITLE + "[[run]]\nname = 'a'\ncommand = ['true']\nretries = 2\n", "unknown key 'retries'"),
    "two kinds": (TITLE + "[[run]]\nname = 'a'\ncommand = ['true']\npytest = ['tests/bench']\n",
                  "needs exactly one of throughput, script, pytest, command, got pytest and command"),
    "no kind": (TITLE + "[[run]]\nname = 'a'\n", "got none"),
    "no title": ("[[run]]\nname = 'a'\ncommand = ['true']\n", "needs a `title`"),
    "no runs": (TITLE, "needs one or more [[run]] tables"),
    "same name": (TITLE + "[[run]]\nname = 'a'\ncommand = ['true']\n[[run]]\nname = 'a'\ncommand = ['true']\n",
                  "two runs named 'a'"),
    "bad name": (TITLE + "[[run]]\nname = 'a b'\ncommand = ['true']\n", "needs a `name`"),
    "bad timeout": (TITLE + "[[run]]\nname = 'a'\ntimeout = -1\ncommand = ['true']\n", "positive number"),
    "unknown option": (TITLE + "[[run]]\nname = 'a'\nthroughput = { kv-memory = '1GiB', colour = 'red' }\n",
                       "`kvc bench throughput` has no option --colour"),
    "required option": (TITLE + "[[run]]\nname = 'a'\nthroughput = { methods = 'full' }\n", "needs `kv-memory`"),
    "flag value": (TITLE + "[[run]]\nname = 'a'\nthroughput = { kv-memory = '1GiB', busy = 'yes' }\n",
                   "write `busy = true`"),
    "missing script": (TITLE + "[[run]]\nname = 'a'\nscript = 'bench/no_such_bench.py'\n",
                       "missing files (a: bench/no_such_bench.py)"),
    "missing test": (TITLE + "[[run]]\nname = 'a'\npytest = ['tests/no_such_test.py::test_x', '-k', 'a or b']\n",
                     "missing files (a: tests/no_such_test.py)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_suite_is_one_line_and_exit_code_2(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    text, message = BAD[case]
    path = bad_suite(tmp_path, text)
    assert main(["bench", "suite", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvc: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_a_missing_suite_file_or_run_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["bench", "suite", str(tmp_path / "none.toml")]) == 2
    assert capsys.readouterr().err == f"kvc: error: no suite file {tmp_path / 'none.toml'}\n"
    path = bad_suite(tmp_path, TITLE + "[[run]]\nname = 'a'\ncommand = ['true']\n")
    assert main(["bench", "suite", str(path), "--only", "a,b", "--list"]) == 2
    assert capsys.readouterr().err == f"kvc: error: {path}: no run named 'b'; its runs: a\n"


@pytest.mark.parametrize("path", SUITES, ids=[p.stem for p in SUITES])
def test_every_shipped_suite_parses_and_names_what_exists(path):
    suite = load_suite(path)
    assert suite.title and suite.description and suite.runs
    assert missing_files(suite.runs, ROOT) == []
    parser = build_parser()
    out = Path("/results")
    for run in suite.runs:
        argv = run.argv(out)
        if argv[1:3] == ["-m", "kvc.runtime.cli"]:  # `kvc bench throughput`, `kvc tune`, `kvc calibrate`
            parser.parse_args(argv[3:])
        if run.kind == "throughput":
            assert argv[-2:] == ["--out", f"/results/{run.name}.json"]
        assert not any("{out}" in arg for arg in argv), run.name


def test_the_docs_name_suites_and_runs_that_exist():
    cited = 0
    for doc in (ROOT / "docs" / "benchmarks.md", ROOT / "README.md"):
        text = doc.read_text()
        assert not re.search(r"gpu_(issue\w*|palu|kernels|throughput|tune|kernel_profile|agent)\.sh", text), doc
        for file, only in re.findall(r"kvc bench suite (bench/suites/[\w.-]+\.toml)(?: --only ([\w.,-]+))?", text):
            suite = load_suite(ROOT / file)
            names = {r.name for r in suite.runs}
            assert set(filter(None, only.split(","))) <= names, (file, only)
            cited += 1
    assert cited >= 20


def test_the_commit_says_when_the_tree_differs_from_it(tmp_path):
    """Result provenance (`kvc_commit`): the short commit of a clean checkout; `+modified` when a tracked file
    differs from it (a device gets the working tree over older git metadata); None outside git."""
    import subprocess

    from kvc.runtime.bench.result import commit

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert commit(tmp_path) is None
    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("commit", "-qm", "one")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                         text=True).stdout.strip()
    assert commit(tmp_path) == sha
    (tmp_path / "a.txt").write_text("two")
    assert commit(tmp_path) == sha + "+modified"
