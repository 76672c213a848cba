"""`random:tiny`, the test model: deterministic bytes, loadable, with a working offline tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvc.runtime.models import random_tiny
from kvc.runtime.models.random_tiny import ensure_tiny_model, write_tiny_model
from kvc.runtime.models.loader import load_model
from tests.models.tiny import reference_attention

# sha256 over (file name, file bytes) in name order. If you change the tiny model on purpose,
# bump random_tiny.VERSION (so cached copies are regenerated) and update this digest.
EXPECTED_DIGEST = "2fb6ee05d936921cb3387a0e532bfebf18a1691f0f4ec976cfbdc214509cdc5e"

TEXTS = [
    "Hello, world! The cat is in the house.",
    "héllo 日本語 🎉\n\n\ttabs  and   spaces \r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "\x00\x7f bytes",
    "",
]


def digest(directory: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(directory.iterdir()):
        h.update(file.name.encode())
        h.update(file.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def test_generation_is_deterministic(tmp_path: Path, tiny_dir: Path) -> None:
    (tmp_path / "a").mkdir()
    write_tiny_model(tmp_path / "a")
    assert digest(tmp_path / "a") == digest(tiny_dir) == EXPECTED_DIGEST


def test_ensure_is_idempotent_and_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVC_CACHE_DIR", str(tmp_path))
    first = ensure_tiny_model()
    assert first == tmp_path / random_tiny.DIR_NAME
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    # no staging folder left; the lock file serialises builders
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{random_tiny.DIR_NAME}.lock", random_tiny.DIR_NAME]


def test_loads_and_runs(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir)
    spec = loaded.spec
    assert spec.architecture == "Qwen3ForCausalLM" and spec.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert spec.vocab_size == len(tokenizer)
    assert spec.eos_token_ids[0] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in spec.eos_token_ids
    ids = torch.tensor(tokenizer.encode("the cat"))
    with torch.no_grad():
        logits = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids)), reference_attention()))
    assert logits.shape == (len(ids), spec.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tiny_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer.encode(text)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_merges_and_chat_template(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer.encode(" the and of")) == 3  # the merges apply
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
