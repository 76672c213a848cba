"""Distinct contexts for the decode window: more real source requests, and clones whose layers mix
their KV.

Clones of one request share its context: their attention outputs are nearly equal, so an MoE
layer routes every row to the same few experts, and on the H200 the window's expert kernels ran
at a fifth of an end-to-end batch's cost (64 independent 32K requests touch nearly all 128 experts
of every layer). Fresh tokens per row (`_diverge`, sampling) do not change that: the shared
context dominates the hidden state. So the window prefills `sources` real requests (distinct
random prompts of the same length, each in its method's real post-prefill state) and gives every
clone, layer by layer, the stored KV of a source drawn at random: each clone then attends over its
own mixture (sources ** layers combinations), and its hidden state, and its routing, is its own.

Every page a clone gets is a real page of the method at that layer, with the layer's per-KV-head
start slots and state planes (`PagedAttention.copy_pages` copies them). The sources started
decoding at different steps (one prefills after the other), so they store a few tokens more or
less: a clone takes the source's whole pages below the shorter of the two lengths and keeps its
own tail (the compacted prefix, where start slots point, is always inside). A method's
per-sequence host state (`Hook.CLONE`) stays that of the clone's first source.
"""

from __future__ import annotations

import random

from kvc.runtime.bench.steps import first_tokens, prompt


def prefill_sources(engine, params, input_len: int, count: int, seed: int, clock, first: int = 0) -> list:
    """`count` more real requests of `input_len` random tokens (the `first`th source's prompt on), stepped
    until each has its first token; the list of their sequences."""
    seqs = [engine.add_request(prompt(engine.spec.vocab_size, input_len, seed + 100 + i), params)
            for i in range(first, first + count)]
    first_tokens(engine, seqs, clock, limit=count * (input_len + 1))
    return seqs


def mix_layers(engine, clones: list, sources: list, seed: int) -> int:
    """Each clone's every layer takes the stored KV of a random one of `sources` (the clones were
    cloned from sources[0]): its whole pages below both lengths; returns the layers copied."""
    if len(sources) < 2 or not clones:
        return 0
    engine.drain()  # every source's bookkeeping committed before its pages are read
    rng = random.Random(seed + 11)
    src_pages: list[int] = []
    dst_pages: list[int] = []
    copied = 0
    for clone in clones:
        for layer in range(len(clone.page_tables)):
            source = sources[rng.randrange(len(sources))]
            if source is sources[0]:
                continue  # the clone already holds sources[0]'s layer
            pages = min(source.kv_lens[layer], clone.kv_lens[layer]) // engine.config.page_size
            src_pages += source.page_tables[layer][:pages]
            dst_pages += clone.page_tables[layer][:pages]
            starts = source.kv_starts[layer]
            if starts != clone.kv_starts[layer]:
                clone.set_kv_starts(layer, None if starts is None else list(starts))
            copied += 1
    engine.attention.copy_pages(src_pages, dst_pages)
    return copied
