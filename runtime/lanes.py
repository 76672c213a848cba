"""Several KV methods in one engine: its lanes (docs/design.md, "Many methods in one batch").

A *lane* is one method the engine runs, bound to the model with its parameters: its storage
classes over the pool's, the scheduler's facts of it (`LaneRules`: budget, compactions, rows,
prefix caching), its hooks and replay pass. Every request runs in one lane (`Sequence.lane`), so
admission, growth, preemption and chains follow its own method; the model runner sends a step's
rows to their lanes' attention groups (runtime/spec_group.py) in one forward pass.

Storage: the lanes' storage classes map onto the pool's classes; equal specs (with equal LAYER
inputs) are one class, so lanes of one storage share stores, pages and the prefix cache (their
prefix salt is the storage's, not the method's). The KV budget is split evenly among the lanes
loaded at start, each share over its own classes as one method's would be; lanes sharing a class
pool their shares. A lane made for a request's parameters (`Engine.lane_for`) must store K/V as a
loaded lane of its method does: it takes that lane's classes and no memory of its own.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvc.runtime.attention.backend import class_pages
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv.ring import Rings
from kvc.runtime.kv.spec import Extent, KVSpec, StorageClasses
from kvc.runtime.method_api import Hook, KVMethod
from kvc.runtime.scheduler import LaneRules

if TYPE_CHECKING:
    from kvc.runtime.context_replay import ContextReplay
    from kvc.runtime.spec_group import SpecGroup
    from kvc.runtime.step_hooks import StepHooks

MAX_REQUEST_LANES = 16  # lanes made for requests' parameters, at most (each holds a bound method and its hooks)


@dataclass(eq=False)
class Lane:
    name: str  # the method's name, as requests choose it
    params: dict[str, Any]  # the parameters a request gave (empty: the loaded ones)
    method: KVMethod
    storage: StorageClasses  # the method's per-layer specs over the model
    layer_class: tuple[int, ...]  # each cache layer's pool class
    rules: LaneRules
    fingerprint: str  # model + method + parameters: a chain recorded here continues only here
    loaded: bool = True  # loaded at start (listed by the server), else made for a request's parameters
    attention: Any = None  # its layers' paged attention over the pool's stores (runtime/attention/backend.py)
    hooks: StepHooks | None = None
    replay: ContextReplay | None = None  # its pass re-reading each prompt after prefill (runtime/context_replay.py)
    counts: dict[str, int] = field(default_factory=lambda: {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0})

    _group: Any = field(default=None, repr=False)  # a weak reference: the group holds its lanes

    @property
    def group(self) -> SpecGroup | None:
        """Its attention group (runtime/spec_group.py; the group sets it). Held weakly, so that an engine
        nothing references is freed at once, its KV tensors with it, without waiting for a cycle collection."""
        return None if self._group is None else self._group()

    @group.setter
    def group(self, group: SpecGroup) -> None:
        self._group = weakref.ref(group)

    @property
    def key(self) -> str:
        """The lane's name in metrics and errors: the method, with the request's parameters if any."""
        if not self.params:
            return self.name
        return f"{self.name}({','.join(f'{k}={json.dumps(v)}' for k, v in sorted(self.params.items()))})"


@dataclass
class PoolClasses:
    """The pool's storage classes: one per distinct (spec, LAYER inputs digest) of the lanes' layers."""

    specs: list[KVSpec] = field(default_factory=list)
    keys: list[tuple] = field(default_factory=list)

    def classes_of(self, storage: StorageClasses, inputs_digest: str, add: bool = True) -> tuple[int, ...] | None:
        """Each layer's pool class for `storage` (new classes appended where `add`; else None when one is missing)."""
        out = []
        for spec in storage.specs:
            key = (spec, inputs_digest if _has_layer_inputs(spec) else "")
            if key not in self.keys:
                if not add:
                    return None
                self.keys.append(key)
                self.specs.append(spec)
            out.append(self.keys.index(key))
        return tuple(out[c] for c in storage.layer_class)


def pool_pages(kv_bytes: int, storages: list[StorageClasses], lane_classes: list[tuple[int, ...]], num_classes: int,
               kv_heads: int, page_size: int) -> list[int]:
    """Pages of each pool class `kv_bytes` buy: an even share per lane, each share over the lane's own
    classes as one method's would be (`class_pages`: they run out together when every layer stores as
    many tokens); lanes sharing a class pool their shares (one lane: exactly one method's pool)."""
    pages = [0] * num_classes
    share = kv_bytes // len(storages)
    for storage, classes in zip(storages, lane_classes):
        for c, n in enumerate(class_pages(share, storage, kv_heads, page_size)):
            pages[classes[storage.layers(c)[0]]] += n
    return pages


def _has_layer_inputs(spec: KVSpec) -> bool:
    return any(t.extent is Extent.LAYER for t in spec.tensors)


def lane_rules(method: KVMethod, attention, prefix_caching: bool, salt: bytes, rings: bool = True) -> LaneRules:
    """The scheduler's facts of a lane whose layers' stores are `attention`'s (runtime/attention/backend.py).
    Prefix caching (docs/design.md, "Many methods in one batch"): a method that keeps every computed
    token names its full pages and takes hits; one that compacts at prefill end only (SnapKV and kin)
    takes hits of the dense prefix other lanes of its storage named, up to its query window, and names
    none (its pages are cut); one that compacts while prefilling or decoding, or reads every prefill
    query, neither. A delta code's pages lean on its row: no caching. `rings`: a window keep at every step
    may ring (runtime/kv/ring.py; `EngineConfig.decode_rings`)."""
    cuts = method.compacts or method.rewrites  # writes into pages before the newest
    drops = method.compacts  # stored tokens stop matching the prompt
    decode_drops = drops and Hook.STEP_END in method.hooks
    window = getattr(method, "query_window", 0)
    ringed = None
    if rings and Hook.STEP_END in method.hooks:
        ringed = Rings.of_method(method.decode_ring, len(attention.layer_class))
    return LaneRules(
        budget=method.budget,
        layer_class=attention.layer_class,
        compacts_prefill=cuts and Hook.PREFILL_END in method.hooks,
        compacts_decode=cuts and Hook.STEP_END in method.hooks,
        compacts_chunks=method.chunk_keeps,
        rows=any(s.spec.uses_rows for s in attention.used),
        residual=attention.residual_window,
        window_after=attention.window_after,
        flush_block=attention.flush_block,
        prefix_caching=prefix_caching and not any(s.spec.delta is not None for s in attention.used),
        registers=not drops,
        hit_margin=0 if not drops else (-1 if decode_drops or method.chunk_keeps or window < 0 else window),
        salt=salt,
        rings=ringed,
    )


def storage_salt(model_ref: str, model_spec, pool: PoolClasses, layer_class: tuple[int, ...]) -> bytes:
    """The prefix-cache salt of a lane: the model and the storage of each of its layers (not the method:
    lanes of one storage share a dense prefix)."""
    key = repr([pool.keys[c] for c in layer_class])
    return hashlib.blake2b(f"{model_ref}|{key}|{model_spec}".encode(), digest_size=16).digest()


def method_fingerprint(model_ref: str, model_spec, method: KVMethod) -> str:
    """model + method + parameters (+ generated source): what a chain record must match to continue."""
    return hashlib.sha256(f"{model_ref}|{method.fingerprint}|{model_spec}".encode()).digest()[:16].hex()


def requested(method: str | None, params: dict | None, default: str) -> tuple[str, dict]:
    """(name, parameters) a request asks for; ConfigError naming the bad field."""
    if method is not None and (not isinstance(method, str) or not method):
        raise ConfigError(f"method must be a method's name, got {method!r}", param="method")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"method parameters must be an object, got {params!r}", param="method_params")
    return method or default, dict(params or {})
