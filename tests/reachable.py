"""Every tensor reachable from a model (issue 41, point 5): parameters and buffers, and any
attribute, at any depth, that holds a tensor, directly or in a list, tuple, dict or an object of
ours (QuantizedWeight, a fused stack, a kernel's packed panels). The engine's own accounting looks
at the modules' weight forms (`weight_form`, `experts_form`) and parameters only; a leftover float
copy anywhere else shows here."""

from __future__ import annotations

from typing import Any

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    if t.layout != torch.strided or t.is_mkldnn:  # opaque (oneDNN packed): counted by identity
        return id(t), t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def reachable_tensors(root: Any) -> dict[int, tuple[str, int]]:
    """storage -> (the first path that reaches it, its bytes); each storage once."""
    found: dict[int, tuple[str, int]] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("model", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key, nbytes = _storage_key(obj)
            if nbytes and key not in found:
                found[key] = (path, nbytes)
            continue
        if isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("expertmesh"):
            attrs = dict(getattr(obj, "__dict__", {}))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    attrs[slot] = getattr(obj, slot)
            stack += [(f"{path}.{k}", v) for k, v in attrs.items()]
    return found


def reachable_bytes(root: Any) -> int:
    return sum(nbytes for _, nbytes in reachable_tensors(root).values())
