"""`kvc eval` (runtime/eval/): which settings a run covers, a result written after every cell and
continued after an interruption, the multi-turn task served through chains, the table and the plot,
clear errors; and a small real run on the embedded default model, where `full` answers every case.

Mechanics run on `random:tiny` (its answers are noise; only the real-model test reads accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvc.runtime.errors import ConfigError
from kvc.runtime.eval import report
from kvc.runtime.eval.runner import EvalConfig, Evaluation, Setting, settings_for

TINY = dict(model="random:tiny", device="cpu", cases=2, batch=4)


def test_settings_cover_every_budget_of_budgeted_methods() -> None:
    cfg = EvalConfig(methods=["full", "snapkv", "h2o"], budgets=[64, 128], **TINY)
    assert [s.label for s in settings_for(cfg)] == ["full", "snapkv@64", "snapkv@128", "h2o@64", "h2o@128"]
    assert settings_for(cfg)[1].method_params == {"budget": 64}
    with_window = EvalConfig(methods=["snapkv"], budgets=[64], method_params={"window": 8}, **TINY)
    assert settings_for(with_window)[0].method_params == {"budget": 64, "window": 8}
    layers = EvalConfig(methods=["kivi"], method_params={"dense_layers": [0, 1]}, **TINY)
    (kivi,) = settings_for(layers)  # a list parameter: the setting still keys the run's dicts
    assert {kivi: 1}[kivi] == 1 and kivi.method_params["dense_layers"] == [0, 1]
    # a parameter goes to the methods that declare it: kvzip's ratio, not full's or snapkv's
    mixed = settings_for(EvalConfig(methods=["full", "snapkv", "kvzip"], budgets=[64], method_params={"ratio": 0.25},
                                    **TINY))
    assert [s.method_params for s in mixed] == [{}, {"budget": 64}, {"ratio": 0.25}]
    with pytest.raises(ConfigError, match="ratiio belong to none"):
        settings_for(EvalConfig(methods=["full", "kvzip"], method_params={"ratiio": 0.25}, **TINY))


def test_bad_configurations_fail_before_any_work() -> None:
    with pytest.raises(ConfigError, match="unknown task"):
        EvalConfig(tasks=["nope"], **TINY)
    with pytest.raises(ConfigError, match="positive integers"):
        EvalConfig(budgets=[0], **TINY)
    with pytest.raises(ConfigError, match="unknown method"):
        settings_for(EvalConfig(methods=["nosuchmethod"], **TINY))
    with pytest.raises(ConfigError, match="budget"):  # snapkv's own range check: budget >= 1
        settings_for(EvalConfig(methods=["snapkv"], budgets=[10**9], **TINY))
    with pytest.raises(ConfigError, match="random:NAME"):
        Evaluation(EvalConfig(tasks=["passkey"], lengths=[256], **{**TINY, "model": "random:qwen3-0.6b"}))
    with pytest.raises(ConfigError, match="evict_interval"):
        EvalConfig(evict_interval=0, **TINY)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run over two settings and two tasks (one of them multi-turn), with every cell recorded."""
    cfg = EvalConfig(methods=["full", "snapkv"], budgets=[48], tasks=["passkey", "multiturn"], lengths=[640], **TINY)
    evaluation = Evaluation(cfg)
    out = tmp_path_factory.mktemp("eval") / "result.json"
    result = report.header(evaluation)
    seen: list[int] = []

    def on_cell(cell: dict) -> None:
        result["cells"].append(cell)
        report.write_json(out, result)
        seen.append(len(json.loads(out.read_text())["cells"]))

    evaluation.run(on_cell)
    return cfg, evaluation, out, result, seen


def test_every_cell_is_on_disk_as_soon_as_it_is_done(tiny_run) -> None:
    cfg, evaluation, out, result, seen = tiny_run
    assert seen == [1, 2, 3, 4]  # the file grew cell by cell
    cells = json.loads(out.read_text())["cells"]
    assert {(c["method"], c["budget"], c["task"]) for c in cells} == {
        ("full", None, "passkey"), ("full", None, "multiturn"), ("snapkv", 48, "passkey"), ("snapkv", 48, "multiturn")}
    for c in cells:
        assert c["n"] == evaluation.items(c["task"], c["length"]) == len(c["items"])
        assert c["correct"] == sum(i["correct"] for i in c["items"])
        assert 0.0 <= c["ci95"][0] <= c["accuracy"] <= c["ci95"][1] <= 1.0


def test_multi_turn_questions_reuse_the_chain(tiny_run) -> None:
    _, evaluation, _, result, _ = tiny_run
    for cell in result["cells"]:
        if cell["task"] != "multiturn":
            continue
        case = evaluation.cases["multiturn", 640][0]
        assert len(case.turns) >= 1 and cell["n"] == len(evaluation.cases["multiturn", 640]) * (1 + len(case.turns))
        for item in cell["items"]:
            if item["turn"] == 0:
                assert item["cached_tokens"] == 0
            else:  # the earlier turns' history was served from the chain, not prefilled again
                assert item["cached_tokens"] >= len(case.prompt), (cell["method"], item)


def test_an_interrupted_run_continues_where_it_stopped(tiny_run, tmp_path, monkeypatch) -> None:
    cfg, evaluation, out, result, _ = tiny_run
    partial = {**result, "cells": result["cells"][:3]}
    path = tmp_path / "partial.json"
    report.write_json(path, partial)
    again = Evaluation(cfg)
    again.done = report.load_previous(path, report.header(again))
    assert len(again.pending()) == 1
    ran: list[tuple] = []
    real = Evaluation._run_kvc

    def spy(self, settings, task, length, on_cell, on_items):
        ran.append(([s.label for s in settings], task))
        return real(self, settings, task, length, on_cell, on_items)

    monkeypatch.setattr(Evaluation, "_run_kvc", spy)
    again.run()
    last = result["cells"][3]
    assert ran == [([Setting(last["method"], last["budget"]).label], last["task"])]
    for changed in ({"seed": cfg.seed + 1}, {"evict_interval": 64}):  # another run: never mixed into this file
        with pytest.raises(ConfigError, match="holds another run"):
            report.load_previous(path, dict(report.header(again), **changed))


def test_shared_prefills_give_the_answers_of_separate_ones(tiny_run) -> None:
    """One prefill per case replayed into every setting = every engine running the model itself."""
    cfg, _, _, result, _ = tiny_run
    separate = Evaluation(EvalConfig(**{**cfg.__dict__, "share_prefill": False})).run()
    answers = {(c["method"], c["budget"], c["task"]): [(i["output"], i["cached_tokens"]) for i in c["items"]]
               for c in separate}
    for c in result["cells"]:
        assert [(i["output"], i["cached_tokens"]) for i in c["items"]] == answers[c["method"], c["budget"], c["task"]]


def test_decode_eviction_deferred_past_the_answers(tiny_run) -> None:
    """--evict-interval larger than any answer: a decode-evicting method keeps its prefill-end
    cache while it answers (kvpress's semantics), so its answers are those of an engine that never
    evicts while decoding; at interval 1 the engine evicts at every step."""
    cfg = EvalConfig(methods=["streamingllm"], budgets=[48], tasks=["passkey"], lengths=[640],
                     evict_interval=1 << 20, **TINY)
    evaluation = Evaluation(cfg)
    cells = evaluation.run()
    llm = evaluation._llm(evaluation.settings[0])
    assert llm.engine.method.evict_interval == 1 << 20
    assert Evaluation(EvalConfig(**{**cfg.__dict__, "evict_interval": 1}))._llm(
        evaluation.settings[0]).engine.method.evict_interval == 1
    assert [c["n"] for c in cells] == [cfg.cases]


def test_table_and_plot(tiny_run, tmp_path) -> None:
    _, _, _, result, _ = tiny_run
    table = report.markdown(result).splitlines()
    assert table[0] == "| method | passkey 640 | multiturn 640 |"
    assert table[2].startswith("| full | ") and table[3].startswith("| snapkv@48 | ")
    assert all("n=" in row for row in table[2:])
    pytest.importorskip("matplotlib")
    report.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_are_clear(capsys, tmp_path) -> None:
    from kvc.runtime.cli import main

    assert main(["eval", "--model", "random:tiny", "--tasks", "nope", "--out", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert "unknown task" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["eval", "--budgets", "0"])
    assert e.value.code == 2


@pytest.mark.real_model
def test_real_model_subset(real_model_dir: Path, tmp_path: Path, capsys) -> None:
    """CI's slice of the table: full answers every passkey at 1K; snapkv at 128 runs beside it."""
    from kvc.runtime.cli import main

    out = tmp_path / "eval.json"
    args = ["eval", "--methods", "full,snapkv", "--budgets", "128", "--tasks", "passkey", "--lengths", "1024",
            "--cases", "4", "--device", "cpu", "--out", str(out), "--markdown", str(tmp_path / "t.md")]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and result["model_path"] == str(real_model_dir)
    cells = {(c["method"], c["budget"]): c for c in result["cells"]}
    assert cells["full", None]["accuracy"] == 1.0 and cells["full", None]["n"] == 4
    assert cells["snapkv", 128]["n"] == 4
    assert "| full | 100 [" in capsys.readouterr().out
