"""A small byte-level BPE tokenizer, written as Hugging Face tokenizer files without any download.

Used by the embedded default model (runtime/default_model.py) and by tests that need a tokenizer
for a tiny checkpoint. Ids 0-255 are the 256 bytes (in GPT-2's byte-to-printable-character
spelling, so every UTF-8 string round-trips), then a fixed list of merges of frequent English
pairs, then the ChatML special tokens. The files are plain JSON built here (sorted keys), so their
bytes do not depend on the installed `tokenizers` version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# (left, right) in byte-level spelling: "Ġ" is a space, "Ċ" a newline. Each side must already be
# a token when the merge is listed; earlier merges apply first.
MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("r", "e"),
    ("Ġ", "a"), ("Ġt", "he"), ("e", "n"), ("a", "t"), ("o", "u"), ("i", "s"), ("Ġ", "s"),
    ("Ġ", "w"), ("Ġ", "o"), ("Ġ", "c"), ("n", "d"), ("Ġ", "b"), ("Ġ", "f"), ("i", "t"),
    ("Ġ", "i"), ("e", "s"), ("o", "r"), ("in", "g"), ("Ġ", "p"), ("Ġ", "m"), ("e", "d"),
    ("a", "l"), ("Ġ", "d"), ("a", "r"), ("Ġ", "an"), ("Ġan", "d"), ("Ġo", "f"), ("Ġt", "o"),
    ("Ġ", "h"), ("l", "l"), ("Ġ", "in"), ("Ġ", "Ġ"), ("Ċ", "Ċ"), ("Ġ", "is"), ("Ġ", "I"),
)  # fmt: skip

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_symbols() -> list[str]:
    """The printable character standing for each byte 0..255 (GPT-2's byte-level alphabet):
    printable Latin-1 bytes stand for themselves, the rest take code points 256, 257, ..."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def vocabulary() -> dict[str, int]:
    vocab = {s: i for i, s in enumerate(byte_symbols())}
    for left, right in MERGES:
        if left not in vocab or right not in vocab:
            raise ValueError(f"merge {left!r} + {right!r} lists a side that is not yet a token")
        vocab.setdefault(left + right, len(vocab))
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab


VOCAB_SIZE = len(vocabulary())


def token_id(token: str) -> int:
    return vocabulary()[token]


def tokenizer_json() -> dict[str, Any]:
    vocab = vocabulary()
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab[t],
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for t, i in vocab.items() if t not in SPECIAL_TOKENS},
            "merges": [[left, right] for left, right in MERGES],
        },
    }


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    return {
        # Resolves to the plain tokenizer.json-backed class in transformers 4 and 5 alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        # Without this, decode() would drop spaces before punctuation and break round trips.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, data: Any) -> None:
    """Deterministic JSON: sorted keys, two-space indent, UTF-8, trailing newline."""
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_bytes(text.encode("utf-8"))


def write_tokenizer(directory: Path, model_max_length: int = 4096) -> None:
    """tokenizer.json + tokenizer_config.json, loadable with `AutoTokenizer.from_pretrained`."""
    write_json(directory / "tokenizer.json", tokenizer_json())
    write_json(directory / "tokenizer_config.json", tokenizer_config(model_max_length))
