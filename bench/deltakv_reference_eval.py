"""What does the DeltaKV algorithm score on kvc eval's tasks with the embedded model? Runs each case
through the hand-written reference of tests/references/deltakv.py (a Hugging Face model whose
attention reads the cache as DeltaKV holds it; float32, CPU, greedy) and scores the answers with the
task's own rule. A multi-turn case continues its session turn by turn, as the engine does. With
`--identity` (a lossless compressor) the figure must be `full`'s: a sanity check of the reference.

    python bench/deltakv_reference_eval.py --compressor FILE.safetensors [--tasks passkey,multikey]
        [--length 4096] [--cases 5] [--out FILE.json]
    python bench/deltakv_reference_eval.py --identity --cases 2 --length 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/ importable


def main() -> None:
    from kvc.runtime.eval.tasks import TASKS, make_cases
    from kvc.runtime.models.loader import model_directory
    from kvc.runtime.tokenizer import load_tokenizer
    from tests.models.tiny import load_hf
    from tests.references import deltakv as ref

    defaults = ref.Params()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--compressor", help="safetensors as `kvc calibrate deltakv` writes it (down, up [layers, Hkv, "
                                            "2 D, C], bias [layers, Hkv, 2 D]), or k_/v_ down, up, bias [.., D, ..]")
    which.add_argument("--identity", action="store_true", help="a lossless compressor (C = 2 Hkv D): scores as full")
    p.add_argument("--tasks", default="passkey", help="comma-separated task names")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--cases", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, help="prefill chunk size (default: the prompt in one chunk)")
    p.add_argument("--out", help="write the rows and summaries here (JSON)")
    for name in ("sink", "recent", "stride", "neighbours", "selected"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    p.add_argument("--full-layers", default=",".join(map(str, defaults.full_layers)))
    a = p.parse_args()
    params = ref.Params(sink=a.sink, recent=a.recent, stride=a.stride, neighbours=a.neighbours, selected=a.selected,
                        full_layers=tuple(int(x) for x in a.full_layers.split(",") if x.strip()))
    directory = model_directory(None)
    model, tokenizer = load_hf(directory), load_tokenizer(directory)
    cfg = model.config
    if a.identity:
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        compressor = ref.identity_compressor(cfg.num_hidden_layers, cfg.num_key_value_heads, dim)
    else:
        compressor = ref.Compressor.load(a.compressor)
    eos = {tokenizer.eos_token_id} - {None}
    rows, summaries = [], {}
    for task_name in a.tasks.split(","):
        task = TASKS[task_name]
        good = total = 0
        for case in make_cases(task_name, tokenizer, a.length, a.cases, a.seed):
            start = time.perf_counter()
            state = ref.session(model, params, compressor)
            stops = set(case.stop_token_ids) | eos
            ids, answers = list(case.prompt), []
            for turn in range(1 + len(case.turns)):
                tokens = ref.generate(model, ids, params, compressor, case.max_tokens, chunk=a.chunk,
                                      stop_token_ids=stops, state=state)
                expected = case.answer if turn == 0 else case.turns[turn - 1].answer
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                answers.append({"expected": expected, "text": text, "correct": task.correct(expected, text)})
                if turn < len(case.turns):  # the last token is not stored yet: the next turn feeds it
                    ids = [tokens[-1], *case.turns[turn].suffix]
            good += sum(x["correct"] for x in answers)
            total += len(answers)
            row = {"task": task_name, "case": case.index, "answers": answers, "compressed": max(state.compressed),
                   "seconds": round(time.perf_counter() - start, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        summaries[task_name] = {"correct": good, "total": total}
        print(f"{task_name}: {good}/{total} correct (deltakv reference, length {a.length}, "
              f"{'identity' if a.identity else a.compressor})", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"params": vars(params), "length": a.length, "seed": a.seed,
                                           "compressor": "identity" if a.identity else a.compressor,
                                           "summaries": summaries, "rows": rows}, indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main()
