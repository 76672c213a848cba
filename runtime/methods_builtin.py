"""Methods the engine can run without the compiler: `full` (dense attention, every hook a no-op).

`resolve_method` turns `EngineConfig.method` into a `KVMethod`: a built-in name, a shipped method
name (kernels_generated/<method>/, recompiled from methods/<method>.kvm into the compile cache when
stale) or the path of a user's .kvm file (compiled into the cache) — methods_compiled.py.
"""

from __future__ import annotations

from kvc.runtime.errors import ConfigError
from kvc.runtime.method_api import KVMethod, MethodBase


class FullMethod(MethodBase):
    name = "full"


BUILTIN = {"full": FullMethod}


def resolve_method(name: str, params: dict | None = None) -> KVMethod:
    """A built-in method, or a compiled one: a shipped name or a .kvm path (methods_compiled.py)."""
    factory = BUILTIN.get(name)
    if factory is None:
        from kvc.runtime.methods_compiled import resolve_compiled

        return resolve_compiled(name, params, list(BUILTIN))
    if params:
        raise ConfigError(f"method {name!r} takes no parameters, got {sorted(params)}", param="method_params")
    return factory()
