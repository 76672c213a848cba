"""`kvc compile [FILES|--all] [--check]`: run the compiler over methods, with a progress bar.

Pipeline position: the command-line front of `kvc.compiler.codegen`. Without `--check` it writes
`kernels_generated/<method>/` (replacing the folder's generated files); with `--check` it writes
nothing and exits 1 listing every stale, missing or extra file. Compile errors are the DSL's
diagnostics (`file:line:col: message` + caret), and the command exits 1 after all files.

Compiling every shipped method (`--all`, or no FILES) also renders the engine's attention variants
the manifests name into `kernels_generated/_attention/<variant>.py` (one module per variant, shared
by its methods; `compiler/attention.py`), and `--check` checks them too. Compiling a few FILES
leaves that folder alone (its headers list every method naming a variant).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from kvc.compiler import attention
from kvc.dsl import METHODS_DIR, KvmError

OUTPUT_DIR = METHODS_DIR.parent / "kernels_generated"
log = logging.getLogger("kvc.compiler")


def _targets(files: list[str], everything: bool) -> list[Path]:
    paths = [Path(f) for f in files]
    if everything or not paths:
        paths += sorted(METHODS_DIR.glob("*.kvm"))
    return sorted(set(paths), key=lambda p: p.as_posix())


def stale_files(generated: dict[str, str], folder: Path, sub: str | None = None) -> list[str]:
    """Files of `folder` (or of its subfolder `sub`, whose files `generated` names as `sub/name`)
    that differ from `generated` (missing, changed, or not generated any more)."""
    out = []
    for name, text in sorted(generated.items()):
        path = folder / name
        if not path.is_file():
            out.append(f"{path}: missing")
        elif path.read_bytes() != text.encode():
            out.append(f"{path}: stale")
    listed = folder / sub if sub else folder
    if listed.is_dir():
        for path in sorted(listed.iterdir()):
            if path.is_file() and path.relative_to(folder).as_posix() not in generated:
                out.append(f"{path}: not generated any more")
    return out


def write(generated: dict[str, str], folder: Path, strip: str = "") -> None:
    """`folder` holds exactly `generated` (names relative to it after removing `strip`)."""
    generated = {name.removeprefix(strip): text for name, text in generated.items()}
    folder.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.is_file() and path.name not in generated:
            path.unlink()
    for name, text in generated.items():
        target = folder / name
        if not target.is_file() or target.read_bytes() != text.encode():
            target.write_bytes(text.encode())


def compile_command(files: list[str], everything: bool = False, check: bool = False,
                    output: Path = OUTPUT_DIR, quiet: bool = False) -> int:
    from rich.progress import Progress

    from kvc.compiler.codegen import generate

    errors, stale, skipped = [], [], []
    targets = _targets(files, everything)
    users: dict[str, list[str]] = {}  # attention variant -> the .kvm paths whose manifests name it
    with Progress(transient=True, disable=quiet or not sys.stderr.isatty()) as progress:
        task = progress.add_task("compiling methods", total=len(targets))
        for path in targets:
            progress.update(task, description=f"compiling {path.name}")
            try:
                generated = generate(path)
            except KvmError as e:
                errors.append(str(e))
                progress.advance(task)
                continue
            manifest = json.loads(generated["manifest.json"])
            if not manifest["lowered"]:
                skipped.append(path.stem)
            if "attention" in manifest:
                users.setdefault(manifest["attention"]["variant"], []).append(manifest["source"])
            folder = output / path.stem
            if check:
                stale += stale_files(generated, folder)
            else:
                write(generated, folder)
            progress.advance(task)
    if everything or not files:
        variants = attention.render_all(users)
        if check:
            stale += stale_files(variants, output, attention.FOLDER)
        else:
            write(variants, output / attention.FOLDER, strip=attention.FOLDER + "/")
    for message in errors:
        print(message, file=sys.stderr)
    if check and stale:
        print("kernels_generated/ is stale; run `kvc compile --all`:", file=sys.stderr)
        for line in stale:
            print(f"  {line}", file=sys.stderr)
    if not quiet and not check:
        print(f"compiled {len(targets) - len(errors)} method(s) into {output}"
              + (f"; not lowered yet (manifest only): {', '.join(skipped)}" if skipped else ""))
    return 1 if errors or stale else 0


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register `kvc compile` on the top-level CLI's subparsers."""
    p = sub.add_parser("compile", help="compile .kvm methods into kernels_generated/")
    p.add_argument("files", nargs="*", help=".kvm files (default: every shipped method)")
    p.add_argument("--all", action="store_true", dest="everything", help="every method in methods/")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if kernels_generated/ is stale")
    p.set_defaults(func=lambda args: compile_command(args.files, args.everything, args.check))
