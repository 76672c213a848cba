"""Model code on CUDA in bf16: the grouped-GEMM expert path and direct-to-device builds.

Skipped without a GPU (CI has none); run on a GPU machine with `pytest tests/models -k gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.models.experts import RoutedExperts
from kvc.runtime.models.loader import build_random_model, load_model
from tests.models.tiny import make_tiny_qwen3_moe, reference_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(len(ids), device=ids.device)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, reference_attention()))


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_gpu_bf16_moe_matches_cpu_fp32(impl: str, tmp_path: Path) -> None:
    path = make_tiny_qwen3_moe(tmp_path, moe_intermediate_size=64)
    want = logits(load_model(path).model, torch.arange(40) % 320)
    gpu = load_model(path, "cuda", torch.bfloat16).model
    assert gpu.embed_tokens.weight.is_cuda and gpu.embed_tokens.weight.dtype == torch.bfloat16
    for module in gpu.modules():
        if isinstance(module, RoutedExperts):
            module.impl = impl  # type: ignore[assignment]
    got = logits(gpu, (torch.arange(40) % 320).cuda()).cpu()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_gpu_random_build_allocates_on_device() -> None:
    loaded = build_random_model("qwen3-30b-a3b", "cuda", num_hidden_layers=2)
    params = list(loaded.model.parameters())
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in params)
    ids = torch.arange(64, device="cuda")
    assert torch.isfinite(logits(loaded.model, ids)).all()
