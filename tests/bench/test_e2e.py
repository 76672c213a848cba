"""The decode window's checks (runtime/bench/e2e.py) on a tiny random Qwen3 on the CPU: the window
timed again at the e2e batch (like for like), the e2e row's ratio against that, the profiles of
both rows (the CUDA check patched so the glue runs under the CPU profiler: no kernels, busy 0), the
batch cuts in the right order, and the tables of a result.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvc.runtime.bench import e2e
from kvc.runtime.bench.result import format_profiles, format_table
from kvc.runtime.bench.throughput import ThroughputConfig, run
from kvc.runtime.cli import main
from kvc.runtime.errors import ConfigError
from tests.models.tiny import make_tiny_qwen3

PAGE = 4
INPUT = 150
OUTPUT = 40
PAGE_BYTES = 2 * 2 * 16 * 4 * PAGE  # one layer-page of K and V: 2 KV heads x head dim 16, float32
SNAPKV = {"snapkv": {"budget": 40, "window": 8}}  # 7 sequences fit 300 pages (40 each)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture
def cpu_profiles(monkeypatch):
    """Profiles on the CPU: the glue runs, the trace has no GPU activity."""
    monkeypatch.setattr(e2e, "profiling_supported", lambda device: True)


def _cfg(model_dir: Path, **kw) -> ThroughputConfig:
    settings = {"steps": 4, "warmup": 1, **kw}
    return ThroughputConfig(methods=["snapkv"], inputs=[INPUT], kv_memory=300 * PAGE_BYTES, model=str(model_dir),
                            output_len=OUTPUT, page_size=PAGE, device="cpu", dtype="float32",
                            attention_backend="torch", method_params=SNAPKV, **settings)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_e2e_row_is_compared_with_the_window_at_its_own_batch(model_dir, cpu_profiles, async_scheduling):
    result = run(_cfg(model_dir, e2e=True, e2e_batch=4, busy=True, busy_batch=2, async_scheduling=async_scheduling))
    window, e2e_row = result["rows"]
    assert (window["mode"], window["batch"], e2e_row["mode"], e2e_row["batch"]) == ("decode_window", 7, "e2e", 4)
    # the decode window, cut from 7 to 4 sequences, timed again without the profiler
    assert window["e2e_batch"] == 4
    assert window["step_ms_at_e2e_batch"] == pytest.approx(1e3 * window["phases"]["window_at_e2e_batch_s"] / 4)
    assert e2e_row["window_step_ms"] == window["step_ms_at_e2e_batch"]
    assert e2e_row["window_step_ratio"] == pytest.approx(e2e_row["step_ms"] / window["step_ms_at_e2e_batch"])
    # then cut to 2 and profiled: the window and the e2e row alike
    for row in (window, e2e_row):
        assert row["busy_batch"] == 2 and row["busy"] == 0.0, row["mode"]
        profile = row["busy_profile"]
        assert profile["steps"] == 4 and profile["by_kernel"] == [] and profile["window_ms"] > 0
        assert profile["host_gap_ms_per_step"] == pytest.approx(profile["window_ms_per_step"])
        assert row["phases"]["busy_s"] > 0
    table = format_table(result)
    assert "| snapkv | 150 | e2e | 4 |" in table and "0.000 @2" in table.split("| e2e |")[1]
    assert f"{window['step_ms_at_e2e_batch']:.2f} ms @4" in table
    assert f"{e2e_row['window_step_ratio']:.2f}x window" in table


def test_profile_batch_above_the_e2e_batch_is_cut_first(model_dir, cpu_profiles):
    result = run(_cfg(model_dir, e2e=True, e2e_batch=3, busy=True, busy_batch=6))
    window, e2e_row = result["rows"]
    assert window["busy_batch"] == 6 and window["e2e_batch"] == 3
    assert e2e_row["busy_batch"] == 3  # the e2e run has 3 sequences: all profiled
    assert "window_at_e2e_batch_s" in window["phases"]


def test_e2e_at_the_planned_batch_reuses_the_window(model_dir):
    result = run(_cfg(model_dir, e2e=True))
    window, e2e_row = result["rows"]
    assert window["e2e_batch"] == e2e_row["batch"] == 7
    assert window["step_ms_at_e2e_batch"] == window["step_ms"] and "window_at_e2e_batch_s" not in window["phases"]
    assert e2e_row["window_step_ratio"] == pytest.approx(e2e_row["step_ms"] / window["step_ms"])
    assert window["busy"] is None and e2e_row["busy"] is None and "busy_profile" not in e2e_row


def test_off_cuda_the_profile_says_why(model_dir):
    (window,) = run(_cfg(model_dir, busy=True))["rows"]
    assert window["busy"] is None and "CUDA" in window["busy_note"] and "busy_profile" not in window


def test_window_steps_must_leave_output(model_dir):
    # after its first token a window sequence runs warmup + steps (14), again at the e2e batch with
    # --e2e (28), then the profile's 2 + min(steps, 16) with --busy (42): the output is 40
    for kw in ({}, {"e2e": True, "e2e_batch": 2}, {"busy": True}):
        _cfg(model_dir, steps=12, warmup=2, **kw)
    with pytest.raises(ConfigError, match=r"after prefill \(42"):
        _cfg(model_dir, steps=12, warmup=2, e2e=True, e2e_batch=2, busy=True)
    with pytest.raises(ConfigError, match=r"after prefill \(40"):
        _cfg(model_dir, steps=12, warmup=2, busy=True, decode_offset=12)
    with pytest.raises(ConfigError, match="e2e_batch"):
        _cfg(model_dir, e2e=True, e2e_batch=0)


def test_cli_prints_the_profiles(model_dir, cpu_profiles, capsys):
    code = main(["bench", "throughput", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                 "--methods", "snapkv", "--method-params", "snapkv:budget=40,window=8", "--inputs", str(INPUT),
                 "--output", str(OUTPUT), "--kv-memory", str(300 * PAGE_BYTES), "--page-size", str(PAGE),
                 "--steps", "4", "--warmup", "1", "--attention-backend", "torch", "--e2e", "--e2e-batch", "4",
                 "--busy", "--busy-batch", "4", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "#### snapkv @ 150 (decode_window, batch 4, 4 profiled steps): busy 0.000" in out
    assert "#### snapkv @ 150 (e2e, batch 4, 4 profiled steps): busy 0.000" in out


def _kernel(i: int) -> dict:
    ms = 14.0 - i
    return {"name": f"k{i}|x", "calls": 2 * (i + 1), "total_ms": ms, "ms_per_step": ms / 2, "share": ms / 105.0}


def test_profile_tables_show_the_top_kernels_and_the_rest():
    profile = {"busy": 0.5, "window_ms": 420.0, "gpu_ms": 210.0, "kernels": 210, "steps": 2,
               "window_ms_per_step": 210.0, "gpu_ms_per_step": 105.0, "host_gap_ms_per_step": 105.0,
               "launches_per_step": 612.5, "copies_per_step": 3.0, "by_kernel": [_kernel(i) for i in range(14)]}
    result = {"rows": [
        {"method": "pyramidkv", "input_len": 32768, "mode": "decode_window", "busy_batch": 159, "busy": 0.5,
         "busy_profile": profile},
        {"method": "full", "input_len": 32768, "mode": "decode_window", "busy": None},
    ]}
    text = format_profiles(result)
    lines = text.splitlines()
    assert lines[0] == ("#### pyramidkv @ 32768 (decode_window, batch 159, 2 profiled steps): busy 0.500, "
                        "step 210.00 ms = GPU 105.00 ms + host gap 105.00 ms, 612.5 kernel launches + 3.0 copies "
                        "per step")
    rows = [line for line in lines if line.startswith("| k") and not line.startswith("| kernel")]
    assert len(rows) == 12 and rows[0] == "| k0\\|x | 2 | 1.0 | 14.00 | 7.000 | 13.3% |"
    # the two smallest (2 and 1 ms) summed in one line
    assert lines[-1] == "| (2 other kernels) | 54 | 27.0 | 3.00 | 1.500 | 2.9% |"
    assert "full" not in text
    assert format_profiles({"rows": [result["rows"][1]]}) == ""
    # a profile saved before launches were counted: the heading without them
    del profile["launches_per_step"], profile["copies_per_step"]
    assert format_profiles(result).splitlines()[0].endswith("host gap 105.00 ms")


def test_prefill_profile_and_host_ranges_are_tabled():
    profile = {"busy": 0.9, "window_ms": 1800.0, "gpu_ms": 1620.0, "kernels": 5000, "steps": 1,
               "window_ms_per_step": 1800.0, "gpu_ms_per_step": 1620.0, "host_gap_ms_per_step": 180.0,
               "launches_per_step": 5000.0, "copies_per_step": 2.0, "by_kernel": [_kernel(0)],
               "host_ranges": [{"name": "kvc.forward", "calls": 4, "total_ms": 1700.0, "ms_per_step": 1700.0}],
               "host_waits": [{"name": "cudaStreamSynchronize", "calls": 1, "total_ms": 1500.0,
                               "ms_per_step": 1500.0}]}
    row = {"method": "full", "input_len": 32768, "mode": "decode_window", "busy": None, "prefill_busy": profile}
    lines = format_profiles({"rows": [row]}).splitlines()
    assert lines[0].startswith("#### full @ 32768 (prefill, 1 profiled steps): busy 0.900, step 1800.00 ms")
    assert "| kvc.forward | 4 | 4.0 | 1700.00 | 1700.000 |" in lines
    assert lines[-1] == "| cudaStreamSynchronize | 1 | 1.0 | 1500.00 | 1500.000 |"


@pytest.mark.parametrize("every,runs", [(4, True), (0, False)])
def test_warm_up_runs_a_decode_keep_once(model_dir, monkeypatch, every, runs):
    """A method that keeps tokens at decode (SnapKV's decode budget) is warmed up through one run of that keep,
    so its first run's set-up and compiles fall before any timing; one without (every 0) stops after 3 tokens."""
    from kvc.runtime.bench.steps import make_engine, warm_up
    from kvc.runtime.compiled.method import CompiledMethod
    from kvc.runtime.methods import resolve_method

    params = {"budget": 32, "window": 4, "kernel": 3, "every": every}
    cfg = ThroughputConfig(methods=["snapkv"], inputs=[100], kv_memory=2**22, budget=32, output_len=128, steps=8,
                           device="cpu", dtype="float32", method_params={"snapkv": params})
    engine = make_engine(cfg, str(model_dir), resolve_method("snapkv", params), params, 100, 4)
    plans, batch = [], CompiledMethod.step_end_batch
    monkeypatch.setattr(CompiledMethod, "step_end_batch",
                        lambda self, layer, views: plans.extend(p for p in batch(self, layer, views) if p) or
                        batch(self, layer, views))
    warm_up(engine, cfg, 100)
    assert bool(plans) is runs and not engine.has_unfinished()


@pytest.mark.parametrize("warmup_decode,every", [(64, 8), (3, 12)])
def test_the_window_starts_after_its_batch_ran_the_decode_keep(model_dir, monkeypatch, warmup_decode, every):
    """The decode window's rows run a decode keep once, untimed, before the window; a keep whose interval is
    longer than the warm-up's decode (`every` 12, its rows 7 steps from it, against 3 warm-up tokens) is still
    reached, within the window's own length."""
    from kvc.runtime.bench import throughput

    monkeypatch.setattr(throughput, "WARMUP_DECODE", warmup_decode)
    params = {"budget": 32, "window": 4, "kernel": 3, "every": every}
    cfg = ThroughputConfig(methods=["full", "snapkv"], inputs=[100], kv_memory=2**22, budget=32, output_len=128,
                           steps=every, device="cpu", dtype="float32", method_params={"snapkv": params},
                           model=str(model_dir))
    rows = {r["method"]: r for r in run(cfg)["rows"]}
    assert rows["full"]["phases"]["warmup_keep_steps"] == 0
    for row in rows.values():  # each window step timed, adding up to the window
        assert len(row["steps_ms"]) == every
        assert sum(row["steps_ms"]) == pytest.approx(1e3 * row["phases"]["window_s"], rel=1e-3)
        assert row["slow_steps"]["median_ms"] > 0
    keep_steps = rows["snapkv"]["phases"]["warmup_keep_steps"]
    assert 1 <= keep_steps <= every and (warmup_decode > every or keep_steps > warmup_decode)
