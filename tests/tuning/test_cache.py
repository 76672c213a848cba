"""The tuning cache on the CPU: keying, the file format, loading, and every fallback to heuristics
(missing entry, other GPU, stale source hash, corrupt file)."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from kvc.runtime.tuning import buckets, lookup, table
from kvc.runtime.tuning.keys import GpuKey, gpu_key, source_hash

CPU = gpu_key("cpu")
DECODE_BUCKET = buckets.decode(3, 1000, 4, 2, 16, torch.float32)


def entry(kernel="attention.plain.decode", family="decode", bucket=DECODE_BUCKET, config=None, digest="abc"):
    return table.Entry(kernel, family, bucket, config or {"num_splits": 3, "block_n": 16}, "x.py", digest,
                       {"num_splits": 1}, 2.0, 1.0, "now")


def write(tmp_path, entries, gpu=CPU):
    path = table.path_for(tmp_path, gpu)
    table.write(path, table.Table(gpu, {e.key: e for e in entries}))
    return path


def test_gpu_key_slug_and_cpu_key():
    key = GpuKey("NVIDIA H200", (9, 0), "3.6.0")
    assert key.slug == "nvidia-h200-sm90-triton-3.6.0"
    assert GpuKey.from_json(key.to_json()) == key
    assert CPU.name == "cpu" and CPU.capability == (0, 0)
    assert GpuKey("NVIDIA A100-SXM4-80GB", (8, 0), "3.4.0+git1").slug == "nvidia-a100-sxm4-80gb-sm80-triton-3.4.0-git1"


def test_source_hash_follows_the_file_content(tmp_path):
    f = tmp_path / "kernel.py"
    f.write_text("a = 1\n")
    first = source_hash(f)
    assert first == source_hash(f) and len(first) == 64
    f.write_text("a = 2  # recompiled\n")
    assert source_hash(f) != first


def test_buckets_round_to_the_engine_buckets():
    assert buckets.batch_bucket(1) == 1 and buckets.batch_bucket(3) == 4 and buckets.batch_bucket(20) == 24
    assert buckets.batch_bucket(512) == 512 and buckets.batch_bucket(600) == 1024
    assert buckets.context_bucket(1) == buckets.MIN_CONTEXT_BUCKET and buckets.context_bucket(40960) == 65536
    assert DECODE_BUCKET == (4, 1024, 4, 2, 16, "float32")
    assert buckets.from_dict("decode", buckets.as_dict("decode", DECODE_BUCKET)) == DECODE_BUCKET


def test_batch_buckets_are_the_decode_graph_buckets():
    from kvc.runtime.decode_graphs import DecodeGraphs

    runner = types.SimpleNamespace(device=torch.device("cpu"), num_layers=1, max_pages_per_seq=1, num_kv_heads=1,
                                   max_model_len=16, page_size=16,
                                   attention=types.SimpleNamespace(num_pages=1, num_rows=0, scratch_row=0,
                                                                   residual_window=0))
    graphs = DecodeGraphs(runner, 10_000)
    assert tuple(graphs.buckets[:-1]) == buckets.BATCH_BUCKETS


def test_round_trip_and_merge(tmp_path):
    path = write(tmp_path, [entry()])
    assert json.loads(path.read_text())["entries"][0]["bucket"]["batch"] == 4  # human-readable bucket
    read = table.read(path)
    assert read.gpu == CPU and read.entries[("attention.plain.decode", DECODE_BUCKET)] == entry()
    other = entry(kernel="attention.plain.prefill", family="prefill",
                  bucket=buckets.prefill(7, 4, 2, 16, torch.float32), config={"block_m": 32})
    merged = table.merge(path, CPU, [other, entry(config={"num_splits": 2})])
    assert len(merged.entries) == 2 and merged.entries[entry().key].config == {"num_splits": 2}
    # another GPU's file is not mixed in
    assert len(table.merge(path, GpuKey("other", (9, 0), "x"), [other]).entries) == 1


def test_lookup_uses_the_entry_only_for_its_source_hash(tmp_path, caplog):
    write(tmp_path, [entry(digest="good")])
    assert lookup.load_for_device("cpu", tmp_path) == 1
    assert lookup.tuned("attention.plain.decode", DECODE_BUCKET, "good") == {"num_splits": 3, "block_n": 16}
    with caplog.at_level(logging.DEBUG, logger="kvc.runtime.tuning.lookup"):
        assert lookup.tuned("attention.plain.decode", DECODE_BUCKET, "recompiled") is None
        assert lookup.tuned("attention.plain.decode", buckets.decode(64, 1000, 4, 2, 16, torch.float32), "good") is None
        assert lookup.tuned("moe.fused_experts", DECODE_BUCKET, "good") is None
    text = caplog.text
    assert "stale hash" in text and "no tuned entry" in text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_load_for_device_logs_one_line(tmp_path, caplog):
    write(tmp_path, [entry(), entry(bucket=buckets.decode(8, 1000, 4, 2, 16, torch.float32))])
    with caplog.at_level(logging.INFO, logger="kvc.runtime.tuning.lookup"):
        assert lookup.load_for_device("cpu", tmp_path) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "2 entries loaded" in lines[0] and str(table.path_for(tmp_path, CPU)) in lines[0]


def test_missing_file_and_other_gpu_fall_back_silently(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert lookup.load_for_device("cpu", tmp_path) == 0  # no file
        # a file under this GPU's name but recorded on another GPU (renamed by hand): ignored
        path = table.path_for(tmp_path, CPU)
        table.write(path, table.Table(GpuKey("NVIDIA H200", (9, 0), CPU.triton), {entry().key: entry()}))
        assert lookup.load_for_device("cpu", tmp_path) == 0
    assert lookup.tuned("attention.plain.decode", DECODE_BUCKET, "abc") is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("text, problem", [
    ("{not json", "invalid JSON"),
    ('{"format": 99}', "format 1"),
    ('{"format": 1, "gpu": {"name": "cpu"}, "entries": []}', "bad `gpu`"),
    ('{"format": 1, "gpu": {"name": "cpu", "capability": [0, 0], "triton": "T"}, "entries": [{"kernel": "k"}]}',
     "entry 0"),
])
def test_corrupt_file_warns_naming_it_then_heuristics(tmp_path, caplog, text, problem):
    path = table.path_for(tmp_path, CPU)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace('"T"', json.dumps(CPU.triton)))
    with caplog.at_level(logging.WARNING, logger="kvc.runtime.tuning.lookup"):
        assert lookup.load_for_device("cpu", tmp_path) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and problem in warnings[0]
    assert lookup.tuned("attention.plain.decode", DECODE_BUCKET, "abc") is None


@pytest.mark.parametrize("config, problem", [
    ({"num_splits": 0}, "outside"),
    ({"block_n": 48}, "power of two"),
    ({"block_n": 8}, "outside"),
    ({"num_warps": "4"}, "integer"),
    ({"num_warps": True}, "integer"),
    ({"use_dot": 1}, "no knob"),
    ({}, "non-empty"),
])
def test_bad_knobs_never_reach_a_launch(tmp_path, config, problem):
    path = write(tmp_path, [entry()])
    data = json.loads(path.read_text())
    data["entries"][0]["config"] = config
    path.write_text(json.dumps(data))
    with pytest.raises(table.TableError, match=problem) as err:
        table.read(path)
    assert str(path) in str(err.value)


def test_lazy_load_reads_kvc_tuned_dir(tmp_path, monkeypatch):
    write(tmp_path, [entry(digest="good")])
    monkeypatch.setenv("KVC_TUNED_DIR", str(tmp_path))
    lookup.activate(None)
    assert lookup.tuned("attention.plain.decode", DECODE_BUCKET, "good") == entry().config
