"""Resident weight bytes of one rank: what its modules hold after loading and packing."""

from __future__ import annotations

import torch

from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight
from expertmesh.layers.quantization.permuted import PermutedInputs


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
        packed = getattr(module, "packed", None)
        items = packed if isinstance(packed, list) else [packed]
        fused = getattr(module, "fused", None)
        if fused is not None:
            items = [*items, fused[1], fused[2]]
        # deterministic=True (distributed/fixed_sum.py): a packed weight per fixed chunk
        items += list(getattr(module, "chunk_weights", None) or ())
        items += [w for c in getattr(module, "chunked", None) or () for w in c[1:3]]
        for item in items:
            for w in item if isinstance(item, tuple) else (item,):
                if isinstance(w, PermutedInputs):  # desc_act: the codes and the inputs' order
                    add(w.perm, "quantized")
                    w = w.weight
                if isinstance(w, (QuantizedWeight, QuantizedExperts)):
                    for t in (w.codes, w.scales, w.offsets):
                        add(t, "quantized")
                elif isinstance(w, torch.Tensor):
                    add(w, "dense")
                elif w is not None and isinstance(getattr(w, "data", None), torch.Tensor):
                    add(w.data, "dense")  # a float packed weight (PanelWeight, oneDNN)
    for p in model.parameters():
        add(p.data, "dense")
    counts["total"] = counts["quantized"] + counts["dense"]
    return counts
