"""The `ring` hook fact (compiler/hook_facts.py `ring_form`) and the engine's decode rings that follow from it
(runtime/compiled/step_end.py `decode_ring`; docs/design.md, "Decode rings"): the keep's shape, then what the
engine checks of its counts and inputs."""

from __future__ import annotations

import pytest

from kvc.compiler import cache
from kvc.dsl import METHODS_DIR
from kvc.runtime.methods import resolve_method
from tests.compiler.test_key_local import BASE as KEY_LOCAL, facts_of

SHIPPED = {  # method -> its decode-time keep's hook and ring fact
    "streamingllm": ("step_end", "window"),
    "h2o": ("decode_after_attention", "ranked"),
    "tova": ("decode_after_attention", "ranked"),
    "snapkv": ("step_end", "ranked"),  # the shape rings, its step_end scores do not (below)
    "skipkv": ("step_end", None),  # whole sentences
    "adakv": ("step_end", None),  # counts across KV heads
}

# test_key_local's method, its decode hook's keep varied
BASE = KEY_LOCAL.replace("  seen += {update}\n  keep top(seen, budget, per kv_head) + last 4\n",
                         "  seen += mean(attn, over group)\n{keeps}\n")
assert "{keeps}" in BASE

VARIANTS = {  # the decode hook's keep -> (ring fact, its ring at a 100-token prompt)
    "ranked": ("  keep top(seen, budget, per kv_head) + last 4", "ranked", (16, 21, True)),
    "prompted": ("  keep top(seen, budget + prompt // 10, per kv_head) + last 4", "ranked", (26, 31, True)),
    "growing": ("  keep top(seen, context // 2, per kv_head) + last 4", "ranked", None),  # counts read `context`
    "sinks": ("  keep first 2 + top(seen, budget, per kv_head) + last 4", None, None),  # fixed and ranked slots
}




@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_shipped_keeps_ring_facts(name):
    hook, ring = SHIPPED[name]
    assert facts_of(METHODS_DIR / f"{name}.kvm")[hook]["ring"] == ring


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_ring_fact_and_the_engines_ring(name, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "kvc-cache"))
    keeps, ring, want = VARIANTS[name]
    path = tmp_path / f"{name}.kvm"
    path.write_text(BASE.format(name=name, keeps=keeps))
    assert facts_of(path)["decode_after_attention"]["ring"] == ring
    method = resolve_method(str(path))
    method.bind(2, 2)
    assert method.decode_ring(0, 100) == want  # (ranked slots, + the last 4 and the step's own slot, ranked)
    snapkv = resolve_method("snapkv", {"budget": 16, "window": 4, "every": 1})
    snapkv.bind(2, 2)
    assert snapkv.decode_ring(0, 100) is None  # step_end's own scores from its query window
