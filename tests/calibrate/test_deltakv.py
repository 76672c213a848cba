"""`kvc calibrate deltakv` (runtime/calibrate/deltakv.py): the compressor trained on a tiny random model.

- References (runtime/kv/delta.py): the mean of each token's nearest centers at or before it, against a
  brute-force search; the store's codes read back as the hand-written oracle's.
- The PCA initialisation is the least-squares optimum of a linear code: at the full width it
  reconstructs exactly, and at half the width it beats a random orthonormal code of the same size.
- The command trains through the frozen model and writes the inputs methods/deltakv.kvm declares
  ([layers, Hkv, 2 D, code] projections, [layers, Hkv, 2 D] biases), zeros in its full layers, with
  the held-out cross-entropy and reconstruction error in the file's metadata.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvc.runtime.calibrate import deltakv as D
from kvc.runtime.kv import delta
from kvc.runtime.calibrate.cli import add_command
from kvc.runtime.errors import ConfigError
from kvc.runtime.models.loader import load_model
from tests.models.tiny import make_tiny_llama


def test_references_are_the_nearest_centers_at_or_before_each_token() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g)
    start, end = delta.block_of(40, 0, sink=3, recent=8)
    assert (start, end) == (3, 27)  # 24 = 3 blocks of 8, leaving 13 >= 8 raw
    assert delta.block_of(40, 24, sink=3, recent=8) == (27, 27)  # 13 raw: fewer than 2 x 8
    assert delta.block_of(43, 24, sink=3, recent=8) == (27, 35)
    centers = delta.center_positions(end, sink=3, stride=4)
    assert centers.tolist() == [0, 1, 2, 3, 7, 11, 15, 19, 23]
    rows = torch.arange(start, end)
    ref, near = delta.references(x[rows], rows, x[centers], centers, count=4)
    for i, t in enumerate(rows.tolist()):
        before = [c for c in centers.tolist() if c <= t]
        best = sorted(before, key=lambda c: float((x[t] - x[c]).square().sum()))[:4]
        assert sorted(near[i][near[i] >= 0].tolist()) == sorted(best), t
        torch.testing.assert_close(ref[i], x[best].mean(0))


def test_references_in_blocks_of_rows_equal_one_block() -> None:
    """A long block goes through the distances a few rows at a time (bounded memory), with the same answer."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 5, generator=g)
    x[200] = x[120]  # equal distances: the earlier center wins in every block
    centers = delta.center_positions(280, sink=4, stride=8)
    rows = torch.arange(8, 280)
    whole = delta.references(x[rows], rows, x[centers], centers, count=4)
    blocked = delta.references(x[rows], rows, x[centers], centers, count=4, cells=3 * len(centers))
    assert torch.equal(whole[1], blocked[1])
    torch.testing.assert_close(whole[0], blocked[0], rtol=0, atol=0)


@pytest.mark.parametrize("data", ["random", "clustered", "duplicates"])
def test_candidates_from_one_product_give_the_exact_neighbours(data: str) -> None:
    """Against many centers the nearest come from a float32 product's candidates: the same neighbours and
    references as the float64 search of every distance, on spread, tightly clustered (near ties: rows redone
    exactly) and duplicated vectors (exact ties: the earlier center)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(600, 64, generator=g) * 4
    if data == "clustered":
        x = 50 + torch.randn(600, 64, generator=g) * 1e-3
    if data == "duplicates":
        x[300:] = x[torch.randint(0, 300, (300,), generator=g)]
    centers = delta.center_positions(600, sink=4, stride=2)
    rows = torch.arange(4, 600)
    exact = delta.references(x[rows], rows, x[centers], centers, count=4, pool=10**9)
    fast = delta.references(x[rows], rows, x[centers], centers, count=4, pool=16)
    assert torch.equal(exact[1], fast[1])
    torch.testing.assert_close(exact[0], fast[0], rtol=0, atol=0)


def test_a_token_with_fewer_centers_than_neighbours_averages_those_it_has() -> None:
    x = torch.arange(12.0)[:, None].repeat(1, 3)
    centers = torch.tensor([0, 4])
    ref, near = delta.references(x[[1, 5]], torch.tensor([1, 5]), x[centers], centers, count=3)
    assert near.tolist() == [[0, -1, -1], [4, 0, -1]]
    torch.testing.assert_close(ref, torch.tensor([[0.0] * 3, [2.0] * 3]))


def test_pca_is_exact_at_full_width_and_beats_a_random_code() -> None:
    g = torch.Generator().manual_seed(1)
    delta = torch.randn(500, 16, generator=g) @ torch.randn(16, 16, generator=g) + 3.0
    u, bias = D._pca(delta, 16)
    torch.testing.assert_close(((delta @ u) @ u.T) + bias, delta, atol=1e-4, rtol=1e-4)
    u, bias = D._pca(delta, 8)
    err = ((delta @ u) @ u.T + bias - delta).square().sum()
    for seed in range(5):
        q = torch.linalg.qr(torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)))[0]
        mu = delta.mean(0)
        random_err = ((delta @ q) @ q.T + (mu - q @ (q.T @ mu)) - delta).square().sum()
        assert err < random_err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("deltakv"), seed=5, tokenizer=True, num_hidden_layers=4,
                           initializer_range=0.25)


def test_training_keeps_full_attention_outside_the_block_and_lowers_the_loss(tiny: Path) -> None:
    loaded = load_model(tiny, "cpu", torch.float32)
    batches = [torch.randint(0, loaded.spec.vocab_size, (96,), generator=torch.Generator().manual_seed(s))
               for s in range(3)]
    width = 2 * loaded.spec.num_kv_heads * loaded.spec.head_dim
    cfg = D.DeltaConfig(layers=[1, 3], code=width, sink=2, recent=16, stride=4, neighbours=2, steps=0, bf16=False)
    exact = D.calibrate(tiny, batches, cfg)
    assert exact.errors["pca"] < 1e-8  # a code as wide as the token is lossless
    assert exact.ce["pca"] == pytest.approx(exact.ce["full"], abs=1e-4)
    cfg = D.DeltaConfig(layers=[1, 3], code=width // 4, sink=2, recent=16, stride=4, neighbours=2, steps=8,
                        lr=1e-3, bf16=False)
    result = D.calibrate(tiny, batches[:1], cfg)
    assert result.errors["pca"] > 1e-3 and len(result.losses) == 8
    assert result.losses[-1] < result.losses[0]  # the same batch: the optimiser lowers its loss
    t = result.tensors
    assert t["down"].shape == (4, 2, loaded.spec.num_kv_heads, loaded.spec.head_dim, width // 4)
    assert t["bias"].shape == (4, 2, loaded.spec.num_kv_heads, loaded.spec.head_dim)
    assert not t["down"][[0, 2]].any() and not t["bias"][[0, 2]].any() and t["up"][1].any()


def test_the_oracle_reads_the_file_as_the_trainer_reconstructs(tiny: Path, tmp_path: Path) -> None:
    """The inputs' layout (`as_inputs`: a head's key rows, then its value rows) read by the hand-written
    DeltaKV reference (tests/references/deltakv.py) rebuild what the trainer's compressor rebuilds."""
    from safetensors.torch import save_file

    from tests.references.deltakv import Compressor

    loaded = load_model(tiny, "cpu", torch.float32)
    heads, dim = loaded.spec.num_kv_heads, loaded.spec.head_dim
    batches = [torch.randint(0, loaded.spec.vocab_size, (96,), generator=torch.Generator().manual_seed(7))]
    cfg = D.DeltaConfig(layers=[2], code=6, sink=2, recent=16, stride=4, neighbours=2, steps=0, bf16=False)
    tensors = D.calibrate(tiny, batches, cfg).tensors
    save_file(D.as_inputs(tensors), str(tmp_path / "c.safetensors"))
    oracle = Compressor.load(tmp_path / "c.safetensors")
    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(5, 2 * heads * dim, generator=g), torch.randn(5, 2 * heads * dim, generator=g)
    down, up = (tensors[n][2].reshape(2 * heads * dim, -1) for n in ("down", "up"))
    trainer = ref + ((x - ref) @ down) @ up.T + tensors["bias"][2].reshape(-1)
    torch.testing.assert_close(ref + oracle.up(2, oracle.down(2, x) - oracle.down(2, ref)), trainer, atol=1e-5,
                               rtol=1e-5)


def test_the_command_writes_the_methods_inputs(tiny: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command"))
    out = tmp_path / "deltakv.safetensors"
    calibration = tmp_path / "text.md"
    calibration.write_text(" ".join(f"word{i % 97} and more words {i}" for i in range(2000)))
    params = ["--method-param", "full_layers=[0, 2]", "--method-param", "sink=2", "--method-param", "recent=16",
              "--method-param", "stride=4"]
    a = parser.parse_args(["calibrate", "deltakv", "--model", str(tiny), "--out", str(out), "--steps", "2",
                           "--context", "128", "--samples", "2", "--calibration", str(calibration), "--float32",
                           *params])
    assert a.func(a) == 0
    spec = load_model(tiny, "cpu", torch.float32).spec
    heads, dim = spec.num_kv_heads, spec.head_dim
    code = heads * round(2 * dim * 0.25)
    with safe_open(str(out), "pt") as f:
        shapes = {n: tuple(f.get_tensor(n).shape) for n in f.keys()}
        meta = f.metadata()
        down = f.get_tensor("down")
    assert shapes == {"down": (4, heads, 2 * dim, code), "up": (4, heads, 2 * dim, code), "bias": (4, heads, 2 * dim)}
    assert json.loads(meta["layers"]) == [1, 3] and not down[[0, 2]].any() and down[1].any()
    assert set(json.loads(meta["cross_entropy"])) == {"full", "pca", "final"}


def test_too_little_text_is_a_clear_error(tiny: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command"))
    calibration = tmp_path / "short.md"
    calibration.write_text(" ".join(itertools.repeat("word", 100)))
    a = parser.parse_args(["calibrate", "deltakv", "--model", str(tiny), "--out", str(tmp_path / "x.safetensors"),
                           "--context", "128", "--samples", "1", "--calibration", str(calibration),
                           "--method-param", "recent=16"])
    with pytest.raises(ConfigError, match="held out"):
        a.func(a)
    a.method_param = None  # recent 128: a 128-token context has nothing to compress
    with pytest.raises(ConfigError, match="--context >= 264"):
        a.func(a)
