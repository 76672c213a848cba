"""The checkpoint loader: what it accepts (shards, dtypes, eos ids) and the errors it gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvc.runtime.errors import ModelLoadError, UnsupportedArchitectureError
from kvc.runtime.models.loader import load_model, resolve_model
from tests.models.tiny import load_hf, make_tiny_qwen3


@pytest.fixture()
def model_dir(tiny_qwen3_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the session's tiny Qwen3 checkpoint, free to break."""
    return Path(shutil.copytree(tiny_qwen3_dir, tmp_path / "model"))


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_loads_weights_exactly(tiny_qwen3_dir: Path) -> None:
    loaded = load_model(tiny_qwen3_dir)
    hf = load_hf(tiny_qwen3_dir).state_dict()
    kvc = loaded.model.state_dict()
    q, kv = 64, 32
    qkv = kvc["layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:q], hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[q + kv :], hf["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(kvc["layers.0.mlp.gate_up_proj.weight"][128:], hf["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(kvc["layers.0.self_attn.k_norm.weight"], hf["model.layers.0.self_attn.k_norm.weight"])
    assert loaded.path == tiny_qwen3_dir and loaded.hf_config.model_type == "qwen3"
    spec = loaded.spec
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        "Qwen3ForCausalLM", 2, 4, 2, 16,
    )  # fmt: skip
    assert (spec.hidden_size, spec.vocab_size, spec.dtype) == (64, 320, torch.float32)


def test_sharded_checkpoint_and_dtype(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = make_tiny_qwen3(tmp_path)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(single).model.state_dict()
    b = load_model(sharded, dtype=torch.bfloat16).model.state_dict()
    for name in a:
        assert b[name].dtype == torch.bfloat16
        assert torch.equal(a[name].to(torch.bfloat16), b[name]), name


def test_eos_ids_from_config_and_generation_config(model_dir: Path) -> None:
    edit_config(model_dir, eos_token_id=7)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    assert load_model(model_dir).spec.eos_token_ids == (7, 9)


def test_resolve_model_accepts_a_path(tiny_qwen3_dir: Path) -> None:
    assert resolve_model(str(tiny_qwen3_dir)).spec.architecture == "Qwen3ForCausalLM"


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "file")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ModelLoadError, match="config.json: cannot read"):
        load_model(tmp_path)


def test_invalid_json_config_names_line_and_column(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{\n  "hidden_size": 64,\n  oops\n}')
    with pytest.raises(ModelLoadError, match=r"config.json:3:3: invalid JSON"):
        load_model(model_dir)


def test_config_not_an_object(model_dir: Path) -> None:
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object, got list"):
        load_model(model_dir)


def test_config_transformers_rejects(model_dir: Path) -> None:
    edit_config(model_dir, num_hidden_layers="two")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(model_dir)


def test_unsupported_architecture_lists_supported(model_dir: Path) -> None:
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(model_dir)
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert name in str(err.value)


def test_unsupported_rope_type(model_dir: Path) -> None:
    edit_config(model_dir, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    with pytest.raises(UnsupportedArchitectureError, match="rope type 'linear'"):
        load_model(model_dir)


def test_quantized_checkpoint_of_another_format_is_refused(model_dir: Path) -> None:
    """FP8 without a block size, and other methods: only the published block-wise FP8 format loads
    (tests/models/test_fp8_weights.py)."""
    for quantization in ({"quant_method": "fp8"}, {"quant_method": "gptq", "bits": 4}):
        edit_config(model_dir, quantization_config=quantization)
        with pytest.raises(UnsupportedArchitectureError, match="block-wise FP8 format only"):
            load_model(model_dir)


def test_no_safetensors(model_dir: Path) -> None:
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no safetensors weights found \(found PyTorch"):
        load_model(model_dir)


def test_missing_tensor_is_named(model_dir: Path) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensors.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(model_dir)


def test_shape_mismatch_names_tensor_and_shapes(model_dir: Path) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(tensors, model_dir / "model.safetensors")
    expected = r"model\.layers\.0\.mlp\.down_proj\.weight has shape \[64, 100\].*\[64, 128\]"
    with pytest.raises(ModelLoadError, match=expected):
        load_model(model_dir)


def test_corrupt_safetensors(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read safetensors file"):
        load_model(model_dir)


def test_index_naming_missing_shard(model_dir: Path) -> None:
    names = list(load_file(model_dir / "model.safetensors"))
    index = {"weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(model_dir)


def test_invalid_index(model_dir: Path) -> None:
    (model_dir / "model.safetensors.index.json").write_text('{"no_weight_map": 1}')
    with pytest.raises(ModelLoadError, match="not a valid safetensors index"):
        load_model(model_dir)


def test_tiny_checkpoint_with_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = make_tiny_qwen3(tmp_path, tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = load_model(path).spec
    assert spec.eos_token_ids[0] == tokenizer.eos_token_id
    assert max(tokenizer.encode("héllo <|im_end|>")) < spec.vocab_size
