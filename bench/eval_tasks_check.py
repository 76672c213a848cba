"""Checks that kvc eval's tasks (runtime/eval/tasks.py) are solvable: runs `full` (no compression)
through kvc's LLM on each task's cases and prints accuracy per task and length. A task that `full`
cannot do measures nothing, so every task should score >= 90% here.

    python3 bench/eval_tasks_check.py --model /tmp/smol --lengths 1024,2048,4096,8000 --cases 20 \
        --device cuda        # float32 by default: the same greedy tokens as on the CPU

For an 8K-context model the longest length is 8000, not 8192: the prompt and its answers (and a
multi-turn case's later turns) must fit the context. Multi-turn cases run turn by turn: turn k's
prompt is turn k-1's prompt, the tokens generated for it, and turn k's suffix (with prefix caching
on, only the new tokens are prefilled).
"""

from __future__ import annotations

import argparse
import sys
import time

from kvc import LLM, SamplingParams
from kvc.runtime.errors import KvcError
from kvc.runtime.eval.tasks import TASKS, Case, Task, make_cases


def run_cases(llm: LLM, task: Task, cases: list[Case], show: int) -> tuple[int, int]:
    """Greedy generation for all cases together, turn by turn; returns (correct, total) answers
    and prints up to `show` misses."""
    params = [SamplingParams(max_tokens=c.max_tokens, temperature=0, stop_token_ids=list(c.stop_token_ids))
              for c in cases]
    prompts = [list(c.prompt) for c in cases]
    good = total = 0
    for turn in range(1 + max(len(c.turns) for c in cases)):
        live = [i for i, c in enumerate(cases) if turn <= len(c.turns)]
        outs = llm.generate([prompts[i] for i in live], [params[i] for i in live])
        for i, out in zip(live, outs):
            case = cases[i]
            expected = case.answer if turn == 0 else case.turns[turn - 1].answer
            ok = task.correct(expected, out.text)
            good += ok
            total += 1
            if not ok and show > 0:
                show -= 1
                print(f"    miss: case {case.index} turn {turn + 1} {dict(case.info)} "
                      f"expected {expected} got {out.text!r}")
            if turn < len(case.turns):
                prompts[i] += list(out.token_ids) + list(case.turns[turn].suffix)
    return good, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/smol")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    ap.add_argument("--lengths", default="1024,2048,4096", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=3, help="misses to print per task and length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 matches Hugging Face token for token")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    names = args.tasks.split(",")
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_batched_tokens=16384)
        work = [(name, length, make_cases(name, llm.tokenizer, length, args.cases, args.seed))
                for name in names for length in lengths]
    except KvcError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    rows = []
    for name, length, cases in work:
        t0 = time.perf_counter()
        good, total = run_cases(llm, TASKS[name], cases, args.show)
        rows.append((name, length, good, total))
        print(f"{name:16s} {length:6d}  {good:3d}/{total:<3d} {100 * good / total:5.1f}%  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\ntask              " + "".join(f"{n:>10d}" for n in lengths))
    for name in dict.fromkeys(r[0] for r in rows):
        cells = {r[1]: r for r in rows if r[0] == name}
        print(f"{name:16s}  " + "".join(f"{100 * cells[n][2] / cells[n][3]:9.1f}%" for n in lengths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
