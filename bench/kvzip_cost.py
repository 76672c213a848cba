"""What KVzip's replay pass costs: prefill time (prompt in, first token out) of `kvzip` against `full`,
measured in the same run on the same engine settings (runtime/context_replay.py re-reads the prompt
behind the repeat prompt, chunk by chunk, after the prefill).

    python bench/kvzip_cost.py                      # SmolLM2-135M-Instruct, CPU, 1K and 2K prompts
    python bench/kvzip_cost.py --lengths 4096 --chunk 1024 --repeats 3

Each timing is the median of `--repeats` runs of one request (max_tokens 1, greedy; prefix caching off);
the first run of each engine warms it up and is not counted. Figures: docs/benchmarks.md, "KVzip's replay pass".
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvc.runtime.eval.filler import fit, token_units
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams


def prompt_of(tokenizer, length: int) -> list[int]:
    """`length` tokens of the eval filler's prose, framed as one chat user turn."""
    frame = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                          add_generation_prompt=True).split("x")
    head = tokenizer.encode(frame[0], add_special_tokens=False)
    tail = tokenizer.encode(frame[1], add_special_tokens=False)
    body = [t for unit in fit(token_units(tokenizer, 0), length - len(head) - len(tail)) for t in unit]
    return head + body + tail


def timed(llm: LLM, prompt: list[int], repeats: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompt], params)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens")
    p.add_argument("--chunk", type=int, default=2048, help="kvzip's replay chunk (its default: 2048)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    # no prefix caching: a repeated prompt would skip full's prefill (kvzip, which compacts, caches none)
    engines = {name: LLM(method=name, device=args.device, enable_prefix_caching=False,
                         **({"method_params": {"chunk": args.chunk}} if name == "kvzip" else {}))
               for name in ("full", "kvzip")}
    tokenizer = engines["full"].tokenizer
    print("| prompt tokens | full prefill (s) | kvzip prefill + replay (s) | ratio |")
    print("| --- | --- | --- | --- |")
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = prompt_of(tokenizer, length)
        full, kvzip = (timed(engines[name], prompt, args.repeats) for name in ("full", "kvzip"))
        print(f"| {len(prompt)} | {full:.2f} | {kvzip:.2f} | {kvzip / full:.2f}x |")


if __name__ == "__main__":
    main()
