"""KVzip (context reconstruction, methods/kvzip.kvm) served end to end against NVIDIA kvpress's KVzipPress.

After its prefill each prompt is re-read through the model behind the repeat prompt, chunk by chunk
(runtime/context_replay.py); every layer's replayed attention scores the stored tokens and one ranking
across all layers and KV heads keeps `ratio` of them (runtime/compiled/replay.py). Tiny random Llama
and Qwen3 (float32 CPU) with kvc's byte tokenizer, with and without a chat template (kvpress frames
the replay by it), contexts of one and of several chunks: the kept (layer, KV head, token) triples
equal kvpress's, the greedy tokens equal the reference model's over exactly those tokens, and the
pages come back. Prompts served together give what each gives alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvc.runtime.context_replay import frame
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references import model_forward as mf

kvpress = pytest.importorskip("kvpress")

CASES = [  # (model, chat template, prompt length, chunk)
    ("llama", False, 57, 2048),
    ("llama", False, 90, 32),  # three chunks: the later chunks' prompt quotes the previous chunk's end
    ("qwen3", False, 64, 2048),
    ("qwen3", True, 75, 30),  # a chat prompt: reconstructed from after the template's user prefix
]
PARAMS = {"ratio": 0.4, "sink": 4}


def _model_dir(root: Path, model: str, template: bool) -> Path:
    make = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[model]
    path = make(root, tokenizer=True)
    if not template:
        config = path / "tokenizer_config.json"
        data = json.loads(config.read_text())
        data.pop("chat_template", None)
        config.write_text(json.dumps(data))
        (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def _kvpress_kept(hf, prompt: list[int], ratio: float, chunk: int, sink: int,
                  press_class=None) -> set[tuple[int, int, int]]:
    press = (press_class or kvpress.KVzipPress)(compression_ratio=1 - ratio, chunk_size=chunk, n_sink=sink)
    from transformers import DynamicCache

    with torch.no_grad(), press(hf):
        hf.model(input_ids=torch.tensor([prompt]), past_key_values=DynamicCache())
    kept = set()
    for layer, module in enumerate(layer.self_attn for layer in hf.model.layers):
        _, heads, tokens = module.masked_key_indices
        pruned = set(zip(heads.tolist(), tokens.tolist()))
        kept |= {(layer, h, t) for h in range(hf.config.num_key_value_heads) for t in range(len(prompt))
                 if (h, t) not in pruned}
        module.masked_key_indices = None
    return kept


def _greedy_over(hf, prompt: list[int], kept: set[tuple[int, int, int]], steps: int) -> list[int]:
    """Greedy tokens of the reference model over a cache holding only `kept` (first token: full attention)."""
    layers, logits = mf.prefill(hf, torch.tensor(prompt))
    caches = []
    for layer, t in enumerate(layers):
        heads = [torch.tensor(sorted(i for (at, head, i) in kept if at == layer and head == h))
                 for h in range(t.k.shape[0])]
        caches.append(mf.HeadCache([t.k[h, idx] for h, idx in enumerate(heads)],
                                   [t.v[h, idx] for h, idx in enumerate(heads)]))
    tokens = [int(logits[-1].argmax())]
    for step in range(1, steps):
        tokens.append(int(mf.decode(hf, caches, torch.tensor([tokens[-1]]), len(prompt) + step - 1)[-1].argmax()))
    return tokens


@pytest.mark.parametrize("model,template,length,chunk", CASES)
def test_kvzip_keeps_what_kvpress_keeps(tmp_path, model, template, length, chunk):
    path = _model_dir(tmp_path, model, template)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(3, 250, (length,), generator=g).tolist()
    params = {**PARAMS, "chunk": chunk}
    if template:  # kvpress reconstructs a chat-formatted context from after the user turn's opening
        prefix, _ = frame(AutoTokenizer.from_pretrained(path))
        assert prefix
        prompt = prefix + prompt[len(prefix):]
    llm = LLM(str(path), method="kvzip", method_params=params, device="cpu", dtype="float32", page_size=8,
              attention_backend="torch", max_prefill_chunk=32)
    engine = llm.engine
    plans = []
    replay_end = engine.method.replay_end
    engine.method.replay_end = lambda *a: plans.append(replay_end(*a)) or plans[-1]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    kept = {(layer, h, int(t)) for layer, plan in enumerate(plans[0]) for h in range(plan.indices.shape[0])
            for t in plan.indices[h, : (plan.indices.shape[1] if plan.lengths is None else int(plan.lengths[h]))]}
    want = _kvpress_kept(hf, prompt, params["ratio"], chunk, params["sink"])
    assert len(kept) == len(want)
    assert kept == want
    assert out.token_ids == _greedy_over(hf, prompt, want, 4)  # decoding over exactly those tokens
    assert engine.pool.num_free == engine.pool.num_pages  # the replay's lent pages and the request's came back
    assert not engine.method.replayer.state


def test_kvzip_batched_equals_alone(tmp_path):
    """Three prompts prefilled and replayed in the same steps (chunked prefill beside decodes) give the
    tokens each gives alone; admission counts the replay's pages (the pool ends whole)."""
    path = _model_dir(tmp_path, "llama", False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (41, 90, 66)]
    params = {**PARAMS, "chunk": 24}

    def serve(batch):
        llm = LLM(str(path), method="kvzip", method_params=params, device="cpu", dtype="float32", page_size=8,
                  attention_backend="torch", max_prefill_chunk=32, max_num_batched_tokens=64)
        outs = llm.generate(batch, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert llm.engine.pool.num_free == llm.engine.pool.num_pages
        # the prefill peak counts the longest replayed chunk: prompt + repeat prompt + opening + chunk
        replay = llm.engine.runner.replay
        assert llm.engine.method.budget.peak_tokens(90, 0) == 90 + replay.longest
        return [o.token_ids for o in outs]

    assert serve(prompts) == [serve([p])[0] for p in prompts]


def test_kvzip_refuses_what_it_cannot_serve(tmp_path):
    from kvc.runtime.chains import ChainSpec
    from kvc.runtime.errors import ConfigError

    path = _model_dir(tmp_path, "llama", False)
    llm = LLM(str(path), method="kvzip", method_params={**PARAMS, "chunk": 24}, device="cpu", dtype="float32",
              page_size=8, attention_backend="torch")
    first = llm.generate([list(range(5, 45))], SamplingParams(max_tokens=3, temperature=0),
                         chain=ChainSpec(open=True))[0]
    with pytest.raises(ConfigError, match="re-reads the whole stored prompt"):
        llm.generate([list(range(5, 45)) + first.token_ids + [7, 8]], SamplingParams(max_tokens=3),
                     chain=ChainSpec(continue_id=first.chain_id))
    bare = make_tiny_llama(tmp_path / "bare")  # no tokenizer: the repeat prompt cannot be encoded
    with pytest.raises(ConfigError, match="no tokenizer"):
        LLM(str(bare), method="kvzip", device="cpu", dtype="float32", attention_backend="torch")


def test_kvzip_behind_the_http_api():
    """`kvc serve --method kvzip`: a chat request is prefilled, replayed and compressed, and answered; two
    requests at once give the offline API's tokens (the random tiny model with its byte tokenizer)."""
    import httpx

    from tests.server.conftest import live_server

    options = {"method": "kvzip", "method_params": {"ratio": 0.5, "chunk": 64}}
    messages = [[{"role": "user", "content": f"Tell me about item {i}: " + "one two three four five " * 12}]
                for i in range(2)]
    replays = []

    def spy(engine):  # count the replay passes that end in a keep
        end = engine.method.replay_end
        engine.method.replay_end = lambda *a: replays.append(a[0]) or end(*a)

    with live_server(engine_options=options, prepare=spy) as s:
        def ask(m):
            body = {"model": "kvc-test", "messages": m, "max_tokens": 5, "temperature": 0}
            return httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)

        answers = [ask(m) for m in messages]
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert all(r.json()["usage"]["completion_tokens"] == 5 for r in answers)
        texts = [r.json()["choices"][0]["message"]["content"] for r in answers]
    assert len(replays) == 2
    offline = LLM("random:tiny", method="kvzip", method_params=options["method_params"], max_model_len=512)
    tok = offline.tokenizer
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    outs = offline.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert texts == [o.text for o in outs]


def test_a_raw_prompt_is_reconstructed_from_its_start(tmp_path):
    """A prompt that does not open with the chat template's user prefix (the eval's tasks) is reconstructed
    from token 0. kvpress's KVzipPress skips the prefix's length of any prompt (it assumes a templated one),
    so it keeps other triples; the eval's reference (`FramedKVzipPress`, runtime/eval/kvpress_reference.py)
    frames as kvc does and keeps kvc's."""
    from kvc.runtime.eval.kvpress_reference import _press_classes

    path = _model_dir(tmp_path, "qwen3", True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompt = torch.randint(3, 250, (60,), generator=torch.Generator().manual_seed(8)).tolist()
    prefix, _ = frame(AutoTokenizer.from_pretrained(path))
    assert prefix and prompt[:len(prefix)] != prefix
    llm = LLM(str(path), method="kvzip", method_params=PARAMS, device="cpu", dtype="float32", page_size=8,
              attention_backend="torch")
    plans = []
    replay_end = llm.engine.method.replay_end
    llm.engine.method.replay_end = lambda *a: plans.append(replay_end(*a)) or plans[-1]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    kept = {(layer, h, int(t)) for layer, plan in enumerate(plans[0]) for h in range(plan.indices.shape[0])
            for t in plan.indices[h, : (plan.indices.shape[1] if plan.lengths is None else int(plan.lengths[h]))]}
    framed = _kvpress_kept(hf, prompt, PARAMS["ratio"], 2048, PARAMS["sink"], _press_classes()["FramedKVzipPress"])
    assert kept == framed
    assert kept != _kvpress_kept(hf, prompt, PARAMS["ratio"], 2048, PARAMS["sink"])  # kvpress's own framing
