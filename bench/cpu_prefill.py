"""kvc against Hugging Face transformers on the CPU, float32, same process: prefill time (time to
the first token, no prefix-cache hit) per prompt length and thread count, and a batch of prompts
in one `LLM.generate` call against the same prompts one at a time.

Runs alternate between kvc and transformers (and between the batch's two ways), the order
flipping every repeat, so that a machine shared with other work slows both sides alike; the table
gives medians. Prompts are random token ids, fresh for every repeat (kvc runs without prefix
caching, so nothing is reused anyway); within a repeat both sides get the same prompt and their
first greedy tokens are compared. transformers' prefill is one forward with `logits_to_keep=1`,
what its `generate` does for the first token. Results: docs/benchmarks.md, "CPU (embedded default
model)".

    python bench/cpu_prefill.py --model /tmp/smol --lengths 2048,4096 --threads 1,2 --repeats 3 \\
        --batch 8 --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def random_prompt(gen: torch.Generator, length: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab, (length,), generator=gen).tolist()


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn):
    """(wall seconds, CPU seconds of the process, minor page faults, fn())."""
    start, cpu, faults = time.perf_counter(), time.process_time(), minor_faults()
    result = fn()
    return time.perf_counter() - start, time.process_time() - cpu, minor_faults() - faults, result


class Sides:
    """The two engines under test, loaded once."""

    def __init__(self, model: str, kv_memory: int | None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from kvc import LLM

        hf_logging.disable_progress_bar()  # its weight-loading bar would drown the table
        self.llm = LLM(model, device="cpu", enable_prefix_caching=False, kv_cache_memory=kv_memory)
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.vocab = self.hf.config.vocab_size

    def kvc_generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from kvc import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [out.token_ids for out in self.llm.generate(prompts, params)]

    @torch.inference_mode()
    def hf_prefill(self, prompt: list[int]) -> int:
        logits = self.hf(torch.tensor([prompt]), logits_to_keep=1).logits
        return int(logits[0, -1].argmax())

    @torch.inference_mode()
    def hf_generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()


def prefill_case(sides: Sides, gen: torch.Generator, threads: int, length: int, repeats: int, progress) -> dict:
    kvc_s, hf_s, kvc_cpu, hf_cpu, same = [], [], [], [], []
    faults: dict[str, list[int]] = {"kvc": [], "hf": []}
    for r in range(repeats):
        prompt = random_prompt(gen, length, sides.vocab)
        runs = {
            "kvc": lambda prompt=prompt: sides.kvc_generate([prompt], 1)[0][0],
            "hf": lambda prompt=prompt: sides.hf_prefill(prompt),
        }
        order = ["kvc", "hf"] if r % 2 == 0 else ["hf", "kvc"]
        got = {}
        for side in order:
            seconds, cpu, page_faults, got[side] = timed(runs[side])
            (kvc_s if side == "kvc" else hf_s).append(seconds)
            (kvc_cpu if side == "kvc" else hf_cpu).append(cpu)
            faults[side].append(page_faults)
            progress()
        same.append(got["kvc"] == got["hf"])
    kvc, hf = statistics.median(kvc_s), statistics.median(hf_s)
    return {"threads": threads, "length": length, "kvc_s": kvc_s, "hf_s": hf_s, "kvc_cpu_s": kvc_cpu,
            "hf_cpu_s": hf_cpu, "kvc_minor_faults": faults["kvc"], "hf_minor_faults": faults["hf"],
            "kvc_median_s": kvc, "hf_median_s": hf, "speed_vs_hf": hf / kvc,
            "cpu_speed_vs_hf": statistics.median(hf_cpu) / statistics.median(kvc_cpu), "same_first_token": same}


def batch_case(sides: Sides, gen: torch.Generator, threads: int, lengths: list[int], new_tokens: int,
               repeats: int, with_hf: bool, progress) -> dict:
    times: dict[str, list[float]] = {"kvc_batched": [], "kvc_one_by_one": [], "hf_one_by_one": []}
    cpu_times: dict[str, list[float]] = {side: [] for side in times}
    same = []
    for r in range(repeats):
        prompts = [random_prompt(gen, n, sides.vocab) for n in lengths]
        runs = {
            "kvc_batched": lambda prompts=prompts: sides.kvc_generate(prompts, new_tokens),
            "kvc_one_by_one": lambda prompts=prompts: [sides.kvc_generate([p], new_tokens)[0] for p in prompts],
        }
        if with_hf:
            runs["hf_one_by_one"] = lambda prompts=prompts: [sides.hf_generate(p, new_tokens) for p in prompts]
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        got = {}
        for side in order:
            seconds, cpu, _, got[side] = timed(runs[side])
            times[side].append(seconds)
            cpu_times[side].append(cpu)
            progress()
        same.append(got["kvc_batched"] == got["kvc_one_by_one"])
    medians = {side: statistics.median(t) for side, t in times.items() if t}
    result = {"threads": threads, "lengths": lengths, "new_tokens": new_tokens, "times_s": times,
              "cpu_times_s": cpu_times, "median_s": medians,
              "batched_speedup": medians["kvc_one_by_one"] / medians["kvc_batched"],
              "same_tokens_batched_and_one_by_one": same}
    if with_hf:
        result["batched_vs_hf_one_by_one"] = medians["hf_one_by_one"] / medians["kvc_batched"]
    return result


def table(results: dict) -> str:
    rows = ["prefill (s, median)  threads  tokens   kvc      hf    kvc speed vs hf  (CPU time)  same first token"]
    for r in results["prefill"]:
        rows.append(f"{'':21s}{r['threads']:>7d}  {r['length']:>6d}  {r['kvc_median_s']:6.2f}  {r['hf_median_s']:6.2f}"
                    f"  {r['speed_vs_hf']:14.2f}x  {r['cpu_speed_vs_hf']:9.2f}x  {all(r['same_first_token'])}")
    for r in results["batch"]:
        m = r["median_s"]
        hf = f", hf one by one {m['hf_one_by_one']:.2f} s" if "hf_one_by_one" in m else ""
        rows.append(f"batch of {len(r['lengths'])} ({min(r['lengths'])}-{max(r['lengths'])} tokens, "
                    f"{r['new_tokens']} new), {r['threads']} thread(s): kvc batched {m['kvc_batched']:.2f} s, "
                    f"kvc one by one {m['kvc_one_by_one']:.2f} s ({r['batched_speedup']:.2f}x){hf}; "
                    f"same tokens: {all(r['same_tokens_batched_and_one_by_one'])}")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default",
                   help="a local Hugging Face model directory (both sides load it); default: the embedded model's")
    p.add_argument("--lengths", default="2048,4096", help="prompt lengths of the prefill cases")
    p.add_argument("--threads", default="1,2", help="torch thread counts, each run on both sides")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="prompts in the batch case (0: skip it)")
    p.add_argument("--batch-repeats", type=int, default=None, help="repeats of the batch case (default: --repeats)")
    p.add_argument("--batch-min", type=int, default=500, help="shortest prompt of the batch")
    p.add_argument("--batch-max", type=int, default=2000, help="longest prompt of the batch")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt in the batch case")
    p.add_argument("--batch-hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' generate on the batch's prompts one at a time")
    p.add_argument("--kv-memory-mib", type=int, default=None, help="kvc's KV pool (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    import transformers
    from rich.progress import Progress

    lengths = [int(x) for x in a.lengths.split(",") if x]
    threads = [int(x) for x in a.threads.split(",") if x]
    step = (a.batch_max - a.batch_min) / max(a.batch - 1, 1)
    batch_lengths = [round(a.batch_min + i * step) for i in range(a.batch)]
    if a.model == "default":
        from kvc.runtime.default_model import ensure_default_model

        a.model = str(ensure_default_model())
    sides = Sides(a.model, None if a.kv_memory_mib is None else a.kv_memory_mib * 2**20)
    gen = torch.Generator().manual_seed(a.seed)
    warm = random_prompt(gen, 64, sides.vocab)
    sides.kvc_generate([warm], 2), sides.hf_prefill(warm)  # first-call allocations stay out of the timings
    results = {
        "date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
        "cpu": cpu_name(), "cores": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__, "prefill": [], "batch": [],
    }
    batch_repeats = a.repeats if a.batch_repeats is None else a.batch_repeats
    batch_runs = (3 if a.batch_hf else 2) * batch_repeats if a.batch else 0
    total = len(threads) * (2 * a.repeats * len(lengths) + batch_runs)
    with Progress(transient=True) as bar:
        task = bar.add_task("cpu prefill bench", total=total)

        def progress() -> None:
            bar.advance(task)

        for t in threads:
            torch.set_num_threads(t)
            for n in lengths:
                results["prefill"].append(prefill_case(sides, gen, t, n, a.repeats, progress))
            if a.batch:
                results["batch"].append(batch_case(sides, gen, t, batch_lengths, a.new_tokens, batch_repeats,
                                                   a.batch_hf, progress))
    print(table(results))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
