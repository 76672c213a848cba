"""Torch operations a decode step's step_end launches per layer (CPU count: on a GPU each is a kernel launch).

Per-step eviction over a batch costs the GPU about a launch's time per operation per layer, whatever the
batch (docs/benchmarks.md, "one layer's eviction on the H200"): this counts them. It serves `random:tiny`,
decodes until eviction runs at every step, profiles one engine step's `StepHooks.step_end` and prints the
non-view aten operations called from Python (not those inside other aten operations), per layer, with the
sequence of one layer.

    python bench/step_end_ops.py --method streamingllm --params sink=4,recent=60
    python bench/step_end_ops.py --method snapkv --params budget=64,window=8,every=1 --fused

`--fused`: the compiled methods' fused Triton kernels run on the CPU too (interpreted, TRITON_INTERPRET=1), as
on a GPU (one launch each, whatever aten calls the interpreter makes inside it are not counted).
"""

from __future__ import annotations

import argparse
import collections
import os

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvc import LLM, SamplingParams

VIEWS = {"as_strided", "view", "select", "slice", "transpose", "unsqueeze", "permute", "expand", "reshape",
         "_unsafe_view", "movedim", "flatten", "alias", "detach", "lift_fresh", "t", "squeeze", "unbind", "split",
         "chunk", "narrow", "empty", "empty_strided", "empty_like", "resolve_conj", "resolve_neg",
         "_reshape_alias"}


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


KERNEL_MARK = "triton::"  # a fused kernel's launch, as the profiler records it (`_fuse_on_cpu`)


def _fuse_on_cpu() -> None:
    """The fused Triton kernels on the CPU (interpreted), each call recorded as one launch."""
    from kvc.runtime.compiled.folder import GeneratedCode
    from kvc.runtime.compiled.method import CompiledMethod

    CompiledMethod.fused_devices = ("cuda", "cpu")
    fused = GeneratedCode.fused

    def marked(self, hook):
        fn = fused(self, hook)
        if fn is None:
            return None

        def call(*args, **kwargs):
            with record_function(KERNEL_MARK + fn.__name__):
                return fn(*args, **kwargs)

        return call

    GeneratedCode.fused = marked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="streamingllm")
    p.add_argument("--params", default="sink=4,recent=60", help="k=v,... method parameters")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--fused", action="store_true", help="run the fused Triton kernels on the CPU (TRITON_INTERPRET=1)")
    a = p.parse_args()
    if a.fused:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the generated kernels import triton
        _fuse_on_cpu()
    params = {k: _value(v) for k, v in (kv.split("=") for kv in a.params.split(",") if kv)}
    llm = LLM("random:tiny", device="cpu", dtype="float32", method=a.method, method_params=params, page_size=16,
              async_scheduling=False, decode_rings=False)  # the step end's eviction (a ring has none)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    for _ in range(a.batch):
        engine.add_request(torch.randint(3, 300, (a.prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(12):
        engine.step()
    hooks = engine.runner.hooks
    step_end, captured = hooks.step_end, {}

    def profiled(batch, output):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step_end(batch, output)
        captured["prof"] = prof

    hooks.step_end = profiled
    engine.step()
    hooks.step_end = step_end

    def launched(e) -> bool:
        if e.name.startswith(KERNEL_MARK):
            return True
        name = e.name[6:]
        parent = e.cpu_parent
        return (e.name.startswith("aten::") and name not in VIEWS and not inside_kernel(e)
                and (parent is None or not parent.name.startswith("aten::") or parent.name[6:] in VIEWS))

    def inside_kernel(e) -> bool:
        """Within an interpreted Triton launch (its numpy conversions are the interpreter's, not launches)."""
        return any(k.time_range.start <= e.time_range.start and e.time_range.end <= k.time_range.end
                   for k in kernels)

    kernels = [e for e in captured["prof"].events() if e.name.startswith(KERNEL_MARK)]

    ops = sorted((e for e in captured["prof"].events() if launched(e)), key=lambda e: e.time_range.start)
    layers = engine.runner.num_layers
    counts = collections.Counter(e.name.split("::", 1)[1] for e in ops)
    print(f"{a.method}: {len(ops) / layers:.0f} torch operations a layer ({layers} layers, batch {a.batch})")
    print("most called:", ", ".join(f"{n} {c // layers}" for n, c in counts.most_common(12)))
    print("one layer:", " ".join(e.name.split("::", 1)[1] for e in ops[: len(ops) // layers]))


if __name__ == "__main__":
    main()
