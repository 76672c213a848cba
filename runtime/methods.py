"""`EngineConfig.method` -> a `KVMethod`: every method, `full` included, is compiled code.

A name resolves to kernels_generated/<name>/ (recompiled from methods/<name>.kvm into the compile
cache when stale), a path to a user's .kvm file compiled on start, a folder to the method
`kvc compile FILE --out DIR` wrote there (checked, never recompiled); `runtime/compiled/` adapts
the generated code to the lifecycle contract. `full` is `methods/full.kvm`: a method with no
hooks, so the engine calls nothing and keeps every token (prefix caching on).
"""

from __future__ import annotations

from kvc.runtime.method_api import KVMethod


def resolve_method(name: str, params: dict | None = None) -> KVMethod:
    """The method named `name` (or compiled from the .kvm path, or found in the folder, `name`) with
    `params` checked."""
    from kvc.runtime.compiled.method import resolve_compiled

    return resolve_compiled(name, params)
