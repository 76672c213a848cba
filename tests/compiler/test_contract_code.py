"""The contract code of a generated hooks.py (compiler/contract_code.py): `query_window(params)` and
`KEEP_TAILS`, which the engine calls instead of evaluating the manifest's text. Oracle: the manifest's
text itself (the kernels' `WINDOW_EXPR`, the hook fact `last`), evaluated as the engine did before."""

from __future__ import annotations

import inspect
import json
import math

import pytest

from kvc.compiler import cache, codegen
from kvc.compiler.cli import OUTPUT_DIR
from kvc.runtime.compiled import budget, decode, folder, method, prefill, state, step_end
from kvc.runtime.methods import resolve_method
from kvc.runtime.compiled.folder import ALL_QUERIES
from kvc.runtime.primitives.torch_primitives import clamp_count

LOWERED = sorted(p.parent.name for p in OUTPUT_DIR.glob("*/manifest.json")
                 if json.loads(p.read_text())["lowered"])
PARAMS = {"snapkv": [{"window": 8}, {"window": 1, "budget": 4}], "pyramidkv": [{"window": 3}],
          "adakv": [{"window": 16}], "h2o": [{"budget": 0, "heavy": 0.2, "recent": 0.3}, {"budget": 9}],
          "streamingllm": [{"budget": 0, "recent": 7}, {"budget": 12, "sink": 2}], "tova": [{"budget": 5}]}


def window_text(manifest: dict, params: dict) -> int:
    """What runtime/compiled/ computed before hooks.py gave it: the prefill_end kernels' WINDOW_EXPR."""
    window = 0
    for kernel in manifest["kernels"]:
        if kernel["hook"] == "prefill_end":
            value = eval(kernel["flags"]["WINDOW_EXPR"], {"floor": math.floor, "ceil": math.ceil}, dict(params))
            if value is None:
                return ALL_QUERIES
            window = max(window, int(value))
    return window


@pytest.mark.parametrize("name", LOWERED)
def test_query_window_and_tails_equal_the_manifest_text(name):
    manifest = json.loads((OUTPUT_DIR / name / "manifest.json").read_text())
    for params in [{}] + PARAMS.get(name, []):
        method = resolve_method(name, params)
        assert method.window == window_text(manifest, method.params), (name, params)
        for hook, fact in manifest["hooks"].items():
            if not fact["keeps"]:
                continue
            for context, prompt, layer in ((10, 10, 0), (300, 250, 3), (4096, 1000, 1)):
                sym = {"context": context, "prompt": prompt, "step": context - prompt, "layer": layer, "layers": 4,
                       "heads": 8, "kv_heads": 2, "head_dim": 16}
                expected = 0 if fact["last"] is None else clamp_count(
                    eval(fact["last"], vars(method.lowering), {**sym, **method.params}), context)
                assert method.kept_tail(hook, sym, context) == expected, (name, hook, params, context)
    assert method.window != 0 or name not in ("snapkv", "pyramidkv", "adakv", "tova")


def test_the_adapter_evaluates_no_text():
    for module in (budget, decode, folder, method, prefill, state, step_end):
        assert "eval(" not in inspect.getsource(module), module.__name__


def test_a_window_names_only_parameters(tmp_path, monkeypatch):
    """`q[last n]` whose n reads a model symbol cannot be a `query_window(params)`: not lowered, said why."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "wide.kvm"
    path.write_text("""method wide : eviction

param budget: tokens = 64 in [1, 1048576]
param window: tokens = 2 in [1, 64]

on prefill_end:
  obs = attention(q[last (window * layers)], k)[first (context - window * layers) along key]
  score = mean(pool(sum(obs, over query), avg, 3, along key), over group)
  keep top(score, budget, per kv_head) + last 4
""")
    manifest = json.loads(codegen.generate(path)["manifest.json"])
    assert not manifest["lowered"] and "layers" in manifest["reason"]


@pytest.mark.parametrize("queries,lowered,reason", [
    ("q[last window]", True, None),
    ("q[last (window * layers)]", False, "layers"),  # the engine sizes the window once: parameters only
    ("q", False, "`q[last n]` only"),  # every query a step has seen: none is kept
])
def test_step_end_reads_the_newest_queries(tmp_path, monkeypatch, queries, lowered, reason):
    """A step_end's `q[last n]` becomes `decode_query_window(params)` (the engine keeps each row's n newest
    queries); another read of the queries is not lowered, said why."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "newest.kvm"
    path.write_text(f"""method newest : eviction

param budget: tokens = 64 in [1, 1048576]
param window: tokens = 3 in [1, 64]

on step_end:
  obs = max(logits({queries}, k), over group)[first (context - window) along key]
  keep top(mean(obs, over query), budget - window, per kv_head) + last window
""")
    files = codegen.generate(path)
    manifest = json.loads(files["manifest.json"])
    assert manifest["lowered"] is lowered, manifest["reason"]
    if lowered:
        source = files["hooks.py"]
        body = source[source.index("def decode_query_window(params):"):].split("\n\n\n")[0]
        namespace: dict = {}
        exec(body, namespace)
        assert namespace["decode_query_window"]({"window": 5}) == 5
    else:
        assert reason in manifest["reason"]


def test_a_periodic_keep_has_its_period():
    """`where step % n == 0` gives the engine n (KEEP_PERIODS: a decode bound for admission); no other where does."""
    from kvc.kernels_generated.rkv import hooks as rkv
    from kvc.kernels_generated.snapkv import hooks as snapkv

    assert rkv.KEEP_PERIODS["step_end"]({"every": 7}) == 7
    # `where every > 0 and step % every == 0`: a parameter switches the keep; 0 when it is off
    assert snapkv.KEEP_PERIODS["step_end"]({"every": 5}) == 5
    assert snapkv.KEEP_PERIODS["step_end"]({"every": 0}) == 0
    assert snapkv.decode_query_window({"every": 0, "window": 32}) == 0
    assert snapkv.decode_query_window({"every": 3, "window": 32}) == 32
    assert "KEEP_PERIODS = {}" in (OUTPUT_DIR / "streamingllm" / "hooks.py").read_text()
