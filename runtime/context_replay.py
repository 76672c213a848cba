"""The replay pass: a sequence's stored prompt re-read through the model after its prefill, for a
method that declares one (`replay "..." in chunks of n ...`: KVzip's context reconstruction).

Pipeline position: the model runner (runtime/model_runner.py) calls `after_prefill` once a step's
forward is done; the method's hooks (runtime/compiled/replay.py) score the stored tokens; their keep
plans are compacted like prefill_end's (runtime/step_hooks.py `keep_stored`). docs/design.md,
"Replay", is the design.

For each sequence whose prefill ended in the step, its prompt is cut into chunks of `chunk` tokens.
A chunk's input is the replay prompt (for a later chunk: the `then` prompt and the previous chunk's
last `overlap` tokens), the chat template's assistant opening, then the chunk itself. It runs
through the model at the positions after the prompt, over the whole stored prompt, its K/V written
into pages taken from the pool for the pass and given back after it (admission counts them: the
method's budget adds `longest` to the prefill peak). Per layer the method's `replay_chunk` gets the
replayed queries and their attention on the chunk's keys, normalised over the first `sink` keys,
the chunk and the replayed tokens. After the last chunk, `replay_end` gives every layer's keep plan.

The framing is KVzip's as kvpress's KVzipPress applies it: without a chat template the assistant
opening is a newline; with one it is the template's, and a prompt that opens with the template's
user-turn prefix is reconstructed from after that prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.errors import ConfigError
from kvc.runtime.method_api import LayerCacheView
from kvc.runtime.models.base import LatentQueries
from kvc.runtime.model_runner import split_heads
from kvc.runtime.primitives.torch_primitives import replay_attention
from kvc.runtime.transfer import to_device

if TYPE_CHECKING:
    from kvc.runtime.model_runner import ModelRunner, StepOutput
    from kvc.runtime.scheduler import ScheduledBatch


def frame(tokenizer) -> tuple[list[int], list[int]]:
    """(the user-turn prefix a prompt may open with, the assistant opening after a replay prompt) under
    `tokenizer`'s chat template: rendered around a marker message and cut there."""
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    if getattr(tokenizer, "chat_template", None) is None:
        return [], encode("\n")
    marker = "kvc replay marker"
    cut = "\n" + "#" * len(marker)
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker + cut}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    before, suffix = text.split(cut)
    return encode(before.split(marker)[0]), encode(suffix)


class ContextReplay:
    """One method's replay pass (`spec`: the method's `replay`) over a runner's model and cache."""

    def __init__(self, runner: ModelRunner, spec: dict[str, Any], tokenizer) -> None:
        name = runner.method.name
        if tokenizer is None:
            raise ConfigError(f"method {name!r} re-reads the prompt behind a text prompt; the model has no "
                              "tokenizer", param="method")
        if runner.pool is None:
            raise ConfigError(f"method {name!r}: the replay pass takes pages from the engine's pool", param="method")
        if any(not store.spec.dense for store in runner.attention.stores):
            raise ConfigError(f"method {name!r}: a replay pass over an encoded KV spec is not served", param="method")
        self.runner = runner
        self.prefix, self.suffix = frame(tokenizer)
        self.prompt = list(tokenizer.encode(spec["prompt"], add_special_tokens=False))
        self.then = None if spec["then"] is None else list(tokenizer.encode(spec["then"], add_special_tokens=False))
        self.chunk, self.overlap, self.sink = int(spec["chunk"]), int(spec["overlap"]), int(spec["sink"])
        if self.chunk < 1:
            raise ConfigError(f"method {name!r}: the replay chunk must be at least one token", param="method_params")

    @property
    def longest(self) -> int:
        """The most tokens one replayed chunk stores besides the prompt (what admission adds to its peak)."""
        head = len(self.prompt) if self.then is None else max(len(self.prompt), len(self.then) + self.overlap)
        return head + len(self.suffix) + self.chunk

    def chunks(self, prompt: list[int]) -> list[tuple[int, int, list[int]]]:
        """(start, end, input ids) of each replayed chunk of `prompt`: it reconstructs prompt[start:end]."""
        first = len(self.prefix) if self.prefix and prompt[:len(self.prefix)] == self.prefix else 0
        out, previous = [], None
        for start in range(first, len(prompt), self.chunk):
            piece = prompt[start:start + self.chunk]
            head = self.prompt
            if previous is not None and self.then is not None:
                head = self.then + (previous[-self.overlap:] if self.overlap else [])
            out.append((start, start + len(piece), head + self.suffix + piece))
            previous = piece
        return out

    def after_prefill(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """The pass for every sequence whose prefill this step's chunk ended, then its keep plans."""
        runner = self.runner
        for i in range(batch.num_decodes, len(batch.seqs)):
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            length = seq.num_computed_tokens + n
            if length != seq.prefill_end:
                continue
            for start, end, ids in self.chunks(seq.token_ids[:length]):
                self._chunk(seq, length, start, end, ids)
            plans = runner.method.replay_end(seq.seq_id, runner.num_layers, length, runner.num_kv_heads)
            runner.hooks.keep_stored(seq, plans, length, n, output)

    def _chunk(self, seq, length: int, start: int, end: int, ids: list[int]) -> None:
        """One replayed chunk through the model; its K/V in pages lent for it, given back after."""
        runner = self.runner
        pool, page, num_layers = runner.pool, runner.page_size, runner.num_layers
        n = len(ids)
        lent: list[list[int]] = []
        try:
            tables = []
            for layer in range(num_layers):
                own = seq.page_tables[layer]
                need = -(-(length + n) // page) - len(own)
                lent.append(pool.allocate(need, runner.attention.layer_class[layer]) if need > 0 else [])
                tables.append(runner.tables.local(layer, list(own) + lent[-1]))
            md = self._metadata(seq, tables, length, n)
            attn = self._attention(seq, md, tables, length, start, end)
            runner.model(md.positions.new_tensor(ids), md.positions, attn)
        finally:
            for pages in lent:
                if pages:
                    pool.free(pages)

    def _metadata(self, seq, tables: list[list[int]], length: int, n: int) -> AttentionMetadata:
        """A prefill chunk of n tokens at positions [length, length + n) over `tables` (store page ids)."""
        runner = self.runner
        page, num_layers, dev = runner.page_size, runner.num_layers, runner.device
        width = max(len(t) for t in tables)
        block = np.zeros((num_layers, 1, width), dtype=np.int32)
        for layer, table in enumerate(tables):
            block[layer, 0, :len(table)] = table
        phys = length + np.arange(n, dtype=np.int64)
        slots = block[:, 0, :].astype(np.int64)[:, phys // page] * page + phys % page  # [L, n]
        ctx = [[length + n] for _ in range(num_layers)]
        rows = host_rows = None
        if runner.attention.num_rows:
            host_rows = [runner.attention.scratch_row if seq.row is None else seq.row]
            rows = to_device(host_rows, dev, torch.int32)
        return AttentionMetadata(
            slot_mapping=to_device(slots, dev), block_tables=to_device(block, dev),
            cu_seqlens_q=to_device([0, n], dev, torch.int32), context_lens=to_device(ctx, dev, torch.int32),
            num_decodes=0, max_query_len=n, max_context_len=length + n, rows=rows,
            prompt_lens=to_device([[length] for _ in range(num_layers)], dev, torch.int32),
            host_cu_seqlens=[0, n], host_context_lens=ctx, host_rows=host_rows,
            positions=to_device(list(range(length, length + n)), dev, torch.int64))

    def _attention(self, seq, md: AttentionMetadata, tables: list[list[int]], length: int, start: int, end: int):
        """The model's attention for a replayed chunk: the usual prefill attention over the stored prompt and
        the chunk, then the method's `replay_chunk` on the chunk's keys."""
        runner = self.runner
        attention, method, scale = runner.attention, runner.method, runner.scale
        num_layers, sink = runner.num_layers, min(self.sink, start)

        def stored_keys(layer: int, first: int, last: int) -> torch.Tensor:
            """The stored keys of slots [first, last): [Hkv, last - first, D], read from their pages only."""
            low = first // runner.page_size
            view = LayerCacheView(attention.store_of(layer), tables[layer][low:-(-last // runner.page_size)],
                                  last - low * runner.page_size, None, layer, seq.row)
            return view.keys()[:, first - low * runner.page_size:]

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 latent: LatentQueries | None = None) -> torch.Tensor:
            out = attention.forward(layer, q, k, v, md, scale, latent=latent)
            chunk = stored_keys(layer, start, end)
            queries = runner.hook_queries(q).transpose(0, 1)  # [Hq, n, D], as hooks see them
            probs = replay_attention(queries, stored_keys(layer, 0, sink), chunk, k.transpose(0, 1))
            method.replay_chunk(seq.seq_id, layer, num_layers, queries, probs, start, length, chunk.shape[0])
            return out

        return split_heads(attn, runner.layout) if runner.layout.per_head else attn
