"""`kvc tune` end to end on the CPU: the no-GPU error, and a tiny interpreted run (hidden
`--interpret`, TRITON_INTERPRET=1) whose cache file the engine then loads at start."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvc.runtime.cli import main
from kvc.runtime.tuning import lookup, table
from kvc.runtime.tuning.keys import gpu_key

TINY = ["--model", "random:tiny", "--max-batch", "1", "--max-chunk", "16", "--max-context", "256",
        "--max-candidates", "2", "--rep-ms", "1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_without_cuda_a_clear_error_and_exit_2(capsys):
    assert main(["tune", "--effort", "quick"]) == 2
    err = capsys.readouterr().err
    assert "kvc tune needs a CUDA GPU" in err and "Traceback" not in err


def test_unknown_kernel_group_is_a_user_error(capsys, tmp_path):
    pytest.importorskip("triton")
    assert main(["tune", "--interpret", "--kernels", "attention,gemm", "--tuned-dir", str(tmp_path)]) == 1
    assert "--kernels: unknown gemm" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory):
    """One tiny run for the snapkv method (plain attention, compaction, its window scores) on the tiny test model."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreted run is the CPU stand-in for a GPU run")
    from tests.kernels.paged_cases import triton_device_and_ops

    triton_device_and_ops()  # make sure triton runs interpreted
    root = tmp_path_factory.mktemp("tune")
    code = main(["tune", "--interpret", "--method", "snapkv", *TINY, "--tuned-dir", str(root),
                 "--out", str(root / "summary.json")])
    return code, root


def test_tiny_run_writes_the_cache_and_the_summary(tuned_run, capsys):
    code, root = tuned_run
    assert code == 0
    summary = json.loads((root / "summary.json").read_text())
    kernels = {r["kernel"] for r in summary["results"]}
    assert kernels == {"attention.plain.decode", "attention.plain.prefill", "attention.plain.store_kv", "kv.compaction",
                       "scores.column_votes"}
    for row in summary["results"]:
        assert "skipped" not in row, row
        assert row["tuned_ms"] <= row["untuned_ms"] and row["speedup"] >= 1.0
        assert row["candidates_measured"] <= 2 and row["untuned_config"]
    cache = table.read(table.path_for(root, gpu_key("cpu")))
    assert len(cache.entries) == len(summary["results"])
    from kvc.runtime.attention import triton_ops

    plain_hash = triton_ops.load("plain").SOURCE_HASH
    assert {e.source_hash for e in cache.entries.values() if e.kernel.startswith("attention.")} == {plain_hash}
    assert {e.source for e in cache.entries.values()} >= {"kernels_generated/_attention/plain.py"}


def test_a_second_run_merges_into_the_same_file(tuned_run, tmp_path):
    code, root = tuned_run
    path = table.path_for(root, gpu_key("cpu"))
    before = set(table.read(path).entries)
    assert main(["tune", "--interpret", "--method", "full", "--kernels", "attention", *TINY,
                 "--max-candidates", "1", "--tuned-dir", str(root)]) == 0
    assert set(table.read(path).entries) == before  # same buckets re-measured, nothing lost


def test_engine_start_loads_the_tuned_configs(tuned_run, monkeypatch, caplog):
    from kvc import LLM, SamplingParams

    _, root = tuned_run
    count = len(table.read(table.path_for(root, gpu_key("cpu"))).entries)
    monkeypatch.setenv("KVC_TUNED_DIR", str(root))
    prompts = [[5, 9, 13, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    options = dict(method="full", device="cpu", dtype="float32", cuda_graphs=False, max_num_batched_tokens=16)
    with caplog.at_level(logging.INFO, logger="kvc.runtime.tuning.lookup"):
        tuned = LLM("random:tiny", attention_backend="triton", **options)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvc.runtime.tuning.lookup"]
    assert lines == [f"tuned kernel configs: {count} entries loaded from {table.path_for(root, gpu_key('cpu'))}"]
    assert len(lookup.active()) == count
    want = [o.token_ids for o in LLM("random:tiny", attention_backend="torch", **options).generate(prompts, params)]
    assert [o.token_ids for o in tuned.generate(prompts, params)] == want
