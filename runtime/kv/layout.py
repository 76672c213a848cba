"""How the model's attention layers map onto the KV cache's layers (docs/design.md, "Per-head keeps").

Every per-layer structure of the engine (page tables, physical lengths, the page pool's layer keys,
chain records, the decode graphs' buffers, the method's budget and hooks) is indexed by a *cache
layer*. By default a cache layer is a model layer holding all of its KV heads in each page. A method
whose keeps are per KV head and independent across heads (`KVMethod.kv_head_layers`: DuoAttention's
retrieval and streaming heads) stores every KV head as a cache layer of its own: model layer l's
head h is cache layer `l * Hkv + h`, with one KV head, its query group of `Hq / Hkv` heads, and its
own page table. Then a streaming head's table shrinks to its sink + recent tokens and its pages go
back to the pool, while a retrieval head keeps its whole context: the memory saving is real, and
admission sees it through the per-cache-layer budget.

The model runner splits each layer's q/k/v by KV head at the attention call (`split_heads`); nothing
else needs to know.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvc.runtime.errors import ConfigError
from kvc.runtime.kv.spec import StorageClasses


@dataclass(frozen=True)
class CacheLayout:
    model_layers: int
    model_kv_heads: int
    per_head: bool = False  # one cache layer per (model layer, KV head)

    @classmethod
    def of(cls, spec, method) -> CacheLayout:
        """The layout the engine runs `method` with on a model of `spec` (its num_layers, num_kv_heads)."""
        return cls(spec.num_layers, spec.num_kv_heads, method.kv_head_layers)

    def storage(self, spec, method, page_size: int) -> StorageClasses:
        """Each cache layer's KV spec for `method` on a model of `spec`: the method's, over MLA's latent
        cache where the model's values are its keys' latent (`ModelSpec.latent_values`; docs/design.md,
        "MLA")."""
        classes = method.storage_classes(self.layers, self.kv_heads, spec.head_dim, spec.dtype, page_size)
        if spec.latent_values is None:
            return classes
        try:
            return classes.with_latent_values(spec.latent_values)
        except ValueError as e:
            raise ConfigError(f"method {method.name!r} on {spec.architecture}'s latent KV cache: {e}",
                              param="method") from None

    @property
    def layers(self) -> int:
        """Cache layers: the engine's per-layer tables, lengths and budget count these."""
        return self.model_layers * (self.model_kv_heads if self.per_head else 1)

    @property
    def kv_heads(self) -> int:
        """KV heads in one cache layer's pages."""
        return 1 if self.per_head else self.model_kv_heads

    @property
    def heads_per_layer(self) -> int:
        """Cache layers per model layer."""
        return self.model_kv_heads if self.per_head else 1

    def cache_layers(self, layer: int) -> range:
        """The cache layers of model layer `layer`, in KV-head order."""
        n = self.heads_per_layer
        return range(layer * n, (layer + 1) * n)

    def model_head(self, cache_layer: int) -> tuple[int, int]:
        """(model layer, KV head) of a per-head cache layer."""
        return divmod(cache_layer, self.model_kv_heads)
