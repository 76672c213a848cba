"""GGUF checkpoints (`--model gguf:PATH`, or any path ending in `.gguf`): converted once into a
Hugging Face directory in kvc's model cache (model_cache.py), then loaded like any other directory.

The conversion dequantizes every tensor to float32 (transformers' GGUF reader, which also undoes
llama.cpp's Q/K row permutation) and writes config.json, generation_config.json,
model.safetensors, the tokenizer and its chat template into
`<cache>/models/<stem>-<sha256 prefix of the file>-<CONVERSION_VERSION>/`. The folder name changes
with the file's bytes and with this converter's version, so a cached copy is never stale.

The tokenizer is transformers' GGUF conversion with what the GGUF itself says put back (transformers
5.2 gets these wrong for byte-level vocabularies such as SmolLM2's): the special tokens come from
the file's token ids (transformers names the BOS as EOS), a BOS is prepended only when
`tokenizer.ggml.add_bos_token` says so, tokens past the vocabulary (CodeLlama's infill tokens that
the converter adds) are dropped, a byte-level vocabulary decodes byte-level, and the pre-tokenizer
follows `tokenizer.ggml.pre` where llama.cpp's rule for it is known. docs/design.md, "Models".
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from kvc.runtime.errors import ModelLoadError, UnsupportedArchitectureError
from kvc.runtime.models.model_cache import build_once, cache_root

log = logging.getLogger(__name__)

GGUF_PREFIX = "gguf:"
CONVERSION_VERSION = "v1"  # bump when the converted files change; old folders are then ignored
# GGUF model_type (as transformers names it) -> the Hugging Face architecture kvc serves it as.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# llama.cpp's pre-tokenizers that split digits one by one before the GPT-2 regex.
_DIGIT_SPLITTING = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_REGEX = {"gpt2", "mpt", "olmo", "jais"}
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
_CONTROL = 3  # llama.cpp's token type of special (control) tokens


def is_gguf(ref: str) -> bool:
    return ref.startswith(GGUF_PREFIX) or ref.lower().endswith(".gguf")


def gguf_file(ref: str) -> Path:
    """The checked file of a `gguf:PATH` / `*.gguf` reference."""
    path = Path(ref[len(GGUF_PREFIX):] if ref.startswith(GGUF_PREFIX) else ref).expanduser()
    if not path.exists():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{path} is not a file; gguf:PATH takes the .gguf file itself")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    return path


def converted_dir(path: Path, cache_dir: str | Path | None = None) -> Path:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return cache_root(cache_dir) / "models" / f"{path.stem}-{h.hexdigest()[:16]}-{CONVERSION_VERSION}"


def ensure_converted(ref: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The converted directory of a GGUF file, converting it on first use."""
    path = gguf_file(str(ref))
    target = converted_dir(path, cache_dir)
    if not target.is_dir():
        log.warning("converting %s once into %s (float32 safetensors + tokenizer)", path.name, target)
    return build_once(target, lambda staging: convert(path, staging))


def convert(path: Path, out: Path) -> None:
    """Write the Hugging Face directory of GGUF file `path` into the existing directory `out`."""
    _need_gguf_package()
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    steps = tqdm(total=4, desc=f"kvc: converting {path.name}", unit="step")
    try:
        steps.set_postfix_str("metadata")
        meta = _read(load_gguf_checkpoint, path)
        fields = _extra_fields(path)
        config = hf_config({**fields.get("config", {}), **meta["config"]}, path)
        steps.update()
        steps.set_postfix_str("tensors")
        tensors = _tensors(load_gguf_checkpoint, path, config)
        steps.update()
        steps.set_postfix_str("weights")
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(out)
        _write_json(out / "generation_config.json", generation_config(meta["config"]))
        steps.update()
        steps.set_postfix_str("tokenizer")
        tokenizer(meta, fields, config.max_position_embeddings, path.name).save_pretrained(out)
        _write_json(out / "kvc_conversion.json", {"source": str(path), "source_name": path.name,
                                                  "converter": CONVERSION_VERSION, "dtype": "float32"})
        steps.update()
    finally:
        steps.close()


def hf_config(fields: dict[str, Any], path: Path) -> Any:
    """The transformers config of a GGUF's metadata, for an architecture kvc serves."""
    from transformers import AutoConfig

    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {model_type!r} is not supported; kvc converts "
            f"{', '.join(sorted(ARCHITECTURES))} GGUF files"
        )
    fields.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [ARCHITECTURES[model_type]]
    config.dtype = "float32"
    return config


def generation_config(fields: dict[str, Any]) -> dict[str, Any]:
    out = {key: fields[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if fields.get(key) is not None}
    if "eos_token_id" in out:
        out["eos_token_id"] = [out["eos_token_id"]]
    return out


def tokenizer(meta: dict[str, Any], extra: dict[str, Any], max_length: int, name: str) -> Any:
    """The model's tokenizer (transformers' GGUF conversion, with the GGUF's own facts restored)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    try:  # transformers >= 5.2x moved it
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import convert_gguf_tokenizer

    vocab = meta["tokenizer"]
    fields = extra.get("tokenizer", {})
    backend, _ = convert_gguf_tokenizer(meta["config"]["model_type"], vocab)
    data = json.loads(backend.to_str())
    tokens = vocab["tokens"]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < len(tokens)]
    byte_level = vocab.get("tokenizer_type") == "gpt2"
    if byte_level:
        data["decoder"] = dict(_BYTE_LEVEL)
        pre = fields.get("pre")
        if pre in _DIGIT_SPLITTING:
            data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": True}, dict(_BYTE_LEVEL)]}
        elif pre in _GPT2_REGEX:
            data["pre_tokenizer"] = dict(_BYTE_LEVEL)
        else:
            log.info("%s: pre-tokenizer %r kept as transformers converts it", name, pre)

    def special(key: str) -> str | None:
        index = vocab.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = special("bos_token_id")
    add_bos = bool(fields.get("add_bos_token", False)) and bos is not None
    if add_bos:
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}},
        }
    else:
        data["post_processor"] = dict(_BYTE_LEVEL) if byte_level else None
    extra = {}
    template = meta.get("tokenizer_config", {}).get("chat_template")
    if template:
        extra["chat_template"] = template
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        bos_token=bos,
        eos_token=special("eos_token_id"),
        unk_token=special("unk_token_id"),
        pad_token=special("pad_token_id"),
        model_max_length=max_length,
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
        **extra,
    )


def _extra_fields(path: Path) -> dict[str, dict[str, Any]]:
    """What transformers' GGUF reader leaves out: the tokenizer's `pre` and `add_bos_token`, the head
    dimension (`attention.key_length`; without it Qwen3 would take its config class's 128) and the
    experts' width (`expert_feed_forward_length`; Qwen3-MoE would take 768)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else ""
    wanted = {("tokenizer", "pre"): "tokenizer.ggml.pre",
              ("tokenizer", "add_bos_token"): "tokenizer.ggml.add_bos_token",
              ("config", "head_dim"): f"{arch}.attention.key_length",
              ("config", "moe_intermediate_size"): f"{arch}.expert_feed_forward_length"}
    out: dict[str, dict[str, Any]] = {"tokenizer": {}, "config": {}}
    for (group, name), key in wanted.items():
        if key in fields:
            out[group][name] = fields[key].contents()
    return out


def _read(load_gguf_checkpoint, path: Path) -> dict[str, Any]:
    try:
        return load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as err:  # transformers' "architecture ... is not supported yet"
        raise UnsupportedArchitectureError(f"{path}: {err}") from None


def _tensors(load_gguf_checkpoint, path: Path, config: Any) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # only for transformers' GGUF -> Hugging Face tensor name map
        names = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names)["tensors"]
    return {name: t.to(torch.float32) for name, t in tensors.items()}


def _need_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("reading GGUF files needs the gguf package: pip install gguf") from None


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
