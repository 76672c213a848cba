"""Is kvc's KIVI the paper's KIVI on the real default model? The eval's passkey cases (4K tokens) run
through kvc's `kivi` method (float32, CPU, torch backend) and through the hand-written reference of
tests/references/kivi.py (a Hugging Face model whose attention reads K/V as KIVI's cache holds
them), greedy; the script prints, per case, both answers, whether the tokens agree, the largest
logit difference, and `full`'s answer for comparison. Agreement means an accuracy figure of `kivi`
is the algorithm's on this model, not an artefact of the engine.

    python bench/kivi_reference_check.py --bits 2 --cases 3 [--length 4096] [--out FILE.json]
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
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.engine import Engine
    from kvc.runtime.eval.tasks import make_cases
    from kvc.runtime.llm import LLM
    from kvc.runtime.models.loader import model_directory
    from kvc.runtime.sampling_params import SamplingParams
    from tests.models.tiny import load_hf
    from tests.references import kivi as ref

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--cases", type=int, default=3)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--task", default="passkey")
    p.add_argument("--out")
    a = p.parse_args()
    directory = model_directory(None)
    hf = load_hf(directory)
    params = {"bits": a.bits, "group_size": 32, "residual_length": 128}
    engines = {name: LLM.from_engine(Engine(EngineConfig(
        model=None, device="cpu", dtype="float32", attention_backend="torch", method=name,
        method_params=params if name == "kivi" else None, max_num_seqs=4))) for name in ("kivi", "full")}
    tokenizer = engines["kivi"].engine.tokenizer
    rows = []
    for case in make_cases(a.task, tokenizer, a.length, a.cases, 0):
        sp = SamplingParams(max_tokens=case.max_tokens, temperature=0.0, logprobs=None,
                            stop_token_ids=list(case.stop_token_ids))
        start = time.perf_counter()
        got = {name: llm.generate(list(case.prompt), sp)[0].token_ids for name, llm in engines.items()}
        want, _ = ref.generate(hf, ref.Session(bits=a.bits, group=32, residual=128), list(case.prompt),
                               len(got["kivi"]))
        row = {"case": case.index, "answer": case.answer, "kivi": tokenizer.decode(got["kivi"]),
               "reference": tokenizer.decode(want), "full": tokenizer.decode(got["full"]),
               "tokens_agree": got["kivi"] == want, "seconds": round(time.perf_counter() - start, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"kivi-{a.bits}: {sum(r['tokens_agree'] for r in rows)}/{len(rows)} cases token-identical to the reference")
    if a.out:
        Path(a.out).write_text(json.dumps({"bits": a.bits, "length": a.length, "rows": rows}, indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main()
