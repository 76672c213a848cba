"""`kvc compile [FILES|--all] [--check] [--out DIR]`: run the compiler over methods, with a progress bar.

Pipeline position: the command-line front of `kvc.compiler.codegen`. A shipped method
(methods/<name>.kvm) is written into `kernels_generated/<name>/` (replacing the folder's generated
files); any other .kvm into the compile cache (`compiler/cache.py`, the command prints where), or
into DIR with `--out DIR` (one file; the engine serves it with `--method DIR`). Nothing but a
shipped method is ever written into the package. With `--check` it writes nothing and exits 1
listing every stale, missing or extra file. Compile errors are the DSL's diagnostics
(`file:line:col: message` + caret), and the command exits 1 after all files.

Compiling every shipped method (`--all`, or no FILES) also renders the engine's attention variants
the manifests name into `kernels_generated/_attention/<variant>.py` (one module per variant, shared
by its methods; `compiler/attention.py`), and `--check` checks them too. Compiling a few FILES
leaves that folder alone (its headers list every method naming a variant).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from kvc.compiler import attention, cache
from kvc.dsl import METHODS_DIR, KvmError
from kvc.errors import KvcError

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


def shipped(path: Path) -> bool:
    """Whether `path` is a shipped method (methods/<name>.kvm), the only kind written into the package."""
    return path.resolve().parent == METHODS_DIR.resolve()


def check_out_folder(folder: Path) -> None:
    """Refuse an `--out` folder `kvc compile` would clobber: a file, or a folder with other contents."""
    if folder.exists() and not folder.is_dir():
        raise KvcError(f"--out {folder}: not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / "manifest.json").is_file():
        raise KvcError(f"--out {folder}: the folder is not empty and holds no manifest.json (not a compiled "
                       "method); give a new or empty folder")


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


def _check_arguments(files: list[str], targets: list[Path], everything: bool, check: bool, out: Path | None) -> None:
    if out is not None:
        if everything or len(files) != 1:
            raise KvcError("--out DIR takes exactly one .kvm file (DIR holds one compiled method)")
        if not check:
            check_out_folder(out)
    elif check and any(not shipped(path) for path in targets):
        outside = ", ".join(str(path) for path in targets if not shipped(path))
        raise KvcError(f"--check compares a method with its compiled folder, and {outside} is not under "
                       f"{METHODS_DIR}: give the folder with --out DIR")


def _into_cache(path: Path) -> Path:
    try:
        return cache.compile_file(path).folder
    except OSError as e:
        raise KvcError(f"cannot compile {path} into the compile cache {cache.cache_dir()}: {e.strerror or e}; set "
                       f"{cache.CACHE_ENV} to a writable folder, or give --out DIR") from None


def compile_command(files: list[str], everything: bool = False, check: bool = False,
                    output: Path = OUTPUT_DIR, quiet: bool = False, out: Path | None = None) -> int:
    """Compile `files` (or every shipped method); `output` is the kernels_generated/ folder the shipped
    methods go to, `out` the folder of the one user method given. Raises `KvcError` for bad arguments."""
    from rich.progress import Progress

    from kvc.compiler.codegen import generate

    errors, stale, skipped, cached = [], [], [], []
    targets = _targets(files, everything)
    _check_arguments(files, targets, everything, check, out)
    users: dict[str, list[str]] = {}  # attention variant -> the .kvm paths whose manifests name it
    with Progress(transient=True, disable=quiet or not sys.stderr.isatty()) as progress:
        task = progress.add_task("compiling methods", total=len(targets))
        for path in targets:
            progress.update(task, description=f"compiling {path.name}")
            try:
                if out is None and not shipped(path) and path.is_file():  # a user's method: into the cache
                    cached.append(f"compiled {path} into {_into_cache(path)} (serve it with --method {path}, "
                                  "or compile it into a folder of your choice with --out DIR)")
                    progress.advance(task)
                    continue
                # a user's .kvm is recorded by its absolute path, so `--method DIR` finds it to check
                generated = generate(path.resolve() if out is not None else path)
            except KvmError as e:
                errors.append(str(e))
                progress.advance(task)
                continue
            manifest = json.loads(generated["manifest.json"])
            if not manifest["lowered"]:
                skipped.append(path.stem)
            if "attention" in manifest:
                users.setdefault(manifest["attention"]["variant"], []).append(manifest["source"])
            folder = out if out is not None else output / path.stem
            if check:
                stale += stale_files(generated, folder)
            else:
                try:
                    write(generated, folder)
                except OSError as e:
                    raise KvcError(f"cannot write {folder}: {e.strerror or e}") from None
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
        fix = f"kvc compile {shlex.quote(files[0])} --out {shlex.quote(str(out))}" if out else "kvc compile --all"
        print(f"{out or 'kernels_generated/'} is stale; run `{fix}`:", file=sys.stderr)
        for line in stale:
            print(f"  {line}", file=sys.stderr)
    if not quiet and not check:
        for line in cached:
            print(line)
        compiled = len(targets) - len(errors) - len(cached)
        if out is not None and compiled:
            print(f"compiled {targets[0]} into {out} (serve it with --method {out})")
        elif compiled:
            print(f"compiled {compiled} method(s) into {output}")
        if skipped:
            print(f"not lowered yet (manifest only): {', '.join(skipped)}")
    return 1 if errors or stale else 0


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register `kvc compile` on the top-level CLI's subparsers."""
    p = sub.add_parser("compile", help="compile .kvm methods (shipped ones into kernels_generated/)")
    p.add_argument("files", nargs="*", help=".kvm files (default: every shipped method); a file outside methods/ "
                   "is compiled into the compile cache unless --out is given")
    p.add_argument("--all", action="store_true", dest="everything", help="every method in methods/")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if kernels_generated/ (or the --out folder) is stale")
    p.add_argument("--out", type=Path, metavar="DIR", help="compile the one FILE into DIR (new, empty or compiled "
                   "before), which `--method DIR` serves")
    p.set_defaults(func=lambda args: compile_command(args.files, args.everything, args.check, out=args.out))
