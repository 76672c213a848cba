"""The `key_local` hook fact (compiler/hook_facts.py) and what the engine makes of it: a key-local
decode_after_attention keeps its state in paged planes and its decode steps are graph-capturable;
one that looks across keys (pooling) or reads a per-row symbol (`step`) keeps the per-row eager
path."""

from __future__ import annotations

import json

import pytest

from kvc.compiler import cache, codegen
from kvc.dsl import METHODS_DIR
from kvc.runtime.errors import ConfigError
from kvc.runtime.methods import resolve_method
from kvc.runtime.compiled.folder import available

BASE = """method {name} : eviction

param budget: tokens = 16 in [1, 1048576]

state seen: [kv_head, key] = 0

on prefill_chunk:
  seen += sum(mean(attn, over group), over query)

on prefill_end:
  keep top(seen, budget, per kv_head) + last 4

on decode_after_attention:
  seen += {update}
  keep top(seen, budget, per kv_head) + last 4
"""

UPDATES = {
    "scaled": ("mean(attn, over group) * budget", True),  # a parameter is the same for every row
    "pooled": ("pool(mean(attn, over group), max, 3, along key)", False),  # looks at neighbouring keys
    "stepped": ("mean(attn, over group) * step", False),  # `step` differs per row
}


def facts_of(path) -> dict:
    return json.loads(codegen.generate(path)["manifest.json"])["hooks"]


@pytest.mark.parametrize("name", sorted(UPDATES))
def test_key_local_fact_and_the_engine_path(name, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "kvc-cache"))
    update, local = UPDATES[name]
    path = tmp_path / f"{name}.kvm"
    path.write_text(BASE.format(name=name, update=update))
    assert facts_of(path)["decode_after_attention"]["key_local"] is local
    method = resolve_method(str(path))
    assert method.paged_state is local and method.decode_graphs is local
    assert method.state_planes == (("seen", "decode_after_attention.scores") if local else ())


# served methods that decode eagerly, with the reason (each one is a next step, not a design)
EAGER: dict[str, str] = {}


def test_every_served_method_decodes_in_graphs():
    assert facts_of(METHODS_DIR / "h2o.kvm")["decode_after_attention"]["key_local"]
    assert facts_of(METHODS_DIR / "tova.kvm")["decode_after_attention"]["key_local"]
    for name in available():
        try:
            method = resolve_method(name)
        except ConfigError:  # not lowered yet: no engine runs it
            continue
        assert method.decode_graphs is (name not in EAGER), name
