"""Resident weight bytes of one rank: what its modules hold after loading and packing."""

from __future__ import annotations

import torch


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def resident_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """{"quantized": bytes of compressed weights (codes, scales, offsets), "dense": bytes of every
    other parameter and packed copy, "total"}; each storage counted once."""
    seen: set[int] = set()
    counts = {"quantized": 0, "dense": 0}

    def add(t: torch.Tensor, kind: str) -> None:
        if not t.numel():
            return
        # oneDNN's packed weights are opaque (no storage to point at): counted by identity
        key = t.data_ptr() if t.layout == torch.strided else id(t)
        if key not in seen:
            seen.add(key)
            counts[kind] += _tensor_bytes(t)

    for module in model.modules():
        # The one form a linear layer's or an expert stack's weights are held in
        # (layers/linear_weight.py, layers/expert_weights.py).
        for form in (getattr(module, "weight_form", None), getattr(module, "experts_form", None)):
            for t, kind in form.resident() if form is not None else ():
                add(t, kind)
    for p in model.parameters():
        add(p.data, "dense")
    counts["total"] = counts["quantized"] + counts["dense"]
    return counts
