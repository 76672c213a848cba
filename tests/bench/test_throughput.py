"""`kvc bench throughput` / `kvc bench plot` (runtime/bench/) on a tiny random Qwen3 on the CPU.

- The plan: every method gets about the same budget from its declared parameters; the largest
  batch is the pool over one sequence's steady-state pages, recomputed here by hand from the
  methods' published budgets (SnapKV: budget + output per layer; full: input + output), so SnapKV's
  batch exceeds full's at the same KV memory.
- A run through the CLI writes the JSON with every field, decode-window rows at the planned batch,
  an e2e row per method with its step-time ratio, the ratios vs full, and the PNG.
- The e2e check and the profiles: tests/bench/test_e2e.py; the trace parsing: tests/bench/test_busy.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from kvc.runtime.bench.cli import parse_method_params
from kvc.runtime.bench.plan import (declared_family, declared_parameters, equal_budget_params, model_for_context,
                                    parse_bytes, plan_batch)
from kvc.runtime.bench.throughput import ThroughputConfig, prepare
from kvc.runtime.cli import main
from kvc.runtime.errors import ConfigError, KvcError, ModelLoadError
from kvc.runtime.methods import resolve_method
from kvc.runtime.models.loader import resolve_model
from tests.models.tiny import make_tiny_qwen3

PAGE = 4
INPUT = 150
OUTPUT = 24
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
PAGE_BYTES = 2 * KV_HEADS * HEAD_DIM * 4 * PAGE  # one layer-page of K and V in float32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def test_equal_budget_params_follow_the_declarations():
    at = {name: equal_budget_params(declared_parameters(name), 32768, 2048)
          for name in ("full", "snapkv", "pyramidkv", "adakv", "tova", "streamingllm", "h2o")}
    assert at["full"] == {}
    # a `budget` in tokens is the whole budget (streamingllm's and h2o's override their native sizes)
    assert all(at[name] == {"budget": 2048} for name in at if name != "full")
    # without one: a recent window beside sink tokens, or fractions of the prompt
    stream = {k: v for k, v in declared_parameters("streamingllm").items() if k != "budget"}
    assert equal_budget_params(stream, 32768, 2048) == {"recent": 2044}  # + its 4 sink tokens
    fractions = {k: v for k, v in declared_parameters("h2o").items() if k != "budget"}
    assert equal_budget_params(fractions, 32768, 2048) == {"heavy": 1024 / 32768, "recent": 1024 / 32768}
    for n in (131072, 30000, 3001):  # the lowering floors fraction * prompt: it must reach the count
        h2o = equal_budget_params(fractions, n, 2048)
        assert math.floor(h2o["heavy"] * n) == 1024 and math.floor(h2o["recent"] * n) == 1024
    assert equal_budget_params(fractions, 100, 2048) == {"heavy": 1.0, "recent": 1.0}
    # a compression or quantization method's token parameters size its format: DeltaKV's `recent` (its raw
    # tail) and KIVI's residual keep their defaults
    for name in ("deltakv", "kivi", "turboquant"):
        assert equal_budget_params(declared_parameters(name), 32768, 2048, declared_family(name)) == {}, name
    assert declared_family("deltakv") == "compression" and declared_family("snapkv") == "eviction"


def test_largest_batch_follows_the_budgets(model_dir):
    from kvc.runtime.bench.plan import model_spec

    spec = model_spec(str(model_dir), torch.device("cpu"), "float32")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    memory = 300 * PAGE_BYTES
    full = plan_batch(resolve_method("full", None), spec, memory, PAGE, INPUT, OUTPUT, 1000)
    snap = plan_batch(resolve_method("snapkv", {"budget": 40, "window": 8}), spec, memory, PAGE, INPUT, OUTPUT, 1000)
    assert full.num_pages == snap.num_pages == 300
    assert full.pages_per_seq == LAYERS * math.ceil((INPUT + OUTPUT) / PAGE) == 88
    assert snap.pages_per_seq == LAYERS * math.ceil((40 + OUTPUT) / PAGE) == 32
    assert (full.batch, snap.batch) == (300 // 88, 300 // 32) == (3, 9)
    capped = plan_batch(resolve_method("snapkv", {"budget": 40, "window": 8}), spec, memory, PAGE, INPUT, OUTPUT, 4)
    assert capped.batch == 4 and capped.fits == 9
    # one request's prefill peak (the whole prompt) must fit too
    small = plan_batch(resolve_method("snapkv", {"budget": 40, "window": 8}), spec, 40 * PAGE_BYTES, PAGE, INPUT,
                       OUTPUT, 1000)
    assert small.prefill_pages == LAYERS * math.ceil(INPUT / PAGE) == 76 and small.batch == 0


def test_random_model_context_is_lengthened_for_the_run():
    spec = resolve_model("random:qwen3-30b-a3b", "meta").spec
    assert model_for_context("random:qwen3-30b-a3b", 1000, spec) == "random:qwen3-30b-a3b"
    longer = model_for_context("random:qwen3-30b-a3b", 133121, spec)
    assert resolve_model(longer, "meta").spec.max_position_embeddings == 133121
    with pytest.raises(ConfigError, match="holds 40960 tokens"):
        model_for_context("/some/dir", 133121, spec)
    with pytest.raises(ModelLoadError, match="key=integer"):
        resolve_model("random:qwen3-30b-a3b,max_position_embeddings=big", "meta")


def test_option_parsing():
    assert parse_bytes("60GiB") == 60 * 2**30 and parse_bytes("1.5MB") == 1_500_000 and parse_bytes("4096") == 4096
    with pytest.raises(ConfigError, match="kv-memory"):
        parse_bytes("60 parsecs")
    assert parse_method_params(["snapkv:budget=512,pooling=max", "h2o:heavy=0.05"]) == {
        "snapkv": {"budget": 512, "pooling": "max"}, "h2o": {"heavy": 0.05}}
    assert parse_method_params(["omnikv:filters=[8,18],selected=0.1", "omnikv:filters=[]"]) == {
        "omnikv": {"filters": [], "selected": 0.1}}
    assert parse_method_params(["omnikv:filters=[3]"]) == {"omnikv": {"filters": [3]}}
    with pytest.raises(ConfigError, match="METHOD:KEY=VALUE"):
        parse_method_params(["budget=512"])
    with pytest.raises(ConfigError, match="not in --methods"):
        ThroughputConfig(methods=["full"], inputs=[100], kv_memory=2**20, method_params={"snapkv": {"budget": 8}})
    with pytest.raises(ConfigError, match="must not finish"):
        ThroughputConfig(methods=["full"], inputs=[100], kv_memory=2**20, output_len=16, steps=16)
    with pytest.raises(ConfigError, match="sources >= 2"):
        ThroughputConfig(methods=["full"], inputs=[100], kv_memory=2**20, sources=1, busy_prefill=True)


def test_bad_method_is_refused_before_any_measurement(model_dir):
    cfg = ThroughputConfig(methods=["full", "snapkv"], inputs=[INPUT], kv_memory=300 * PAGE_BYTES,
                           output_len=OUTPUT, steps=4, warmup=1, page_size=PAGE, device="cpu", dtype="float32",
                           method_params={"snapkv": {"budget": 0}})
    with pytest.raises(ConfigError, match="snapkv at 150 input tokens"):
        prepare(cfg, str(model_dir))


def test_cli_run_writes_the_result_and_plot(model_dir, tmp_path, capsys):
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    # the JSON and the tables are checked without matplotlib too
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") is not None else []
    code = main(["bench", "throughput", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                 "--methods", "full,snapkv", "--method-params", "snapkv:budget=40,window=8", "--inputs", str(INPUT),
                 "--output", str(OUTPUT), "--kv-memory", str(300 * PAGE_BYTES), "--page-size", str(PAGE),
                 "--steps", "4", "--warmup", "1", "--attention-backend", "torch", "--e2e", "--busy",
                 "--out", str(out), *plot, "--no-progress"])
    assert code == 0
    result = json.loads(out.read_text())
    for key in ("date", "command", "device", "versions", "model", "kv_memory_bytes", "budget", "budget_rule",
                "mode_notes", "rows", "ratios_vs_full"):
        assert key in result, key
    assert set(result["versions"]) >= {"torch", "triton", "transformers"}
    assert result["complete"] is True
    rows = {(r["method"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {("full", "decode_window"), ("full", "e2e"), ("snapkv", "decode_window"), ("snapkv", "e2e")}
    assert rows["full", "decode_window"]["batch"] == 3 and rows["snapkv", "decode_window"]["batch"] == 9
    assert rows["snapkv", "decode_window"]["params"]["budget"] == 40
    for row in result["rows"]:
        for key in ("method", "params", "input_len", "output_len", "batch", "pages_per_seq", "decode_tok_s",
                    "step_ms", "prefill_s", "ttft_s", "mode", "busy", "phases"):
            assert key in row, (row["method"], row["mode"], key)
        assert row["decode_tok_s"] == pytest.approx(row["batch"] * 4 / (row["phases"]["window_s"]))
        assert row["decode_tok_s"] > 0 and row["prefill_s"] > 0 and row["ttft_s"] > 0
    window = rows["snapkv", "decode_window"]
    assert window["kv_tokens_at_window"] == 40  # the real post-prefill state: the budget, per layer
    assert window["busy"] is None and "CUDA" in window["busy_note"]
    e2e = rows["snapkv", "e2e"]
    assert e2e["window_step_ratio"] == pytest.approx(e2e["step_ms"] / window["step_ms"])
    ratio = result["ratios_vs_full"][str(INPUT)]["snapkv"]
    assert ratio["batch"] == 3.0
    full_tok_s = rows["full", "decode_window"]["decode_tok_s"]
    assert ratio["decode_tok_s"] == pytest.approx(window["decode_tok_s"] / full_tok_s)
    table = capsys.readouterr().out
    assert "| snapkv | 150 | decode_window | 9 |" in table
    if not plot:
        pytest.skip("matplotlib is not installed: the PNG is not checked")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = tmp_path / "again.png"
    assert main(["bench", "plot", str(out), "-o", str(again)]) == 0
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_writes_the_rows_of_a_run_cut_short(model_dir, tmp_path, monkeypatch):
    """--out holds the finished rows after every case (`complete` false), so a time limit that stops
    the run keeps them; here the second case's measurement stops the run."""
    import kvc.runtime.bench.throughput as throughput

    out, calls = tmp_path / "result.json", []

    def measure(cfg, case, copy_gbps=None):
        calls.append(case.method)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a time limit's signal leaves: no row, no final write
        return [{"method": case.method, "input_len": case.input_len, "mode": "decode_window", "batch": 1,
                 "decode_tok_s": 10.0, "step_ms": 1.0}]

    monkeypatch.setattr(throughput, "measure", measure)
    code = main(["bench", "throughput", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                 "--methods", "full,snapkv", "--inputs", str(INPUT), "--output", str(OUTPUT), "--kv-memory",
                 str(300 * PAGE_BYTES), "--page-size", str(PAGE), "--steps", "4", "--warmup", "1", "--out", str(out),
                 "--no-progress"])
    assert code == 130  # the CLI's answer to an interrupt
    result = json.loads(out.read_text())
    assert result["complete"] is False
    assert [r["method"] for r in result["rows"]] == ["full"]
    assert "date" in result and "command" in result


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    from kvc.runtime.bench.plot import render

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(KvcError, match=r"kvc\[bench\]"):
        render({"rows": []}, tmp_path / "x.png")


def test_plot_rejects_what_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": 3}')
    assert main(["bench", "plot", str(bad)]) == 1
    assert "not a `kvc bench throughput` result" in capsys.readouterr().err


def test_mix_runs_every_method_in_one_batch(model_dir, tmp_path):
    """--mix: each method's window at the batch all hold, then one engine with both, half the rows each."""
    out = tmp_path / "mix.json"
    code = main(["bench", "throughput", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                 "--methods", "full,snapkv", "--method-params", "snapkv:budget=40,window=8", "--inputs", str(INPUT),
                 "--output", str(OUTPUT), "--kv-memory", str(300 * PAGE_BYTES), "--page-size", str(PAGE),
                 "--steps", "3", "--warmup", "1", "--sources", "1", "--attention-backend", "torch", "--mix",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    rows = {(r["method"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows["full", "decode_window"]["batch"] == rows["snapkv", "decode_window"]["batch"] == 3  # full's
    mixed = rows["full+snapkv", "mixed_window"]
    assert "error" not in mixed, mixed.get("error")
    assert mixed["batch"] == 3 and mixed["shares"] == {"full": 2, "snapkv": 1} and mixed["groups"] == 1
    slowest = max(rows["full", "decode_window"]["step_ms"], rows["snapkv", "decode_window"]["step_ms"])
    assert mixed["vs_slowest"] == pytest.approx(mixed["step_ms"] / slowest)
    assert mixed["decode_tok_s"] == pytest.approx(3 * 3 / mixed["phases"]["window_s"])


def test_tensor_parallel_run_plans_one_ranks_heads(model_dir, tmp_path):
    """--tensor-parallel-size 2: each rank holds one of the two KV heads, so the same per-rank KV memory holds
    twice full's batch; the engine's pool is the plan's (checked by the run)."""
    out = tmp_path / "tp.json"
    args = ["bench", "throughput", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
            "--methods", "full", "--inputs", str(INPUT), "--output", str(OUTPUT), "--kv-memory", str(300 * PAGE_BYTES),
            "--page-size", str(PAGE), "--steps", "2", "--warmup", "1", "--sources", "1", "--attention-backend",
            "torch", "--no-progress"]
    assert main([*args, "--tensor-parallel-size", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row, row.get("error")
    assert row["batch"] == 6  # 3 at one rank (test_cli_run_writes_the_result_and_plot)


def test_slow_steps_split_the_evicting_steps_from_the_steady_ones():
    """A window of steady steps with two slow ones (a decode keep's evicting steps): the median is the steady
    step, the slow ones are counted with their time above it; a window without any reports none."""
    from kvc.runtime.bench.steps import slow_steps

    split = slow_steps([30.0, 31.0, 29.0, 250.0, 30.0, 30.5, 90.0, 30.0])
    assert split["median_ms"] == 30.25 and split["slow"] == 2
    assert split["slow_extra_ms"] == pytest.approx(250.0 + 90.0 - 2 * 30.25)
    assert slow_steps([10.0, 11.0, 12.0])["slow"] == 0
    assert slow_steps([]) == {"median_ms": None, "slow": 0, "slow_extra_ms": 0.0}
