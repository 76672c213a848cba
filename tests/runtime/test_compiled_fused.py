"""The adapter's GPU path on the CPU: with the fused Triton kernels enabled (TRITON_INTERPRET=1),
compiled methods give the same greedy tokens and keep the same tokens as with the torch lowering.

On a GPU the adapter calls kernels_generated/<m>/triton_kernels.py for every hook the compiler
fused (SnapKV's and PyramidKV's window scores, TOVA's last-row score, H2O's prefill column sums);
here `CompiledMethod.fused_devices` admits the CPU so the same code path runs interpreted."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvc.runtime.compiled.method import CompiledMethod  # noqa: E402
from kvc.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.models.tiny import make_tiny_qwen3  # noqa: E402
from tests.runtime.test_compiled_methods import make_llm, prompts_of  # noqa: E402

CASES = {
    "snapkv": {"budget": 24, "window": 6, "kernel": 5},
    "pyramidkv": {"budget": 24, "window": 6, "kernel": 3},
    "tova": {"budget": 20},
    "h2o": {"heavy": 0.3, "recent": 0.1},
}


ORIGINAL_END, ORIGINAL_KERNEL = CompiledMethod.prefill_end, CompiledMethod._kernel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def _run(model_dir, method, params, fused: bool, monkeypatch):
    monkeypatch.setattr(CompiledMethod, "fused_devices", ("cuda", "cpu") if fused else ("cuda",))
    plans, calls = [], []

    def spy_end(self, layer, view):
        plan = ORIGINAL_END(self, layer, view)
        plans.append(None if plan is None else plan.indices.clone())
        return plan

    def spy_kernel(self, hook, device):
        fn = ORIGINAL_KERNEL(self, hook, device)
        calls.append(fn is not None)
        return fn

    monkeypatch.setattr(CompiledMethod, "prefill_end", spy_end)
    monkeypatch.setattr(CompiledMethod, "_kernel", spy_kernel)
    llm = make_llm(model_dir, method, params)
    prompts = prompts_of([45, 70], seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    return [o.token_ids for o in outs], plans, calls


@pytest.mark.parametrize("method", sorted(CASES))
def test_fused_path_equals_torch_lowering(model_dir, method, monkeypatch):
    tokens_ref, plans_ref, calls_ref = _run(model_dir, method, CASES[method], False, monkeypatch)
    tokens, plans, calls = _run(model_dir, method, CASES[method], True, monkeypatch)
    assert not any(calls_ref) and any(calls), "the fused kernels must run only when enabled"
    assert tokens == tokens_ref
    assert len(plans) == len(plans_ref)
    for got, want in zip(plans, plans_ref):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want)


def test_a_decode_budget_scores_with_the_fused_kernel(model_dir, monkeypatch):
    """SnapKV's decode budget (`step_end ... where step % every == 0`) scores the same tree as its prefill_end:
    the compiler gives step_end the same kernel, which the stacked step end runs over the rows' query windows
    and keys (no [rows x heads, queries, keys] attention in memory). Its plans and tokens equal the lowering's."""
    params = {"budget": 24, "window": 6, "kernel": 5, "every": 2}
    original_batch = CompiledMethod.step_end_batch

    def run(fused: bool):
        monkeypatch.setattr(CompiledMethod, "fused_devices", ("cuda", "cpu") if fused else ("cuda",))
        plans, hooks = [], []

        def spy_batch(self, layer, views):
            out = original_batch(self, layer, views)
            plans.extend(None if p is None else p.indices.clone() for p in out)
            return out

        def spy_kernel(self, hook, device):
            fn = ORIGINAL_KERNEL(self, hook, device)
            hooks.append((hook, fn is not None))
            return fn

        monkeypatch.setattr(CompiledMethod, "step_end_batch", spy_batch)
        monkeypatch.setattr(CompiledMethod, "_kernel", spy_kernel)
        llm = make_llm(model_dir, "snapkv", params)
        outs = llm.generate(prompts_of([45, 70, 52], seed=6), SamplingParams(temperature=0, max_tokens=9))
        return [o.token_ids for o in outs], plans, hooks

    tokens_ref, plans_ref, hooks_ref = run(False)
    tokens, plans, hooks = run(True)
    assert ("step_end", True) in hooks and ("step_end", True) not in hooks_ref
    assert tokens == tokens_ref
    assert len(plans) == len(plans_ref) and sum(p is not None for p in plans) > 0
    for got, want in zip(plans, plans_ref):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want)
