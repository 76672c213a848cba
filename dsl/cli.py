"""`kvc check` and `kvc fmt`: the command-line face of the method language.

Pipeline position: `kvc.runtime.cli` registers these subcommands through `add_commands`; they call
`kvc.dsl.check_file` and `kvc.dsl.format_source`. Both take files or directories (searched for
*.kvm), print every diagnostic of every file to stderr, and exit 1 if there was any error (or, for
`fmt --check`, any file that is not in canonical form). They never print a Python traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvc.dsl.errors import Diagnostic, KvmError, Pos


def add_commands(sub) -> None:
    """Register `check` and `fmt` on the `kvc` argument parser's subcommands."""
    check = sub.add_parser("check", help="check .kvm method files (exit 1 on errors)",
                           description="Parse and check method files; print every error of every file.")
    check.add_argument("files", nargs="+", metavar="FILE", help="a .kvm file or a directory of them")
    check.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                       help="check with a parameter override, e.g. --param budget=512 (repeatable)")
    check.set_defaults(func=run_check)
    fmt = sub.add_parser("fmt", help="format .kvm method files canonically",
                         description="Rewrite method files in canonical form (idempotent).")
    fmt.add_argument("files", nargs="+", metavar="FILE", help="a .kvm file or a directory of them")
    fmt.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would be reformatted")
    fmt.set_defaults(func=run_fmt)


def expand(paths: list[str]) -> tuple[list[Path], list[Diagnostic]]:
    files: list[Path] = []
    problems: list[Diagnostic] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(p.rglob("*.kvm"))
            if not found:
                problems.append(Diagnostic(raw, Pos(1, 1), "no .kvm files in this directory"))
            files += found
        elif p.exists():
            files.append(p)
        else:
            problems.append(Diagnostic(raw, Pos(1, 1), "no such file or directory"))
    return files, problems


def parse_overrides(items: list[str]) -> tuple[dict[str, object], list[Diagnostic]]:
    out: dict[str, object] = {}
    problems = []
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            problems.append(Diagnostic("--param", Pos(1, 1), f"expected NAME=VALUE, got {item!r}"))
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = text  # an enum member such as `max`
        out[name.strip()] = value
    return out, problems


def _report(diagnostics: list[Diagnostic]) -> None:
    for d in diagnostics:
        print(d.render(), file=sys.stderr)


def _internal(path: Path, e: Exception) -> Diagnostic:
    return Diagnostic(str(path), Pos(1, 1), f"internal error while processing this file ({type(e).__name__}: {e}); "
                                            "please report it")


def run_check(args: argparse.Namespace) -> int:
    from kvc.dsl import check_file

    files, problems = expand(args.files)
    overrides, bad = parse_overrides(args.param)
    problems += bad
    _report(problems)
    errors, failed = len(problems), 0
    for path in files:
        try:
            check_file(path, overrides or None)
        except KvmError as e:
            _report(e.diagnostics)
            errors += len(e.diagnostics)
            failed += 1
        except Exception as e:  # a bug in kvc, not in the file: still no traceback
            _report([_internal(path, e)])
            errors += 1
            failed += 1
    if errors:
        print(f"{errors} error{'s' if errors != 1 else ''} in {failed or len(problems)} "
              f"file{'s' if (failed or len(problems)) != 1 else ''}", file=sys.stderr)
        return 1
    print(f"checked {len(files)} method file{'s' if len(files) != 1 else ''}: no errors")
    return 0


def run_fmt(args: argparse.Namespace) -> int:
    from kvc.dsl import format_source

    files, problems = expand(args.files)
    _report(problems)
    status = 1 if problems else 0
    changed = 0
    for path in files:
        try:
            source = path.read_bytes()
            formatted = format_source(source, str(path))
        except KvmError as e:
            _report(e.diagnostics)
            status = 1
            continue
        except OSError as e:
            _report([Diagnostic(str(path), Pos(1, 1), f"cannot read the file: {e.strerror or e}")])
            status = 1
            continue
        except Exception as e:
            _report([_internal(path, e)])
            status = 1
            continue
        if formatted.encode("utf-8") == source:
            continue
        changed += 1
        if args.check:
            print(f"{path}: not formatted (run `kvc fmt {path}`)", file=sys.stderr)
            status = 1
        else:
            path.write_text(formatted, encoding="utf-8")
            print(f"reformatted {path}")
    if args.check and not changed and not status:
        print(f"{len(files)} method file{'s' if len(files) != 1 else ''} already formatted")
    return status
