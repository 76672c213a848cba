"""The DeltaKV reference (tests/references/deltakv.py) against its definition, on a tiny random Llama:
lossless with the identity compressor, its compression schedule, its neighbours against a brute-force
search, its reconstruction against the formula, and what its sparse layers read."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.references import deltakv

LAYERS, KV_HEADS, HEAD_DIM = 5, 2, 16
FULL = (1, 3)  # layer 0 compresses and reads all; 2 reads layer 1's choice, 4 reads layer 3's
PARAMS = deltakv.Params(sink=2, recent=4, stride=2, neighbours=2, selected=1000, full_layers=FULL)
PROMPT, NEW = 40, 12


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
                         attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


def prompt_ids(seed: int = 0) -> list[int]:
    return torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(model: PreTrainedModel, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def dense_x(model: PreTrainedModel, ids: list[int]) -> list[torch.Tensor]:
    """Per layer [n, 2 Hkv D]: [k_proj | v_proj] of a plain forward (a Llama has no k-norm, so k_proj's
    output is the key before RoPE)."""
    got: dict[tuple[int, str], torch.Tensor] = {}
    hooks = [getattr(layer.self_attn, f"{w}_proj").register_forward_hook(
        lambda mod, args, out, i=i, w=w: got.__setitem__((i, w), out[0].detach().float()))
        for i, layer in enumerate(model.model.layers) for w in "kv"]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return [torch.cat([got[i, "k"], got[i, "v"]], dim=1) for i in range(len(model.model.layers))]


def dense_qk(model: PreTrainedModel, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's queries [Hq, n, D] and keys [Hkv, n, D] after RoPE in a plain forward."""
    got: dict[str, torch.Tensor] = {}
    attn = model.model.layers[layer].self_attn
    hooks = [getattr(attn, f"{w}_proj").register_forward_hook(
        lambda mod, args, out, w=w: got.__setitem__(w, out[0].detach().float())) for w in "qk"]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    n = len(ids)
    q, k = (got[w].reshape(n, -1, HEAD_DIM).transpose(0, 1)[None] for w in "qk")
    cos, sin = model.model.rotary_emb(q, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0], k[0]


def is_center(p: int) -> bool:
    return p < PARAMS.sink or (p - PARAMS.sink) % PARAMS.stride == 0


def brute_neighbours(x: torch.Tensor, block_start: int, t: int, count: int) -> list[int]:
    """The definition's candidates and nearest centers, one token at a time."""
    candidates = [c for c in range(t + 1) if is_center(c) and (c < block_start or c <= t)]
    dist = {c: float((x[t].double() - x[c].double()).square().sum()) for c in candidates}
    return sorted(candidates, key=lambda c: (dist[c], c))[:count]


def random_tensors(c: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, KV_HEADS, HEAD_DIM)
    out = {name: torch.randn(*shape, c, generator=g) * 0.2 for name in ("k_down", "v_down", "k_up", "v_up")}
    out |= {name: torch.randn(*shape, generator=g) * 0.1 for name in ("k_bias", "v_bias")}
    return out


def run(model: PreTrainedModel, compressor: deltakv.Compressor, params: deltakv.Params = PARAMS, steps: int = NEW,
        chunk: int | None = None, seed: int = 0) -> tuple[list[int], deltakv.Session]:
    s = deltakv.session(model, params, compressor)
    return deltakv.generate(model, prompt_ids(seed), params, compressor, steps, chunk=chunk, state=s), s


def identity() -> deltakv.Compressor:
    return deltakv.identity_compressor(LAYERS, KV_HEADS, HEAD_DIM)


def test_identity_compressor_round_trips() -> None:
    c, g = identity(), torch.Generator().manual_seed(1)
    x, ref = torch.randn(5, 2 * KV_HEADS * HEAD_DIM, generator=g), torch.randn(5, 2 * KV_HEADS * HEAD_DIM, generator=g)
    assert c.k_down.shape[-1] == 2 * KV_HEADS * HEAD_DIM
    torch.testing.assert_close(ref + c.up(2, c.down(2, x) - c.down(2, ref)), x)


@pytest.mark.parametrize("chunk", [None, 16])
def test_identity_compressor_decodes_like_the_model(llama: PreTrainedModel, chunk: int | None) -> None:
    tokens, s = run(llama, identity(), chunk=chunk)
    assert tokens == greedy(llama, prompt_ids(), NEW)
    assert all(s.compressed[layer] >= 32 for layer in (0, 2, 4))  # really compressed
    assert s.compressed[1] == s.compressed[3] == 0  # full layers keep everything raw


def test_lossy_compressor_changes_the_output(llama: PreTrainedModel) -> None:
    # The oracle's compression can fail the identity test: a lossy compressor moves the logits.
    tensors = random_tensors()
    tensors["k_bias"] = tensors["k_bias"] * 50
    tokens, _ = run(llama, deltakv.Compressor.from_tensors(tensors))
    assert tokens != greedy(llama, prompt_ids(), NEW)


def test_compression_schedule(llama: PreTrainedModel) -> None:
    _, s = run(llama, identity(), chunk=7)
    assert len(s.schedule) == -(-PROMPT // 7) + NEW - 1  # prefill chunks, then the decode steps
    p = PARAMS
    for length, compressed in s.schedule:
        for layer, count in enumerate(compressed):
            if layer in FULL:
                assert count == 0
                continue
            buffer = length - p.sink - count
            assert count % p.recent == 0 and buffer < 2 * p.recent
            if length >= p.sink + 2 * p.recent:
                assert p.recent <= buffer
            else:
                assert count == 0
    assert len({tuple(c) for _, c in s.schedule}) > 3  # it compressed several times


def test_neighbours_are_causal_centers_and_nearest(llama: PreTrainedModel) -> None:
    _, s = run(llama, identity())
    for layer in (0, 2, 4):
        nb = s.neighbours[layer]
        positions = torch.arange(PARAMS.sink, PARAMS.sink + s.compressed[layer])
        assert nb.shape == (len(positions), PARAMS.neighbours) and (nb >= 0).all()
        assert (nb <= positions[:, None]).all()
        assert all(is_center(int(c)) for c in nb.flatten())
    # The prefill's block is computed from the dense prefill's x: search it by brute force.
    x = dense_x(llama, prompt_ids())
    first = s.schedule[0][1]
    for layer in (0, 2, 4):
        want = [brute_neighbours(x[layer], PARAMS.sink, t, PARAMS.neighbours)
                for t in range(PARAMS.sink, PARAMS.sink + first[layer])]
        assert s.neighbours[layer][:first[layer]].tolist() == want


def test_lossy_reconstruction_is_ref_plus_up_of_code_delta(llama: PreTrainedModel) -> None:
    tensors = random_tensors()
    _, s = run(llama, deltakv.Compressor.from_tensors(tensors), steps=1)  # prefill only
    x = dense_x(llama, prompt_ids())
    layer = 2
    keys, values = s.read(layer)
    got = torch.cat([keys.transpose(0, 1).reshape(PROMPT, -1), values.transpose(0, 1).reshape(PROMPT, -1)], dim=1)
    kd, vd, ku, vu = (tensors[n][layer].double() for n in ("k_down", "v_down", "k_up", "v_up"))
    kb, vb = tensors["k_bias"][layer].double(), tensors["v_bias"][layer].double()
    width = KV_HEADS * HEAD_DIM
    compressed = 0
    for t in range(PROMPT):
        xt = x[layer][t].double()
        if not (PARAMS.sink <= t < PARAMS.sink + s.compressed[layer]) or is_center(t):
            torch.testing.assert_close(got[t].double(), xt, atol=1e-5, rtol=1e-5)
            continue
        nb = brute_neighbours(x[layer], PARAMS.sink, t, PARAMS.neighbours)
        ref = torch.stack([x[layer][c].double() for c in nb]).mean(0)

        def down(y: torch.Tensor) -> torch.Tensor:
            k, v = y[:width].reshape(KV_HEADS, HEAD_DIM), y[width:].reshape(KV_HEADS, HEAD_DIM)
            return sum(k[h] @ kd[h] + v[h] @ vd[h] for h in range(KV_HEADS))

        code = down(xt) - down(ref)
        up = torch.cat([torch.cat([ku[h] @ code + kb[h] for h in range(KV_HEADS)]),
                        torch.cat([vu[h] @ code + vb[h] for h in range(KV_HEADS)])])
        want = ref + up
        torch.testing.assert_close(got[t].double(), want, atol=1e-5, rtol=1e-5)
        assert (want - xt).abs().max() > 1e-2  # lossy: the test would see a raw read
        compressed += 1
    assert compressed >= 16
    assert torch.isnan(s.keys[layer][:, PARAMS.sink + 1]).all()  # a non-center's raw row is gone


def test_sparse_layers_read_sinks_chosen_and_buffer(llama: PreTrainedModel) -> None:
    params = deltakv.Params(sink=2, recent=4, stride=2, neighbours=2, selected=4, full_layers=FULL)
    tokens, s = run(llama, identity(), params=params)
    assert len(s.reads) == NEW - 1
    assert any(not torch.equal(s.choices[i][1], s.choices[i + 1][1]) for i in range(0, len(s.choices), 2))
    for step, reads in enumerate(s.reads):
        length, compressed = s.schedule[step][0] + 1, s.schedule[step][1]  # the state the step found
        choice = dict(s.choices[2 * step:2 * step + 2])
        assert sorted(choice) == list(FULL) and all(len(c) == params.selected for c in choice.values())
        for layer in (0, 1, 3):
            assert reads[layer].tolist() == list(range(length))
        for layer, chooser in ((2, 1), (4, 3)):
            want = set(range(params.sink)) | set(choice[chooser].tolist())
            want |= set(range(params.sink + compressed[layer], length))
            assert reads[layer].tolist() == sorted(want) and len(want) < length
        # Layer 1 sees what a dense forward sees (layer 0 reads everything, the identity is lossless).
        q, k = dense_qk(llama, prompt_ids() + tokens[:step + 1], 1)
        scores = torch.einsum("hd,htd->ht", q[:, -1], k.repeat_interleave(q.shape[0] // KV_HEADS, 0)).amax(0)
        assert choice[1].tolist() == sorted(scores.topk(params.selected).indices.tolist())
