"""Where one long prefill's host time goes: the steps that prefill a single prompt (no decode rows, no prefix
hit), timed plainly and then under cProfile, after a warm-up prompt of the same length (kernels compiled,
cuDNN's graphs built). The GPU time of the same steps (CUDA events around them) says how much of the wall the
host leaves the GPU idle; the cProfile table says which Python functions hold the host (docs/benchmarks.md,
issue 23's prefill sections).

    python bench/prefill_host_profile.py --model random:qwen3-30b-a3b --input 32768 --chunk 8192 --out p.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


def _as_before() -> None:
    """The prefill path as it was before the merge kernel (a same-run baseline)."""
    from kvc.runtime.attention import torch_ops
    from kvc.runtime.models import moe_triton
    from kvc.runtime.primitives import merge_triton

    torch_ops._CUDNN_GQA = False

    def lerp(o_a, lse_a, o_b, lse_b):
        w = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)
        return torch.lerp(o_b.float(), o_a.float(), w).to(o_b.dtype)

    merge_triton.merge = lerp
    tiles = moe_triton.default_config

    def old_tiles(num_tokens, top_k, num_experts, dtype):
        cfg = tiles(num_tokens, top_k, num_experts, dtype)
        return moe_triton.MoeTileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3) \
            if cfg.block_m == 128 and dtype != torch.float32 else cfg

    moe_triton.default_config = old_tiles


def _moe_before() -> None:
    """The experts as they were before their even tiles, TMA, the Triton pair sum and the split alignment
    kernels (a same-run baseline): masked tiles, torch's sum of each token's k rows, the sort above 16,384
    pairs."""
    from kvc.runtime.models import moe_triton

    class TorchSum:
        def __getitem__(self, grid):
            return lambda src, out, hidden, TOP_K, **_: torch.sum(src.view(-1, TOP_K, hidden), dim=1, out=out)

    moe_triton._sum_pairs_kernel = TorchSum()
    moe_triton._even_and_tma = lambda *_: (False, False)
    align = moe_triton.align_by_expert
    moe_triton.align_by_expert = lambda ids, e, bm, impl="auto", skips=False: align(
        ids, e, bm, "torch" if impl == "auto" and ids.numel() > 16384 else impl, skips)


def _moe_tiles(spec: str) -> None:
    """Prefill chunks' expert tiles from a JSON object of `MoeTileConfig` fields (e.g. a sweep's best)."""
    from kvc.runtime.models import moe_triton

    tiles = moe_triton.default_config
    fields = json.loads(spec)

    def chosen(num_tokens, top_k, num_experts, dtype):
        cfg = tiles(num_tokens, top_k, num_experts, dtype)
        return moe_triton.MoeTileConfig(**fields) if num_tokens * top_k > 256 * num_experts else cfg

    moe_triton.default_config = chosen


def _gpu_profile(run, top: int) -> str:
    """One more prefill under torch.profiler: the torch ops and GPU kernels by their own GPU time, with input
    shapes, so that a copy or a reduction says where it comes from (the kernels alone, with the busy
    fraction: `kvc bench throughput --busy-prefill`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run()
    events = prof.key_averages(group_by_input_shape=True)
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    table = events.table(sort_by=key, row_limit=top, max_name_column_width=60, max_shapes_column_width=90)
    return table + "\n" + _gpu_gaps(prof.events(), top)


def _gpu_gaps(events, top: int) -> str:
    """Where the GPU idles between the prefill's kernels: the span from the first kernel's start to the last
    one's end, the kernels' busy time, and the largest gaps with the kernels on either side (a gap after a
    step's last kernel is the host preparing the next one)."""
    from torch.autograd import DeviceType

    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events  # not the kvc.* ranges
                      if e.device_type == DeviceType.CUDA and not e.is_user_annotation), key=lambda k: k[0])
    if not kernels:
        return "no kernels profiled"
    gaps, busy_end, busy = [], kernels[0][0], 0.0
    for i, (start, end, _) in enumerate(kernels):
        if start > busy_end:
            gaps.append((start - busy_end, i))
        busy += max(0.0, end - max(start, busy_end))
        busy_end = max(busy_end, end)
    span = busy_end - kernels[0][0]
    lines = [f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms "
             f"in {len(gaps)} gaps ({sum(g for g, _ in gaps if g >= 20) / 1e3:.1f} ms in gaps of 20 us or more)"]
    for gap, i in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap / 1e3:8.3f} ms  at {(kernels[i][0] - kernels[0][0]) / 1e3:9.1f} ms  after "
                     f"{kernels[i - 1][2][:50]}  before {kernels[i][2][:50]}")
    return "\n".join(lines)


def _sync_prefill() -> None:
    """Async scheduling as it was before prefill chunks and admissions ran ahead (a same-run baseline): only
    the plain continuation of a decode-only step, with nothing waiting, is scheduled ahead."""
    from kvc.runtime.scheduler import Scheduler

    ahead = Scheduler.schedule_ahead

    def decodes_only(self, launched):
        if self.waiting or launched.num_prefills or any(seq.is_prefill for seq in self.running):
            return None
        return ahead(self, launched)

    Scheduler.schedule_ahead = decodes_only
    Scheduler.may_run_ahead = staticmethod(
        lambda batch: batch.num_prefills == 0 and all(s.chain is None and s.params.structured_outputs is None
                                                      for s in batch.seqs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-30b-a3b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--kv-memory", default="24GiB")
    p.add_argument("--prefill-attention", default="auto")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--device", default="cuda", help="cpu: a dry run (no GPU time)")
    p.add_argument("--baseline", action="store_true",
                   help="as before the merge kernel: GQA keys repeated, the float32 lerp, 64 x 128 MoE prefill tiles")
    p.add_argument("--sync-prefill", action="store_true",
                   help="as before prefills ran ahead: a step with prefill chunks, or with requests waiting, syncs")
    p.add_argument("--moe-before", action="store_true",
                   help="the experts before their even tiles, TMA, Triton pair sum, wider alignment kernel and "
                        "the pair sum in the norm (implies --reduce-pairs)")
    p.add_argument("--moe-tiles", help="JSON of MoeTileConfig fields for prefill chunks' experts")
    p.add_argument("--reduce-pairs", action="store_true",
                   help="the experts' k rows per token summed in a launch of their own, not in the next norm's")
    p.add_argument("--gpu-profile", action="store_true",
                   help="one more prefill under torch.profiler: kernels and torch ops (with shapes) by GPU time")
    p.add_argument("--query-block", type=int,
                   help="the SDPA prefill's query blocks (runtime/attention/sdpa_prefill.py QUERY_BLOCK; 0: one call)")
    p.add_argument("--decoding", type=int, default=0,
                   help="rows decoding beside the prefill (mixed steps, as a serving engine runs them)")
    p.add_argument("--decode-prompt", type=int, default=1024, help="prompt tokens of each decoding row")
    p.add_argument("--out")
    a = p.parse_args()

    from kvc.runtime.bench.plan import parse_bytes
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.engine import Engine
    from kvc.runtime.sampling_params import SamplingParams

    if a.baseline:
        _as_before()
    if a.sync_prefill:
        _sync_prefill()
    if a.moe_before:
        _moe_before()
    if a.moe_tiles:
        _moe_tiles(a.moe_tiles)
    if a.query_block is not None:
        from kvc.runtime.attention import sdpa_prefill

        sdpa_prefill.QUERY_BLOCK = a.query_block
    engine = Engine(EngineConfig(model=a.model, dtype=a.dtype, device=a.device,
                                 kv_cache_memory=parse_bytes(a.kv_memory), max_num_seqs=a.decoding + 4,
                                 max_num_batched_tokens=a.chunk, max_model_len=a.input + 16,
                                 enable_prefix_caching=False, prefill_attention=a.prefill_attention))
    if a.reduce_pairs or a.moe_before:
        for module in engine.model.modules():
            if hasattr(module, "reduce_pairs"):
                module.reduce_pairs = True
    g = torch.Generator().manual_seed(0)
    vocab = min(30000, engine.spec.vocab_size)
    for _ in range(a.decoding):  # outlive the three prefills below; sampled, so that rows stay distinct
        engine.add_request(torch.randint(3, vocab, (a.decode_prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=a.input - a.decode_prompt, temperature=1.0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()

    def prefill(profiler: cProfile.Profile | None) -> tuple[float, float, int]:
        """(wall s, GPU s, steps) of one fresh prompt's prefill, up to its first token."""
        seq = engine.add_request(torch.randint(3, vocab, (a.input,), generator=g).tolist(),
                                 SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        cuda = a.device == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        steps, t = 0, time.perf_counter()
        if profiler:
            profiler.enable()
        while not seq.is_finished:
            engine.step()
            steps += 1
        if profiler:
            profiler.disable()
        if cuda:
            end.record()
        sync()
        wall = time.perf_counter() - t
        return wall, start.elapsed_time(end) / 1e3 if cuda else wall, steps

    prefill(None)  # warm-up: compiles, cuDNN graphs of these shapes
    wall, gpu_span, steps = prefill(None)
    prof = cProfile.Profile()
    wall_p, _, _ = prefill(prof)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(a.top)
    stats.sort_stats("cumulative").print_stats(a.top)
    tags = ("baseline " if a.baseline else "") + ("sync-prefill " if a.sync_prefill else "") + (
        "moe-before " if a.moe_before else "") + (f"moe-tiles {a.moe_tiles} " if a.moe_tiles else "") + (
        f"query-block {a.query_block} " if a.query_block is not None else "") + (
        "reduce-pairs " if a.reduce_pairs else "")
    print(f"{tags}{a.model}: one {a.input}-token prefill in chunks of {a.chunk}"
          f"{f' beside {a.decoding} decoding rows' if a.decoding else ''}: "
          f"{wall:.3f} s wall ({steps} steps), "
          f"{wall_p:.3f} s under cProfile")
    print(out.getvalue())
    if a.gpu_profile and a.device == "cuda":
        print(_gpu_profile(lambda: prefill(None), a.top))
    if a.out:
        rows = sorted(((f"{fn[0].split('/kvc/')[-1]}:{fn[1]}({fn[2]})", s[2], s[3], s[1])
                       for fn, s in stats.stats.items()), key=lambda r: -r[1])[: 4 * a.top]
        with open(a.out, "w") as f:
            device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
            json.dump({"model": a.model, "baseline": a.baseline, "sync_prefill": a.sync_prefill,
                       "moe_before": a.moe_before, "moe_tiles": a.moe_tiles, "query_block": a.query_block,
                       "reduce_pairs": a.reduce_pairs,
                       "decoding": a.decoding, "input": a.input,
                       "chunk": a.chunk, "wall_s": wall,
                       "steps": steps, "wall_profiled_s": wall_p, "gpu_span_s": gpu_span, "device": device,
                       "by_tottime": [{"function": r[0], "tottime_s": r[1], "cumtime_s": r[2], "calls": r[3]}
                                      for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
