"""Programmatic dependent launch (runtime/primitives/pdl.py): which devices use it, that every decode-step
kernel launched with it waits for the kernel before it ahead of any memory access, and that the wait and the
release reach the sm90 build."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from kvc.runtime.primitives import pdl  # noqa: E402


def _kernels():
    from kvc.kernels_generated._attention import plain
    from kvc.kernels_generated.quest import triton_kernels as quest
    from kvc.runtime.kv import records_triton, summary_kernels
    from kvc.runtime.models import moe_align, moe_triton, norm_triton, router_triton
    from kvc.runtime.primitives import race_triton, triton_plans

    return [norm_triton._rms_norm_kernel, norm_triton._add_rms_norm_kernel, norm_triton._norm_rope_kernel,
            norm_triton._silu_mul_kernel, router_triton._softmax_topk_kernel, router_triton._gate_softmax_topk_kernel,
            router_triton._sigmoid_topk_kernel, moe_align._align_parallel_kernel, moe_align._align_single_kernel,
            moe_align._align_counts_kernel, moe_align._align_split_kernel, moe_triton._gate_up_kernel,
            moe_triton._down_kernel, moe_triton._sum_pairs_kernel, records_triton._positions_kernel,
            records_triton._queries_kernel, race_triton._race_kernel, race_triton._pick_kernel,
            plain._store_kv_kernel, plain._decode_split_kernel, plain._decode_reduce_kernel,
            quest._page_scores_kernel, triton_plans._read_pages_kernel, triton_plans._slice_candidates_kernel,
            triton_plans._cut_candidates_kernel, summary_kernels._append_kernel]


def test_only_hopper_gpus_launch_with_pdl(monkeypatch):
    assert pdl.options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "_hopper", lambda index: True)
    monkeypatch.setattr(pdl, "SWITCHED_ON", False)  # KVC_PDL=0
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(pdl, "SWITCHED_ON", True)  # KVC_PDL unset (or 1)
    assert pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(pdl, "_hopper", lambda index: False)  # an A100
    assert not pdl.enabled(torch.device("cuda", 0))


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k.fn.__name__)
def test_a_kernel_waits_before_it_touches_memory(kernel):
    """Its first statement (after a docstring) is `pdl_gate(PDL)`, and PDL defaults to False (a launch without
    it, e.g. on the CPU, runs as before)."""
    params = inspect.signature(kernel.fn).parameters
    assert "PDL" in params and params["PDL"].default is False
    body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    first = body[0]
    assert isinstance(first, ast.Expr) and ast.unparse(first) == "pdl_gate(PDL)", ast.unparse(first)


def test_the_wait_and_the_release_reach_the_sm90_build():
    from tests.kernels.sm90 import code_compiles_for_sm90

    code_compiles_for_sm90(
        "from tests.kernels.sm90_compile import build\n"
        "from kvc.runtime.models import norm_triton as n\n"
        "ptx = build(n._add_rms_norm_kernel, {'BLOCK': 2048, 'PARTS': 8, 'PDL': True}, {'x_ptr': '*bf16', "
        "'res_ptr': '*bf16', 'w_ptr': '*bf16', 'out_ptr': '*bf16', 'eps': 'fp32'}, num_warps=8)\n"
        "assert ptx.index('griddepcontrol.wait') < ptx.index('ld.global'), 'the wait comes after a load'\n"
        "assert 'griddepcontrol.launch_dependents' in ptx\n"
        "off = build(n._add_rms_norm_kernel, {'BLOCK': 2048, 'PARTS': 8}, {'x_ptr': '*bf16', 'res_ptr': '*bf16', "
        "'w_ptr': '*bf16', 'out_ptr': '*bf16', 'eps': 'fp32'}, num_warps=8)\n"
        "assert 'griddepcontrol' not in off\n"
    )
