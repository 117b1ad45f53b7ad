"""Quantized checkpoint weights held compressed as stored: int codes, scales and offsets read
straight into `QuantizedWeight` / `QuantizedExperts`, no float copy of the weight, no re-rounding.

GPTQ (groups in order), AWQ and compressed-tensors int4 / int8 map exactly onto our kinds:
W = (q - z) * s = q * s + (-z * s), so codes are q (symmetric int4 shifted by 8 into uint4),
scales s and offsets -z * s per group. A logical tensor that can do this says so (`held_kind`:
(kind, group)) and serves `quantized(bounds)`: codes [o, i] uint8, scales and offsets [o, G].

How it reaches the layers without touching their loaders: before loading, each parameter whose
every checkpoint source is held (one kind and group), of a module that takes quantized weights,
is swapped for uint8 storage of its shape; the loaders copy codes into it exactly as they would
copy floats (any TP / EP slice), and `copy_into` hands each copy's destination to the codes'
`on_copy`, which puts the scales and offsets at the same rows of the parameter's side tensors.
After loading, each module holds them (`hold_quantized`). A parameter whose rank slice of the
inputs would cut a group is not held. GPTQ's desc_act is held with each rank's inputs sorted by
group (the region carries the order; the weight gathers its activation: quantization/permuted.py)
where every rank's groups are whole and a fused parameter's parts share one order. MXFP4's experts
(quantization/mxfp4.py) load into int16 storage, code and block exponent together, split after
loading (`split_exponents`). Anything else (mixed kinds in one fused parameter, a family hook
after loading) is dequantized at load as before (logged with the reason).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from expertmesh.layers.ops import Ops
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight
from expertmesh.layers.quantization.permuted import PermutedInputs
from expertmesh.layers.quantization.view import CodesRegion, LogicalTensor, local_groups

log = logging.getLogger("expertmesh")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class HeldParam:
    """One parameter filled with codes; its scales and offsets collected beside it."""

    name: str
    kind: str
    group: int
    shape: tuple[int, ...]
    scales: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    local_group: int = 0
    exponents: bool = False  # int16 storage: code | e8m0 exponent << 4 (MXFP4, quantization/mxfp4.py)
    zero_offsets: bool = False  # every source's offsets zero by its format (GGUF Q6_K): shared zeros
    perms: dict[int, torch.Tensor] = field(default_factory=dict)  # desc_act: input order per expert
    # GGUF MXFP4 blocks of a streamed expert as read, (first row, [rows, G, 17]) a region
    # (mxfp4_blocks.py); None: not collected (written as int16)
    blocks: list[tuple[int, Any]] | None = None

    def place(
        self, dst: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int, perm=None
    ) -> None:
        rows_in = self.shape[-1]
        if dst.shape[-1] != rows_in or dst.stride(-1) != 1 or (dst.dim() > 1 and dst.stride(-2) != rows_in):
            raise RuntimeError(f"{self.name}: codes copied into a region that is not whole rows")
        if self.scales is None:
            side = (*self.shape[:-1], scales.shape[-1])
            self.scales, self.offsets, self.local_group = torch.zeros(side), torch.zeros(side), group
        row = dst.storage_offset() // rows_in  # rows of the flattened [..., O, I] parameter before dst
        groups = self.scales.shape[-1]
        flat_s, flat_m = self.scales.view(-1, groups), self.offsets.view(-1, groups)
        n = dst.numel() // rows_in
        flat_s[row : row + n] = scales.reshape(n, -1)
        flat_m[row : row + n] = offsets.reshape(n, -1)
        if perm is not None:  # desc_act: the inputs' order, one per expert (plan() made parts agree)
            self.perms[row // self.shape[-2] if len(self.shape) > 2 else 0] = perm


@dataclass
class HeldWeights:
    """Which parameters are held, by their storage (what `on_copy` sees of a destination)."""

    params: dict[str, HeldParam] = field(default_factory=dict)
    by_storage: dict[int, HeldParam] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)  # checkpoint keys served as codes
    streamed: set[str] = field(default_factory=set)  # held by their modules while loading (streaming.py)

    def on_copy(self, dst: torch.Tensor, region: Any) -> None:
        held = self.by_storage.get(dst.untyped_storage().data_ptr())
        if held is None:
            raise RuntimeError("held codes copied into a parameter that is not held")
        if hasattr(region, "place_into"):  # MXFP4 blocks: written by the region itself
            region.place_into(held, dst)
            return
        held.place(dst, region.scales, region.offsets, region.group, region.perm)


def _module_of(model: Any, name: str) -> Any:
    return model.get_submodule(name.rpartition(".")[0])


def plan(model: Any, view: Any, targets_of: Any) -> HeldWeights:
    """Swap every fully held parameter for uint8 storage. `targets_of(key)`: the (parameter, read
    as is) pairs a checkpoint key fills; a picked part of a fused tensor is not held."""
    params = dict(model.named_parameters())
    kinds: dict[str, set] = {}
    storage: dict[str, torch.dtype] = {}
    zero: dict[str, bool] = {}  # parameter -> every held source's offsets zero by its format
    orders: dict[tuple, set] = {}  # (parameter, expert): the input orders its parts are held in
    reasons: Counter = Counter()
    fills: dict[str, list[str]] = {}
    for key, _ in view.keys():
        targets = targets_of(key)
        if not targets:
            continue
        fills[key] = [name for name, _ in targets]
        src = view.get_slice(key)
        logical = isinstance(src, LogicalTensor)  # else a plain safetensors slice: floats, never held
        kind = src.held_kind if logical else None
        if logical and kind is None and src.unheld_reason:  # the source says why (GGUF's types)
            reasons[src.unheld_reason] += 1
        full = (src.held_in if logical else None) or src.get_shape()[-1]
        for name, as_is in targets:
            as_is = as_is or (logical and src.held_through_picks)
            cut = name in params and _cuts_groups(kind, params[name].shape[-1], full)
            if cut:
                local = params[name].shape[-1]
                reasons[f"a rank's {local} of {full} inputs cut groups of {kind[1]}"] += 1
            kinds.setdefault(name, set()).add(kind if as_is and not cut else None)
            if kind is not None:
                storage[name] = src.held_storage
                zero[name] = zero.get(name, True) and src.held_zero_offsets
            if kind is not None and name in params:
                order = src.held_input_order(params[name].shape[-1])
                if order is None:
                    reasons["desc_act groups a rank's slice of the inputs would cut"] += 1
                    kinds[name].add(None)
                orders.setdefault((name, _expert_of(key)), set()).add(order)
    held = HeldWeights()
    for name, found in kinds.items():
        if name not in params or None in found:
            continue
        module = _module_of(model, name)
        if not getattr(module, "quantizable", False) or _relaid_after_loading(model, name):
            reasons["a module that does not take quantized weights"] += 1
            continue
        if len(found) > 1:
            reasons[f"one parameter from several schemes {sorted(found)}"] += 1
            continue
        if any(len(o) > 1 for (n, _), o in orders.items() if n == name):
            reasons["parts of one parameter in different input orders (desc_act)"] += 1
            continue
        (kind,) = found
        param = params[name]
        dtype = storage.get(name, torch.uint8)
        param.data = torch.empty(param.shape, dtype=dtype, device=param.device)
        held.params[name] = HeldParam(
            name, kind[0], kind[1], tuple(param.shape), exponents=dtype == torch.int16,
            zero_offsets=zero.get(name, False),
        )  # fmt: skip
        held.by_storage[param.data.untyped_storage().data_ptr()] = held.params[name]
    _pair_experts(model, held, params)
    held.keys = {key for key, names in fills.items() if all(n in held.params for n in names)}
    if held.params:
        log.info("weights held compressed as stored: %d parameters", len(held.params))
    for reason, count in reasons.items():
        log.info("weights dequantized at load, not held compressed: %d tensors (%s)", count, reason)
    view.held = held
    return held


def _cuts_groups(kind: tuple[str, int] | None, local_in: int, full_in: int) -> bool:
    """A rank holding `local_in` of `full_in` inputs (at a multiple of local_in) splits a group."""
    if kind is None or not kind[1] or kind[1] >= full_in or local_in == full_in:
        return False
    return local_in % kind[1] != 0


def _relaid_after_loading(model: Any, name: str) -> bool:
    """A module above lays this weight out anew after loading (MLA splits kv_b_proj): every
    child, unless it names the ones it takes (`relaid_after_loading`)."""
    parts = name.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        module = model.get_submodule(".".join(parts[:i]))
        if hasattr(module, "process_weights_after_loading"):
            taken = getattr(module, "relaid_after_loading", None)
            if taken is None or (i < len(parts) and parts[i] in taken) or i == len(parts):
                return True
    return False


def _pair_experts(model: Any, held: HeldWeights, params: dict) -> None:
    """Routed experts run one kind for both projections: hold both or neither."""
    for name in list(held.params):
        if not name.endswith(".w13"):
            continue
        other = held.params.get(name[:-4] + ".w2")
        if other is None or other.kind != held.params[name].kind:
            for n in (name, name[:-4] + ".w2"):
                if n in held.params:
                    h = held.params.pop(n)
                    del held.by_storage[params[n].data.untyped_storage().data_ptr()]
                    params[n].data = torch.empty(h.shape, dtype=model.cfg.dtype, device=params[n].device)
    for name in list(held.params):
        if name.endswith(".w2") and name[:-3] + ".w13" not in held.params:
            h = held.params.pop(name)
            del held.by_storage[params[name].data.untyped_storage().data_ptr()]
            params[name].data = torch.empty(h.shape, dtype=model.cfg.dtype, device=params[name].device)


def hold(model: Any, held: HeldWeights, ops: Ops) -> set[int]:
    """After loading: each held module takes its codes, scales and offsets; returns their ids."""
    params = dict(model.named_parameters())
    done: set[int] = set()
    zeros: dict[tuple, torch.Tensor] = {}
    for name, h in held.params.items():
        if h.exponents and name not in held.streamed:
            params[name].data = split_exponents(params[name].data, h)
    for name, h in held.params.items():
        module = _module_of(model, name)
        if id(module) in done or h.scales is None or name in held.streamed:
            continue
        if name.endswith((".w13", ".w2")):
            prefix = name.rpartition(".")[0]
            w13, w2 = held.params[prefix + ".w13"], held.params[prefix + ".w2"]
            pairs = [
                tuple(_weight(params[p.name].data[e], p, ops, e, zeros) for p in (w13, w2))
                for e in range(w13.shape[0])
            ]
            module.hold_quantized(pairs, ops)
        else:
            module.hold_quantized(_weight(params[name].data, h, ops))
        done.add(id(module))
    return done


def _weight(
    codes: torch.Tensor,
    h: HeldParam,
    ops: Ops,
    e: int | None = None,
    zeros: dict | None = None,
    into: Any = None,
) -> QuantizedWeight:
    """The held codes with their scales as a QuantizedWeight (`into`: where its panels go, as
    QuantizedWeight.from_rows takes it)."""
    scales = h.scales if e is None else h.scales[e]
    offsets = h.offsets if e is None else h.offsets[e]
    w = QuantizedWeight.from_rows(codes, scales, offsets, h.kind, h.local_group, ops, into)
    if h.zero_offsets and bool(w.offsets.any()):
        raise RuntimeError(f"{h.name}: offsets of a format without offsets are not zero")
    if (h.exponents or h.zero_offsets) and zeros is not None:  # offsets all 0: one tensor serves all
        w.offsets = zeros.setdefault(tuple(w.offsets.shape), w.offsets)
        w.shared_offsets = True
    perm = h.perms.get(0 if e is None else e)
    return w if perm is None else PermutedInputs(w, perm)


def _expert_of(key: str) -> int | None:
    """The expert index a per-expert checkpoint key names (its parts share the expert's inputs)."""
    m = re.search(r"\.experts\.(\d+)\.", key)
    return None if m is None else int(m.group(1))


def split_exponents(data: torch.Tensor, h: HeldParam) -> torch.Tensor:
    """int16 code | exponent << 4 [..., O, I] -> uint8 codes; h gets the scales 2^(e - 127) per
    group and zero offsets. Every group of the rank's inputs starts at a block (plan() checked)."""
    *lead, out_f, in_f = data.shape
    group = in_f if in_f < h.group else h.group  # a row of one block: any slice keeps its scale
    if in_f % group:
        raise RuntimeError(f"{h.name}: {in_f} inputs a rank are not whole blocks of {group}")
    exp = (data >> 4).view(*lead, out_f, in_f // group, group)
    first = exp[..., 0]
    if not bool((exp == first.unsqueeze(-1)).all()):
        raise RuntimeError(f"{h.name}: a block's weights came with different scales (a cut block)")
    h.scales = torch.ldexp(torch.ones(first.shape), first.to(torch.int32) - 127)  # exact in float32
    h.offsets = torch.zeros(first.shape)
    h.local_group = group
    return (data & 15).to(torch.uint8)


__all__ = ["CodesRegion", "HeldWeights", "QuantizedExperts", "hold", "local_groups", "plan"]
