"""The embedded default model: deterministic bytes, loadable, with a working offline tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvc.runtime import default_model
from kvc.runtime.default_model import ensure_default_model, write_default_model
from kvc.runtime.models.loader import load_model
from tests.models.tiny import reference_attention

# sha256 over (file name, file bytes) in name order. If you change the default model on purpose,
# bump default_model.VERSION (so cached copies are regenerated) and update this digest.
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
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def test_generation_is_deterministic(tmp_path: Path, default_dir: Path) -> None:
    (tmp_path / "a").mkdir()
    write_default_model(tmp_path / "a")
    assert digest(tmp_path / "a") == digest(default_dir) == EXPECTED_DIGEST


def test_ensure_is_idempotent_and_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVC_CACHE_DIR", str(tmp_path))
    first = ensure_default_model()
    assert first == tmp_path / default_model.DIR_NAME
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [default_model.DIR_NAME]  # no staging left


def test_loads_and_runs(default_dir: Path) -> None:
    loaded = load_model(default_dir)
    spec = loaded.spec
    assert spec.architecture == "Qwen3ForCausalLM" and spec.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    assert spec.vocab_size == len(tokenizer)
    assert spec.eos_token_ids[0] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in spec.eos_token_ids
    ids = torch.tensor(tokenizer.encode("the cat"))
    with torch.no_grad():
        logits = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids)), reference_attention()))
    assert logits.shape == (len(ids), spec.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(default_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    ids = tokenizer.encode(text)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_merges_and_chat_template(default_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    assert len(tokenizer.encode(" the and of")) == 3  # the merges apply
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
