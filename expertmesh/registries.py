"""One lookup for every name registry (norms, routers, activations, rope types, ...)."""

from __future__ import annotations

from typing import Any


def lookup(registry: dict, name: str, what: str) -> Any:
    """registry[name], or a ValueError naming the unknown name and the known ones."""
    if name not in registry:
        raise ValueError(f"{what} {name!r} is not known; known: {sorted(registry)}")
    return registry[name]
