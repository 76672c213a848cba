"""Benchmark suites: one TOML file (bench/suites/*.toml) holds the runs behind published tables of
docs/benchmarks.md, and `kvc bench suite FILE` reproduces them into one dated result folder.

A suite file has a `title`, an optional `description` and `[[run]]` entries, each with a `name`, an
optional `timeout` (seconds) and exactly one of:
- `throughput = { ... }`: options of `kvc bench throughput` (`kv-memory = "60GiB"`, `methods = "full,snapkv"`,
  `method-params = ["snapkv:every=16"]`, flags as `true`), run with `--out RUN.json`; its table is RUN.md;
- `script = "bench/x.py"` with `args = [...]`: a Python script, run by this interpreter;
- `pytest = [...]`: test paths and pytest options;
- `command = [...]`: any other argv (`kvc ...` runs this kvc, `python ...` this interpreter).
`{out}` in a value is the result folder; paths are relative to the current directory (the repository root).
Values are plain (no environment variables): a variant is another run or another suite.

Each run is a subprocess with its own timeout, its output in RUN.log; a failing run does not stop the
others. The folder gets suite.json (the suite file, date, commit, device, versions, and each run's argv,
exit code, seconds and files) and summary.md. A run that suite.json records as ended (whatever its exit
code) is skipped unless `--force`, so a suite longer than one call resumes where the last call stopped.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kvc.runtime.errors import ConfigError, KvcError

KINDS = ("throughput", "script", "pytest", "command")
RUN_KEYS = {"name", "timeout", "args", *KINDS}
SUITE_KEYS = {"title", "description", "run"}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
REPO_PATH = re.compile(r"(bench|tests|methods)/[^{}]*\Z")  # an argument that names a file of the repository
TIMED_OUT = 124  # the exit code `timeout` gives what it stops
NOT_FOUND = 127  # the shell's, for a program that is not there
LOG_TAIL = 30  # log lines a summary shows for a run without a table
RECORDS = "suite.json"
SUMMARY = "summary.md"


@dataclass(frozen=True)
class Run:
    name: str
    kind: str  # one of KINDS
    value: object  # the throughput options (dict), the script path, or the pytest / command list
    args: tuple[str, ...] = ()  # a script's arguments
    timeout: float | None = None

    def argv(self, out: Path) -> list[str]:
        """The subprocess's argv, `{out}` replaced by the result folder."""
        if self.kind == "throughput":
            argv = [sys.executable, "-m", "kvc.runtime.cli", "bench", "throughput", *_throughput_args(self.value),
                    "--out", str(out / f"{self.name}.json")]
        elif self.kind == "script":
            argv = [sys.executable, str(self.value), *self.args]
        elif self.kind == "pytest":
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *self.value]
        else:
            head, *rest = self.value
            program = {"kvc": [sys.executable, "-m", "kvc.runtime.cli"], "python": [sys.executable],
                       "python3": [sys.executable]}.get(head, [head])
            argv = [*program, *rest]
        return [arg.replace("{out}", str(out)) for arg in argv]

    def paths(self) -> list[str]:
        """The repository files the run names: its script, its test files, the .kvm files of its methods,
        and the arguments under bench/, tests/ or methods/."""
        if self.kind == "throughput":
            methods = self.value.get("methods", "")
            items = methods if isinstance(methods, list) else str(methods).split(",")
            return [m.strip() for m in map(str, items) if m.strip().endswith(".kvm")]
        if self.kind == "pytest":
            return [item.split("::")[0] for item in self.value
                    if not item.startswith("-") and ("/" in item or item.split("::")[0].endswith(".py"))]
        if self.kind == "script":
            return [str(self.value), *(a for a in self.args if REPO_PATH.match(a))]
        return [a for a in self.value if REPO_PATH.match(a)]


@dataclass(frozen=True)
class Suite:
    path: Path
    title: str
    description: str
    runs: tuple[Run, ...]
    text: str  # the file as written

    def run(self, name: str) -> Run:
        for run in self.runs:
            if run.name == name:
                return run
        raise ConfigError(f"{self.path}: no run named {name!r}; its runs: {', '.join(r.name for r in self.runs)}")


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite file; a ConfigError (one line) says what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"no suite file {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError("suite files need Python 3.11 (tomllib) or `pip install tomli`") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    _known_keys(data, SUITE_KEYS, f"{path}")
    title = data.get("title")
    if not isinstance(title, str) or not title.strip():
        raise ConfigError(f"{path}: needs a `title` (a string)")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{path}: `description` must be a string")
    entries = data.get("run")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{path}: needs one or more [[run]] tables")
    runs: list[Run] = []
    for i, entry in enumerate(entries, 1):
        run = _parse_run(entry, f"{path}: run {i}")
        if any(r.name == run.name for r in runs):
            raise ConfigError(f"{path}: two runs named {run.name!r}")
        runs.append(run)
    return Suite(path, title.strip(), description.strip(), tuple(runs), text)


def missing_files(runs: list[Run] | tuple[Run, ...], root: Path | None = None) -> list[str]:
    """The files the runs name that are not under `root` (default: the current directory)."""
    root = Path.cwd() if root is None else root
    return [f"{run.name}: {p}" for run in runs for p in run.paths() if not (root / p).exists()]


def check_files(suite: Suite, runs: list[Run]) -> None:
    """A ConfigError naming the files the runs need that are not here."""
    missing = missing_files(runs)
    if missing:
        raise ConfigError(f"{suite.path}: missing files ({'; '.join(missing)}); run from the repository root")


def default_out(suite: Suite) -> Path:
    """bench/results/<suite stem>/<YYYY-MM-DD>-<short commit> (UTC date)."""
    from kvc.runtime.bench.result import commit

    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return Path("bench") / "results" / suite.path.stem / f"{date}-{commit() or 'nocommit'}"


def select(suite: Suite, only: str | None) -> list[Run]:
    """The runs `--only a,b` names (in the suite's order), or every run."""
    if only is None:
        return list(suite.runs)
    names = [n.strip() for n in only.split(",") if n.strip()]
    if not names:
        raise ConfigError("--only names no run", param="only")
    wanted = {suite.run(n).name for n in names}
    return [r for r in suite.runs if r.name in wanted]


def describe(suite: Suite, out: Path, runs: list[Run]) -> str:
    """`--list`: each run's kind, timeout, whether the folder records it, and its command."""
    records = _records(out)
    lines = [f"{suite.title} ({suite.path}): {len(suite.runs)} runs; results in {out}"]
    for run in runs:
        notes = [run.kind, f"timeout {run.timeout:g} s" if run.timeout else "no timeout"]
        if run.name in records:
            notes.append(f"done: rc={records[run.name].get('rc')}")
        lines += [f"  {run.name} ({', '.join(notes)})", f"    {shlex.join(run.argv(out.resolve()))}"]
    return "\n".join(lines)


def run_suite(suite: Suite, out: Path, runs: list[Run], force: bool = False) -> int:
    """Run `runs` into `out` (skipping those the folder records unless `force`), write suite.json and
    summary.md after each, print the summary; 0 when every selected run exited 0."""
    check_files(suite, runs)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvcError(f"cannot create {out}: {e.strerror or e}") from None
    header: dict = {}  # this call's date, device and versions, found once a run is about to be recorded
    failed = False
    for run in runs:
        done = _records(out).get(run.name)
        if done is not None and not force:
            _note(f"{run.name}: skipped, done before (rc={done.get('rc')}; --force runs it again)")
            failed |= done.get("rc") != 0
            continue
        header = header or _header(suite, out)
        _note(f"{run.name}: running ({run.kind}{f', timeout {run.timeout:g} s' if run.timeout else ''})")
        record = _execute(run, out.resolve())
        _note(f"{run.name}: rc={record['rc']}{' (timed out)' if record['timed_out'] else ''} "
              f"in {record['seconds']:.1f} s")
        failed |= record["rc"] != 0
        _write_records(suite, out, header, record)
    summary = format_summary(suite, out)
    _write_text(out / SUMMARY, summary)
    print(summary)
    return 1 if failed else 0


def format_summary(suite: Suite, out: Path) -> str:
    """summary.md: the title, the machine, then each recorded run's table or the tail of its log."""
    data = _read_json(out / RECORDS) or {}
    records = {r["name"]: r for r in data.get("runs", [])}
    v = data.get("versions") or {}
    lines = [f"# {suite.title}", "",
             f"{data.get('date', '?')}, {data.get('device') or 'unknown device'}; torch {v.get('torch')}, "
             f"Triton {v.get('triton')}, transformers {v.get('transformers')}, Python {v.get('python')}; "
             f"kvc {v.get('kvc_commit')}; `kvc bench suite {suite.path}`", ""]
    if suite.description:
        lines += [suite.description, ""]
    for run in suite.runs:
        r = records.get(run.name)
        if r is None:
            continue
        status = f"rc={r['rc']}{' (timed out)' if r.get('timed_out') else ''}, {r['seconds']:.1f} s"
        lines += [f"## {run.name}: {status}", ""]
        table = _read_text(out / f"{run.name}.md").strip() if run.kind == "throughput" else ""
        if table:
            lines += [table, ""]
        if not table or r["rc"] != 0:
            tail = _read_text(out / f"{run.name}.log").rstrip().splitlines()[-LOG_TAIL:]
            lines += ["```", *tail, "```", ""]
    return "\n".join(lines)


def command(file: str, out: str | None, only: str | None, force: bool, list_only: bool) -> int:
    """`kvc bench suite`."""
    suite = load_suite(file)
    folder = Path(out) if out else default_out(suite)
    runs = select(suite, only)
    if list_only:
        check_files(suite, runs)
        print(describe(suite, folder, runs))
        return 0
    return run_suite(suite, folder, runs, force)


# ---- parsing ------------------------------------------------------------------------------------

def _known_keys(table: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _parse_run(entry: dict, where: str) -> Run:
    name = entry.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(f"{where}: needs a `name` of letters, digits, '_', '.' or '-' (it names the run's files)")
    where = f"{where} ({name})"
    _known_keys(entry, RUN_KEYS, where)
    kinds = [k for k in KINDS if k in entry]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: needs exactly one of {', '.join(KINDS)}, got "
                          f"{' and '.join(kinds) if kinds else 'none'}")
    kind = kinds[0]
    timeout = entry.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"{where}: `timeout` must be a positive number of seconds")
    if "args" in entry and kind != "script":
        raise ConfigError(f"{where}: `args` goes with `script` (a command's or pytest's arguments are its list)")
    value = entry[kind]
    args: tuple[str, ...] = ()
    if kind == "throughput":
        value = _check_throughput(value, where)
    elif kind == "script":
        if not isinstance(value, str) or not value.endswith(".py"):
            raise ConfigError(f"{where}: `script` must be the path of a Python file")
        args = tuple(_strings(entry.get("args", []), f"{where}: `args`"))
    else:
        value = _strings(value, f"{where}: `{kind}`")
        if not value:
            raise ConfigError(f"{where}: `{kind}` is empty")
    return Run(name, kind, value, args, float(timeout) if timeout is not None else None)


def _strings(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                              for v in value):
        raise ConfigError(f"{what} must be a list of strings or numbers")
    return [str(v) for v in value]


@functools.lru_cache(maxsize=1)
def _throughput_options() -> dict[str, argparse.Action]:
    """`kvc bench throughput`'s options by long name (without the dashes), from its own parser."""
    from kvc.runtime.bench.cli import add_commands

    sub = argparse.ArgumentParser().add_subparsers()
    add_commands(sub)
    parser = sub.choices["throughput"]
    return {s[2:]: a for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def _check_throughput(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: `throughput` must be a table of `kvc bench throughput` options")
    options = _throughput_options()
    table = {}
    for key, v in value.items():
        flag = key.replace("_", "-")
        if flag == "out":
            raise ConfigError(f"{where}: `out` is set by the suite (the run's RUN.json)")
        action = options.get(flag)
        if action is None:
            raise ConfigError(f"{where}: `kvc bench throughput` has no option --{flag}")
        if action.nargs == 0:  # a flag
            if not isinstance(v, bool):
                raise ConfigError(f"{where}: --{flag} is a flag: write `{key} = true`")
        elif isinstance(v, list):
            _strings(v, f"{where}: --{flag}")
        elif isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{where}: --{flag} takes a string, a number or a list")
        table[flag] = v
    for flag, action in options.items():
        if action.required and flag not in table:
            raise ConfigError(f"{where}: `throughput` needs `{flag}`")
    return table


def _throughput_args(table: dict) -> list[str]:
    """Options -> argv: flags when true, a repeatable option once per list item, other lists comma-joined."""
    options = _throughput_options()
    argv: list[str] = []
    for flag, v in table.items():
        action = options[flag]
        if action.nargs == 0:
            argv += [f"--{flag}"] if v else []
        elif isinstance(action, argparse._AppendAction):
            argv += [x for item in (v if isinstance(v, list) else [v]) for x in (f"--{flag}", str(item))]
        else:
            argv += [f"--{flag}", ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return argv


# ---- running ------------------------------------------------------------------------------------

def _note(text: str) -> None:
    print(f"kvc bench suite: {text}", file=sys.stderr, flush=True)


def _header(suite: Suite, out: Path) -> dict:
    return {"suite": str(suite.path), "title": suite.title, "description": suite.description, "file": suite.text,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "out": str(out), **_machine()}


def _machine() -> dict:
    """The device and versions, found in a child process (no CUDA context held by this one)."""
    code = ("import json; from kvc.runtime.bench.result import device_name, versions; "
            "print(json.dumps({'device': device_name('auto'), 'versions': versions()}))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        from kvc.runtime.bench.result import commit

        return {"device": None, "versions": {"kvc_commit": commit()}}


def _execute(run: Run, out: Path) -> dict:
    """Run one entry under its timeout; its record."""
    argv = run.argv(out)
    log, table = out / f"{run.name}.log", out / f"{run.name}.md"
    before = _files(out)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    start = time.monotonic()
    timed_out = False
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as log_file:
        stdout = open(table, "w") if run.kind == "throughput" else log_file  # the table apart from the progress
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout,
                                    stderr=log_file if stdout is not log_file else subprocess.STDOUT, env=env,
                                    start_new_session=True)  # its own process group: a timeout stops its children
        except OSError as e:
            log_file.write(f"cannot start {argv[0]}: {e.strerror or e}\n")
            rc = NOT_FOUND
        else:
            previous = _on_sigterm()
            try:
                rc = proc.wait(timeout=run.timeout)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, TIMED_OUT
                log_file.flush()
                gap = "\n" if log.stat().st_size else ""
                log_file.write(f"{gap}kvc bench suite: stopped after the run's timeout of {run.timeout:g} s\n")
            finally:
                _stop(proc)
                _restore_sigterm(previous)
        finally:
            if stdout is not log_file:
                stdout.close()
    seconds = time.monotonic() - start
    if run.kind == "throughput" and not _read_text(table).strip():
        _table_from_json(out / f"{run.name}.json", table)  # a run cut short: the rows it wrote
    after = _files(out)
    files = sorted(p for p, stamp in after.items() if before.get(p) != stamp and p not in (RECORDS, SUMMARY))
    return {"name": run.name, "kind": run.kind, "argv": argv, "rc": rc, "timed_out": timed_out,
            "seconds": round(seconds, 2), "started": started, "files": files}


def _stop(proc: subprocess.Popen) -> None:
    """End the run's process group (the run, or what it left running)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:  # no process of the group is left
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader ended; anything else of its group goes now
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            break


def _on_sigterm():
    """While a run runs, SIGTERM to the suite ends the run too (its own process group would not get it)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        return None


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _table_from_json(result: Path, table: Path) -> None:
    data = _read_json(result)
    if not data:
        return
    from kvc.runtime.bench.result import format_offline, format_profiles, format_table

    parts = [format_table(data), format_offline(data), format_profiles(data)]
    _write_text(table, "\n\n".join(p for p in parts if p) + "\n")


def _files(out: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*") if p.is_file()}


def _records(out: Path) -> dict[str, dict]:
    data = _read_json(out / RECORDS) or {}
    return {r["name"]: r for r in data.get("runs", []) if isinstance(r, dict) and "name" in r}


def _write_records(suite: Suite, out: Path, header: dict, record: dict | None) -> None:
    """suite.json: this call's header and every run's latest record, re-read first (another call may
    have written into the same folder)."""
    records = _records(out)
    if record is not None:
        records[record["name"]] = record
    order = [r.name for r in suite.runs]
    runs = [records[n] for n in order if n in records] + [r for n, r in records.items() if n not in order]
    _write_text(out / RECORDS, json.dumps({**header, "runs": runs}, indent=1) + "\n")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _write_text(path: Path, text: str) -> None:
    """Write whole or not at all (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise KvcError(f"cannot write {path}: {e.strerror or e}") from None
