"""`--evict-interval N` on the command line: `kvc generate`, `kvc serve` and `kvc bench throughput`
take it into `EngineConfig.evict_interval` (and the throughput plan); bad values are argparse
errors naming the flag, never a traceback."""

from __future__ import annotations

import json

import pytest

from kvc.runtime.bench.throughput import ThroughputConfig
from kvc.runtime.cli import _engine_options, build_parser, main
from kvc.runtime.errors import ConfigError

COMMANDS = {
    "generate": ["generate"],
    "serve": ["serve"],
    "bench throughput": ["bench", "throughput", "--kv-memory", "1GiB"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_flag_parses_with_default_one(command):
    parser = build_parser()
    assert parser.parse_args(COMMANDS[command]).evict_interval == 1
    assert parser.parse_args(COMMANDS[command] + ["--evict-interval", "16"]).evict_interval == 16


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value", ["0", "-1", "x", "2.5"])
def test_bad_values_are_clear_errors(command, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(COMMANDS[command] + ["--evict-interval", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --evict-interval: must be an integer >= 1 (1: evict at every step), got '{value}'" in err
    assert "Traceback" not in err


def test_generate_and_serve_pass_it_to_the_engine_config(monkeypatch):
    a = build_parser().parse_args(["generate", "--evict-interval", "8"])
    assert _engine_options(a)["evict_interval"] == 8
    import kvc.runtime.server.launch as launch

    configs = []
    monkeypatch.setattr(launch, "serve", lambda cfg, **kw: configs.append(cfg) or 0)
    monkeypatch.delenv("KVC_API_KEY", raising=False)
    assert main(["serve", "--method", "streamingllm", "--evict-interval", "16"]) == 0
    assert configs[-1].evict_interval == 16 and configs[-1].method == "streamingllm"


def test_bench_throughput_passes_it_to_the_run(monkeypatch):
    import kvc.runtime.bench.throughput as throughput

    seen = []

    def fake_run(cfg, progress, on_row, on_partial=None):
        seen.append(cfg)
        return {"rows": []}

    monkeypatch.setattr(throughput, "run", fake_run)
    monkeypatch.setattr("kvc.runtime.bench.result.format_table", lambda result: "")
    assert main(["bench", "throughput", "--kv-memory", "1GiB", "--evict-interval", "16", "--no-progress"]) == 0
    assert seen[-1].evict_interval == 16
    with pytest.raises(ConfigError, match="evict_interval must be a positive integer"):
        ThroughputConfig(methods=["streamingllm"], inputs=[64], kv_memory=2**20, evict_interval=0)


def test_generate_runs_with_an_interval(capsys):
    """`kvc generate --method streamingllm --evict-interval 4` end to end on the CPU."""
    assert main(["generate", "--model", "random:tiny", "--prompt-ids", " ".join(str(t) for t in range(3, 43)),
                 "--max-tokens", "20",
                 "--json", "--max-model-len", "256", "--ignore-eos", "--method", "streamingllm",
                 "--method-param", "sink=4", "--method-param", "recent=8", "--evict-interval", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 20 and out["finish_reason"] == "length"
