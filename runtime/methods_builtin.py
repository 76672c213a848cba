"""Methods the engine can run without the compiler: `full` (dense attention, every hook a no-op).

`resolve_method` turns `EngineConfig.method` into a `KVMethod`; compiled methods (issue 4) will be
loaded from kernels_generated/<method>/ through the same function.
"""

from __future__ import annotations

from kvc.runtime.errors import ConfigError
from kvc.runtime.method_api import KVMethod, MethodBase


class FullMethod(MethodBase):
    name = "full"


BUILTIN = {"full": FullMethod}


def resolve_method(name: str) -> KVMethod:
    factory = BUILTIN.get(name)
    if factory is None:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(BUILTIN)}", param="method")
    return factory()
