"""DeltaKV's arithmetic in kvc (runtime/kv/delta.py, what a `delta` store and its readers will run)
against the hand-written oracle (tests/references/deltakv.py), on a tiny random Llama after a prefill:
the same compressed block, the same neighbours, codes equal to the oracle's in the spec's per-head
layout (each KV head its share of the token's code), and the same reconstructed keys and values."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvc.runtime.kv import delta
from tests.references import deltakv as oracle
from tests.references.test_deltakv import dense_x

LAYERS, KV_HEADS, HEAD_DIM, CODE = 3, 2, 16, 12
PARAMS = oracle.Params(sink=2, recent=4, stride=3, neighbours=2, selected=1000, full_layers=(1,))


def random_compressor(seed: int) -> dict[str, torch.Tensor]:
    """The spec's layout: down, up [layers, Hkv, 2 D, C] (a head's key rows, then its value rows), bias
    [layers, Hkv, 2 D]."""
    g = torch.Generator().manual_seed(seed)
    return {"down": torch.randn(LAYERS, KV_HEADS, 2 * HEAD_DIM, CODE, generator=g) / 8,
            "up": torch.randn(LAYERS, KV_HEADS, 2 * HEAD_DIM, CODE, generator=g) / 8,
            "bias": torch.randn(LAYERS, KV_HEADS, 2 * HEAD_DIM, generator=g) / 8}


def test_codes_neighbours_and_rows_equal_the_oracles(tmp_path) -> None:
    from safetensors.torch import save_file

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    tensors = random_compressor(1)
    save_file(tensors, str(tmp_path / "c.safetensors"))
    compressor = oracle.Compressor.load(tmp_path / "c.safetensors")
    ids = torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    state = oracle.session(model, PARAMS, compressor)
    oracle.generate(model, ids, PARAMS, compressor, 1, state=state)  # the prefill and one step
    for layer in (0, 2):
        # the layer's raw vectors [n, Hkv, 2 D] before compression: the oracle's kept rows, and the
        # dropped ones from a plain forward (its prefill attends to raw K/V)
        keys, values = state.keys[layer], state.values[layer]  # [Hkv, n, D]
        n = keys.shape[1]
        x = torch.cat([keys, values], dim=-1).transpose(0, 1).clone()  # [n, Hkv, 2 D]
        k_plain, v_plain = oracle.split(dense_x(model, ids)[layer], KV_HEADS)  # a plain forward's
        plain = torch.cat([k_plain, v_plain], dim=-1)  # [n, Hkv, 2 D]
        dropped = torch.isnan(x).any(-1).any(-1)
        assert n == len(ids) and dropped.any()
        torch.testing.assert_close(x[~dropped], plain[~dropped], atol=1e-5, rtol=1e-5)  # a raw prefill
        x[dropped] = plain[dropped]
        start, end = delta.block_of(len(ids), 0, PARAMS.sink, PARAMS.recent)
        assert (start, end) == (2, 2 + state.compressed[layer]) and end > start
        flat = x.reshape(n, -1)
        centers = delta.center_positions(end, PARAMS.sink, PARAMS.stride)
        rows = torch.arange(start, end)
        ref, near = delta.references(flat[rows], rows, flat[centers], centers, PARAMS.neighbours)
        assert torch.equal(near, state.neighbours[layer][: len(rows)])
        ref = ref.reshape(-1, KV_HEADS, 2 * HEAD_DIM)
        code = delta.encode(x[rows], ref, tensors["down"][layer])
        assert code.shape == (len(rows), KV_HEADS, CODE // KV_HEADS)
        torch.testing.assert_close(code.reshape(len(rows), -1), state.codes[layer][: len(rows)], atol=1e-4,
                                   rtol=1e-4)
        rebuilt = delta.decode(code, ref, tensors["up"][layer], tensors["bias"][layer])
        k_read, v_read = state.read(layer)  # the oracle's reads: rebuilt non-centers, raw centers
        theirs = torch.cat([k_read, v_read], dim=-1).transpose(0, 1)[rows]
        kept = ~delta.is_center(rows, PARAMS.sink, PARAMS.stride)
        torch.testing.assert_close(rebuilt[kept], theirs[kept], atol=1e-4, rtol=1e-4)
        assert (rebuilt[kept] - x[rows][kept]).abs().max() > 1e-2  # lossy: a raw read would not pass

