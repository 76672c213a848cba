"""`kvc eval`: accuracy against KV budget, per method, on synthetic long-context tasks (runtime/eval/,
docs/accuracy.md). Parses the flags, shows a progress bar over the questions, writes the result JSON
after every cell, then the markdown table and the plot."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("takes comma-separated names")
    return names


def add_command(sub) -> None:
    from kvc.runtime.cli import add_method_inputs

    from kvc.runtime.eval.tasks import TASKS

    default_tasks = ",".join(name for name, task in TASKS.items() if task.default)
    p = sub.add_parser("eval", help="accuracy against KV budget per method on synthetic long-context tasks",
                       description="Runs every method at every budget on generated long-context tasks through "
                       "kvc's engine (greedy) and reports accuracy with 95%% intervals (docs/accuracy.md).")
    p.add_argument("--model", help="model directory, gguf:FILE (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--methods", type=_names, default=None,
                   help="comma-separated methods (names or .kvm paths; default: every shipped method the engine runs)")
    p.add_argument("--budgets", type=_ints, default=[128, 256, 512, 1024],
                   help="KV budgets in tokens per KV head, for every method with a `budget` parameter "
                   "(default 128,256,512,1024)")
    p.add_argument("--tasks", type=_names, default=_names(default_tasks),
                   help=f"comma-separated tasks (default {default_tasks}; all: {', '.join(TASKS)})")
    p.add_argument("--lengths", type=_ints, default=[2048, 4096], help="context lengths in tokens (default 2048,4096)")
    p.add_argument("--cases", type=int, default=24, help="cases per task and length (default 24)")
    p.add_argument("--seed", type=int, default=0, help="the cases' seed (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16 or float16")
    p.add_argument("--batch", type=int, default=16, help="cases running together in one engine (default 16)")
    p.add_argument("--no-share-prefill", action="store_true",
                   help="run the model in every setting's engine instead of prefilling each case once and "
                   "replaying it into every method and budget (the same answers, many more prefills)")
    p.add_argument("--record-memory", type=float, default=6.0, metavar="GIB",
                   help="GiB of shared prefills held at once; bounds the cases per group (default 6)")
    p.add_argument("--evict-interval", type=int, default=1, metavar="N",
                   help="decode-time eviction once N tokens past the kept count (default 1: every step; "
                   "larger than the answers: prefill-time eviction only, as kvpress runs)")
    p.add_argument("--method-param", action="append", metavar="KEY=VALUE",
                   help="a parameter for every method that declares it (repeatable)")
    add_method_inputs(p)
    p.add_argument("--reference", choices=["kvpress"], help="also run the same cases through kvpress's presses")
    p.add_argument("--out", type=Path, default=Path("kvc-eval.json"),
                   help="result JSON, rewritten after every cell; an existing one of the same run is continued "
                   "(default kvc-eval.json)")
    p.add_argument("--markdown", type=Path, help="write the table here too (it is always printed)")
    p.add_argument("--plot", type=Path, help="PNG plot of accuracy against budget (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def _run(a: argparse.Namespace) -> int:
    from kvc.runtime.eval import report
    from kvc.runtime.eval.runner import EvalConfig, Evaluation
    from kvc.runtime.server.launch import parse_method_params

    methods = a.methods
    if methods is None:
        from kvc.runtime.compiled.folder import served

        methods = served()
    cfg = EvalConfig(model=a.model, methods=methods, budgets=a.budgets, tasks=a.tasks, lengths=a.lengths,
                     cases=a.cases, seed=a.seed, device=a.device, dtype=a.dtype, batch=a.batch,
                     method_params=parse_method_params(a.method_param), reference=a.reference,
                     share_prefill=not a.no_share_prefill, record_memory=int(a.record_memory * 2**30),
                     evict_interval=a.evict_interval, method_inputs=a.method_inputs)
    evaluation = Evaluation(cfg)
    result = report.header(evaluation)
    evaluation.done = report.load_previous(a.out, result)
    result["cells"] = list(evaluation.done.values())
    already = len(result["cells"])
    if already:
        print(f"kvc eval: continuing {a.out}: {len(evaluation.done)} cell(s) already done", file=sys.stderr)
    pending = evaluation.pending()
    total = sum(evaluation.items(t, n) for _, _, t, n in pending)

    bar = not a.no_progress and sys.stderr.isatty()

    def on_cell(cell: dict) -> None:
        result["cells"].append(cell)
        report.write_json(a.out, result)
        if not bar:  # a log's progress: one line per cell
            budget = "" if cell["budget"] is None else f"@{cell['budget']}"
            done = len(result["cells"]) - already
            print(f"kvc eval: [{done}/{len(pending)}] {cell['engine']} {cell['method']}{budget} "
                  f"{cell['task']} {cell['length']}: {cell['correct']}/{cell['n']} in {cell['seconds']:.0f} s",
                  file=sys.stderr, flush=True)

    if not bar:
        evaluation.run(on_cell)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("kvc eval"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, transient=True) as progress:
            bar = progress.add_task("questions", total=total)
            evaluation.run(on_cell, on_items=lambda n: progress.advance(bar, n))
    result["complete"] = True
    report.write_json(a.out, result)
    table = report.markdown(result)
    print(table, end="")
    if a.markdown:
        a.markdown.write_text(table)
    if a.plot:
        report.plot(result, a.plot)
    return 0
