"""Imports follow the pipeline: `dsl` <- `compiler` <- `runtime`, and generated code
(`kernels_generated/`) calls run-time helpers in `runtime/`; `kvc.errors` is a leaf every stage may use.

Every module of dsl/, compiler/, runtime/ (runtime/_top/ is the `kvc` package itself) and
kernels_generated/ is parsed with `ast`, never imported, and the import lines of
compiler/templates/*.jinja count as kernels_generated's (they are what it will hold); the top
package `kvc` (runtime/_top/__init__.py, the public API over the engine) counts as runtime. Imports inside
functions and under `if TYPE_CHECKING:` count too: a lazy import is still a dependency. The test
fails on a cycle between packages, on `dsl` importing anything of kvc but `kvc.errors`, on
`compiler` importing `runtime`, on `kvc.errors` importing kvc, and on a cycle of module-level
imports inside one package; each failure names the module, file and line.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"dsl": "kvc.dsl", "compiler": "kvc.compiler", "kernels_generated": "kvc.kernels_generated",
           "runtime/_top": "kvc", "runtime": "kvc.runtime"}  # runtime/_top before runtime: it is the `kvc` package
SUBPACKAGES = ("dsl", "compiler", "kernels_generated", "runtime", "errors")
TEMPLATE_IMPORT = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+import\s+\(?([\w, ]*)|import\s+([\w.]+))")
# A package may not import these (besides the cycle check, which covers everything else).
FORBIDDEN = {
    "errors": {"dsl", "compiler", "kernels_generated", "runtime"},
    "dsl": {"compiler", "kernels_generated", "runtime"},
    "compiler": {"runtime", "kernels_generated"},
}


@dataclass(frozen=True)
class Import:
    """One import statement's dependency: `module` (in file `path`, at `line`) needs `target`."""

    module: str
    path: str
    line: int
    target: str
    lazy: bool = False  # inside a function or under `if TYPE_CHECKING:`: not run at import time

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.target}"


def package_of(module: str) -> str | None:
    """The node of the package graph a kvc module belongs to: its subpackage's name; None outside
    kvc. The top package `kvc` itself (runtime/_top/__init__.py: `LLM`, `SamplingParams`, ...) is the
    runtime's public face and counts as `runtime`: `from kvc import LLM` loads the engine."""
    parts = module.split(".")
    if parts[0] != "kvc":
        return None
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    return "runtime"


def module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of a source file of the repository, and whether it is a package's __init__."""
    rel = path.relative_to(ROOT)
    for folder, package in FOLDERS.items():
        if rel.as_posix().startswith(folder + "/"):
            parts = [*package.split("."), *rel.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                return ".".join(parts[:-1]), True
            return ".".join(parts), False
    raise ValueError(f"{rel} is in none of {sorted(FOLDERS)}")


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str, path: str, is_package: bool = False,
               known: frozenset[str] = frozenset()) -> list[Import]:
    """Every kvc import in `source`; `from pkg import name` depends on `pkg.name` when that is a
    module in `known` (or one of kvc's subpackages), else on `pkg`."""
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if package_of(alias.name):
                    found.append(Import(module, path, node.lineno, alias.name, lazy))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            if package_of(base):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    child = sub in known or (base == "kvc" and alias.name in SUBPACKAGES)
                    found.append(Import(module, path, node.lineno, sub if child else base, lazy))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and package_of(node.args[0].value)):  # importlib.import_module("kvc.x"): an import too
            found.append(Import(module, path, node.lineno, node.args[0].value, lazy))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy = True
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, lazy)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, lazy)

    visit(ast.parse(source, path), False)
    return found


def template_imports(text: str, path: str) -> list[Import]:
    """The kvc imports a template writes into generated code (module: the template's output)."""
    module = "kvc.kernels_generated." + Path(path).name.split(".")[0]
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        match = TEMPLATE_IMPORT.match(line)
        if not match:
            continue
        base, names, plain = match.groups()
        if plain and package_of(plain):
            found.append(Import(module, path, number, plain))
        elif base and package_of(base):
            for name in [n.strip() for n in names.split(",") if n.strip()] or [""]:
                child = base == "kvc" and name in SUBPACKAGES  # `from x import (` names its names below
                found.append(Import(module, path, number, f"{base}.{name}" if child else base))
    return found


def repository_imports() -> list[Import]:
    files = sorted(p for folder in ("dsl", "compiler", "runtime", "kernels_generated")
                   for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    names = {path: module_name(path) for path in files}
    known = frozenset(name for name, _ in names.values())
    found = []
    for path, (name, is_package) in names.items():
        found += imports_of(path.read_text(), name, path.relative_to(ROOT).as_posix(), is_package, known)
    for path in sorted((ROOT / "compiler" / "templates").glob("*.jinja")):
        found += template_imports(path.read_text(), path.relative_to(ROOT).as_posix())
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return sorted(out)


def _cycle_report(kind: str, imports: dict[tuple[str, str], list[Import]]) -> list[str]:
    edges: dict[str, set[str]] = defaultdict(set)
    for a, b in imports:
        edges[a].add(b)
    problems = []
    for component in _cycles(edges):
        inside = [imports[a, b][0].where() + (f" (and {len(imports[a, b]) - 1} more)" if len(imports[a, b]) > 1 else "")
                  for a, b in sorted(imports) if a in component and b in component]
        problems.append(f"import cycle between {kind} {', '.join(component)}:\n    " + "\n    ".join(inside))
    return problems


def violations(imports: list[Import]) -> list[str]:
    """What breaks the pipeline's import rules, one message per problem (empty: none)."""
    problems = []
    between: dict[tuple[str, str], list[Import]] = defaultdict(list)
    within: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in imports:
        src, dst = package_of(imp.module), package_of(imp.target)
        if src != dst:
            between[src, dst].append(imp)
            if dst in FORBIDDEN.get(src, ()):
                problems.append(f"{imp.where()}: {src} may not import {dst}")
        elif not imp.lazy and imp.target != imp.module:
            within[imp.module, imp.target].append(imp)
    problems += _cycle_report("packages", between)
    problems += _cycle_report("modules (module-level imports)", within)
    return problems


def test_imports_follow_the_pipeline():
    imports = repository_imports()
    assert {package_of(i.module) for i in imports} >= {"dsl", "compiler", "kernels_generated", "runtime"}
    problems = violations(imports)
    assert not problems, "\n".join(problems)


def test_a_module_in_every_package_is_found():
    assert module_name(ROOT / "runtime/_top/errors.py") == ("kvc.errors", False)
    assert module_name(ROOT / "runtime/_top/__init__.py") == ("kvc", True)
    assert module_name(ROOT / "runtime/kv/__init__.py") == ("kvc.runtime.kv", True)
    assert module_name(ROOT / "kernels_generated/snapkv/hooks.py") == ("kvc.kernels_generated.snapkv.hooks", False)
    imports = repository_imports()
    assert any(i.path.endswith(".jinja") and package_of(i.target) == "runtime" for i in imports)
    assert any(i.lazy for i in imports)  # function-level imports are seen


SOURCE = '''
from __future__ import annotations
import os
from typing import TYPE_CHECKING
from kvc.errors import KvcError
from . import sibling
from .. import runtime

if TYPE_CHECKING:
    from kvc.runtime.llm import LLM


def later():
    import kvc.compiler.cache
    from kvc import dsl, LLM
    return importlib.import_module("kvc.kernels_generated.snapkv.hooks")
'''


def test_imports_of_sees_relative_lazy_and_type_checking_imports():
    found = imports_of(SOURCE, "kvc.dsl.fake", "dsl/fake.py", known=frozenset({"kvc.dsl.sibling"}))
    assert [(i.line, i.target, i.lazy) for i in found] == [
        (5, "kvc.errors", False), (6, "kvc.dsl.sibling", False), (7, "kvc.runtime", False),
        (10, "kvc.runtime.llm", True), (14, "kvc.compiler.cache", True), (15, "kvc.dsl", True), (15, "kvc", True),
        (16, "kvc.kernels_generated.snapkv.hooks", True)]
    problems = violations(found)
    assert "dsl/fake.py:7: kvc.dsl.fake imports kvc.runtime: dsl may not import runtime" in problems
    assert "dsl/fake.py:14: kvc.dsl.fake imports kvc.compiler.cache: dsl may not import compiler" in problems
    assert "dsl/fake.py:15: kvc.dsl.fake imports kvc: dsl may not import runtime" in problems
    assert not any("kvc.errors:" in p for p in problems)  # the leaf is allowed


def test_template_imports_count_as_generated_code():
    text = "{% if x %}\nfrom kvc.runtime.primitives.torch_primitives import (  # noqa\n{% endif %}\nimport torch\n"
    found = template_imports(text, "compiler/templates/torch_lowering.py.jinja")
    assert found == [Import("kvc.kernels_generated.torch_lowering", "compiler/templates/torch_lowering.py.jinja", 2,
                            "kvc.runtime.primitives.torch_primitives")]


def test_a_fake_violation_fails():
    real = repository_imports()
    backwards = Import("kvc.compiler.fake", "compiler/fake.py", 3, "kvc.runtime.errors", lazy=True)
    problems = violations([*real, backwards])
    assert "compiler/fake.py:3: kvc.compiler.fake imports kvc.runtime.errors: compiler may not import runtime" \
        in problems
    cycle = [p for p in problems if p.startswith("import cycle between packages compiler, runtime")]
    assert len(cycle) == 1 and "compiler/fake.py:3" in cycle[0] and "runtime/" in cycle[0]


def test_a_cycle_without_a_forbidden_edge_fails():
    generated_to_runtime = Import("kvc.kernels_generated.x", "kernels_generated/x.py", 1, "kvc.runtime.y")
    runtime_to_generated = Import("kvc.runtime.y", "runtime/y.py", 9, "kvc.kernels_generated.x", lazy=True)
    assert violations([generated_to_runtime]) == []
    assert violations([generated_to_runtime, runtime_to_generated]) == [
        "import cycle between packages kernels_generated, runtime:\n"
        "    kernels_generated/x.py:1: kvc.kernels_generated.x imports kvc.runtime.y\n"
        "    runtime/y.py:9: kvc.runtime.y imports kvc.kernels_generated.x"]


def test_a_module_cycle_inside_a_package_fails_unless_one_side_is_lazy():
    a = Import("kvc.runtime.a", "runtime/a.py", 2, "kvc.runtime.b")
    b = Import("kvc.runtime.b", "runtime/b.py", 4, "kvc.runtime.a")
    assert violations([a, b]) == [
        "import cycle between modules (module-level imports) kvc.runtime.a, kvc.runtime.b:\n"
        "    runtime/a.py:2: kvc.runtime.a imports kvc.runtime.b\n"
        "    runtime/b.py:4: kvc.runtime.b imports kvc.runtime.a"]
    assert violations([a, Import(b.module, b.path, b.line, b.target, lazy=True)]) == []
