"""Quantized weights whose inputs are held in another order: GPTQ's desc_act (act-order).

A desc_act checkpoint assigns input i to group g_idx[i] in an arbitrary order (inputs sorted by
the Hessian's diagonal while quantizing), so a group's inputs are scattered over the row. Sorting
a rank's inputs by g_idx (stable) makes every group contiguous: codes held at column j are input
perm[j]'s, and the product gathers the activation's columns the same way first, W x =
W[:, perm] x[perm]. One index_select a product, no rounding (the same sums, in another order).

Per rank (`input_order`): the permutation is of the rank's own slice of the inputs (row-parallel
TP cuts the input dim), so each group a rank's inputs touch must lie wholly inside that slice and
hold `group` inputs (the last group may hold fewer): otherwise the tensor is not held (logged
with the reason) and is dequantized at load.
"""

from __future__ import annotations

from typing import Any

import torch


def input_order(g_idx: torch.Tensor, i0: int, i1: int, group: int, groups: int) -> torch.Tensor | None:
    """The stable sort of inputs [i0, i1) by group, or None where a group they touch lies partly
    outside them, or a group but the last holds other than `group` inputs."""
    every = torch.bincount(g_idx, minlength=groups)
    local = g_idx[i0:i1]
    here = torch.bincount(local, minlength=groups)
    touched = here > 0
    if not bool((here[touched] == every[touched]).all()):
        return None  # a group spans this slice's edge (another rank holds part of it)
    sizes = here[touched]
    if sizes.numel() and not bool((sizes[:-1] == group).all() and sizes[-1] <= group):
        return None
    return torch.sort(local, stable=True).indices


def slices_order_key(g_idx: torch.Tensor, local_in: int, group: int, groups: int) -> bytes | None:
    """What every rank's slice of `local_in` inputs would hold (equal for parts that share their
    inputs' order, as q / k / v and gate / up do in GPTQ), or None where some slice cuts a group."""
    full = g_idx.numel()
    if local_in <= 0 or full % local_in:
        return None
    for i0 in range(0, full, local_in):
        if input_order(g_idx, i0, i0 + local_in, group, groups) is None:
            return None
    return g_idx.to(torch.int32).numpy().tobytes() + local_in.to_bytes(8, "little")


class PermutedInputs:
    """A QuantizedWeight over inputs held in the order `perm`: x's columns gathered first."""

    def __init__(self, weight: Any, perm: torch.Tensor) -> None:
        self.weight, self.perm = weight, perm.to(torch.int64).contiguous()
        self.kind, self.group = weight.kind, weight.group
        self.out_features, self.in_features = weight.out_features, weight.in_features

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return self.weight.apply(x.index_select(-1, self.perm.to(x.device)), bias, out_dtype)

    __call__ = apply

    def dequantize(self) -> torch.Tensor:
        """The [out, in] float32 weight in the checkpoint's input order."""
        held = self.weight.dequantize()
        out = torch.empty_like(held)
        out[:, self.perm] = held
        return out

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.perm.numel() * self.perm.element_size()

    def slot_tensors(self) -> list[torch.Tensor]:
        """What EPLB moves of this expert's weight: the codes' tensors and the input order."""
        return [*self.weight.slot_tensors(), self.perm]

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> None:
        return None  # the native decode GEMM slot takes no gather: this layer stays in Python

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [*self.weight.resident(), (self.perm, "quantized")]


def one_form(weights: list[Any]) -> list[Any]:
    """Experts of one stack where some are held permuted (desc_act; an expert whose groups are in
    order is not): the others permuted by the identity (the same products), so that every slot
    holds the same tensors and EPLB can move any expert into any slot."""
    if not any(isinstance(w, PermutedInputs) for w in weights):
        return weights
    ordered = lambda w: PermutedInputs(w, torch.arange(w.in_features))  # noqa: E731
    return [w if isinstance(w, PermutedInputs) else ordered(w) for w in weights]
