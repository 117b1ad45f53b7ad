"""One-pass loading of compressed weights: each parameter (or each expert of a stack) converted into
its final compressed buffer as soon as its last source tensor is in, its float or code copy freed
before the next, so the peak RSS while loading stays near the steady state (issue 15 item 1).

Without it, online quantization loaded the whole dense model and quantized after, and a held
checkpoint's codes (MXFP4's int16 code | exponent, GPTQ's uint8 codes) stayed whole until packed.

- A linear layer (or the LM head with "+head") is quantized (`use_quantized`) or takes its held
  codes (`hold_quantized`) the moment its every shard is loaded; its dense or code storage is freed.
- A routed-experts stack [E, ...] never fills its dense storage: before each shard's copy the
  parameter is pointed at a staging buffer of one expert (`param.data` a stride-0 expansion of it,
  so the module's own loader writes into it as into slot e), and once that expert's shards are all
  in, it is quantized or its codes packed straight into slot e of the final stacks
  (`ExpertStacks`); the stacks are handed to the module after loading (`hold_quantized`), which
  stacks them without a copy (QuantizedExperts.stack over views of one stack).

Tokens are bit-identical to converting after loading: each weight is quantized (or packed) from
the same values by the same call. Modules laid out anew after loading (MLA's kv_b_proj) and
anything a module does not take compressed are left to the build as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, field
from typing import Any

import torch

from expertmesh import huge_pages
from expertmesh.layers.ops import Ops
from expertmesh.layers.quantization import mxfp4_blocks
from expertmesh.layers.quantization.held import (
    HeldParam,
    HeldWeights,
    _module_of,
    _relaid_after_loading,
    _weight,
    split_exponents,
)
from expertmesh.layers.quantization.mxfp4_blocks import BLOCK, int16_of
from expertmesh.layers.quantization.packed import QuantizedWeight


def _libc_trim() -> Any:
    """glibc's malloc_trim, or None (another libc): the loader's freed staging and temporaries sit
    in the heap between larger live blocks; trimming hands their pages back to the OS at once."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()
TRIM_EVERY = 16  # experts converted between two trims of the heap


def release_freed() -> None:
    if _TRIM is not None:
        _TRIM(0)


class ExpertStacks:
    """Slot e of one parameter's experts, written once each into [E, ...] codes, scales and offsets
    (offsets all one zero tensor for MXFP4: `shared_offsets`, stacked as QuantizedExperts does)."""

    def __init__(self, experts: int, shared_offsets: bool) -> None:
        self.experts, self.stacks, self.slots = experts, None, [None] * experts
        self.parts = ("codes", "scales") if shared_offsets else ("codes", "scales", "offsets")

    def into(self, e: int) -> Any:
        """QuantizedWeight.from_rows' `into` for slot e: the panels written straight into the stacks
        (allocated at the first expert), no copy of the expert's own."""

        def slot(shapes: dict) -> dict:
            if self.stacks is None:
                self.stacks = {a: huge_pages.empty((self.experts, *shapes[a][0]), shapes[a][1])
                               for a in self.parts}  # fmt: skip
            return {a: stack[e] for a, stack in self.stacks.items()}

        return slot

    def put(self, e: int, w: Any) -> None:
        if not isinstance(w, QuantizedWeight):  # desc_act's PermutedInputs: held per expert as is
            self.slots[e] = w
            return
        if self.stacks is None:
            self.stacks = {a: huge_pages.empty((self.experts, *getattr(w, a).shape), getattr(w, a).dtype)
                           for a in self.parts}  # fmt: skip
        views = {"offsets": w.offsets}
        for a, stack in self.stacks.items():
            if getattr(w, a).data_ptr() != stack[e].data_ptr():  # built elsewhere (online quantization)
                stack[e].copy_(getattr(w, a))
            views[a] = stack[e]
        self.slots[e] = QuantizedWeight(
            w.kind, views["codes"], views["scales"], views["offsets"], w.out_features, w.in_features,
            w.group, w.lanes, w.ops, w.shared_offsets and "offsets" not in self.stacks,
        )  # fmt: skip


@dataclass
class _Experts:
    """One routed-experts parameter converted expert by expert."""

    name: str
    param: torch.nn.Parameter
    slots: list[int]  # local slot -> global expert id
    shards: set  # shard ids per expert: (0, 1) halves for w13, (None,) for w2
    convert: Any  # (staging buffer [O, I], slot's HeldParam, ExpertStacks.into(slot)) -> QuantizedWeight
    dense: torch.Tensor | None = None  # the parameter's own (never filled) storage
    staging: dict[int, torch.Tensor] = field(default_factory=dict)
    seen: dict[int, set] = field(default_factory=dict)
    out: ExpertStacks | None = None
    converted: int = 0  # experts converted so far (a trim every TRIM_EVERY)


class Streaming:
    """The loader's hooks: `before(name, shard)` ahead of each shard's copy, `after(name, shard)`
    once it is in, `finish()` after the last key (returns the ids of the modules it served)."""

    def __init__(self, model: Any, held: HeldWeights | None, scheme: Any, ops: Ops) -> None:
        self.model, self.held, self.scheme, self.ops = model, held, scheme, ops
        self.blocks_direct = mxfp4_blocks.collects_blocks(ops)
        self.params = dict(model.named_parameters())
        self.linear: dict[str, set] = {}  # parameter -> shards still to come
        self.experts: dict[str, _Experts] = {}
        self.done: set[int] = set()
        self.zeros: dict[tuple, torch.Tensor] = {}
        for name, param in self.params.items():
            self._plan(name, param)

    def _plan(self, name: str, param: torch.nn.Parameter) -> None:
        module = _module_of(self.model, name)
        if not name.endswith((".weight", ".w13", ".w2")) or _relaid_after_loading(self.model, name):
            return
        h = self.held.params.get(name) if self.held is not None else None
        online = h is None and self.scheme is not None and getattr(module, "quantizable", False)
        if hasattr(module, "vocab_size"):  # the LM head: quantized with "+head" only
            online = online and bool(getattr(self.scheme, "lm_head", False))
        if h is None and not online:
            return
        if not name.endswith((".w13", ".w2")):
            self.linear[name] = set(param.expected_shards)
            return
        if not module.expert_ids:
            return
        if online and name.endswith(".w2"):  # the check use_quantized makes, before any expert is read
            shards = module.full_inter // module.inter
            self.scheme.check_split(
                f"the experts' down projection [{module.w2.shape[1]}, {module.inter}]", module.inter, shards
            )
        shards = {s for _, s in param.expected_shards}
        self.experts[name] = _Experts(name, param, list(module.expert_ids), shards, self._converter(name, h))
        self.experts[name].dense = param.data

    def _converter(self, name: str, h: HeldParam | None) -> Any:
        if h is None:
            kind, group = self.scheme.kind, self.scheme.group_size
            return lambda buf, sh, into: QuantizedWeight.quantize(buf, kind, group, self.ops)

        def held(buf: torch.Tensor, sh: HeldParam, into: Any) -> Any:
            pieces, sh.blocks = sh.blocks or [], None
            if pieces and sum(len(raw) for _, raw in pieces) == buf.shape[0]:
                return self._from_blocks(buf, pieces, into)  # every row came as GGUF MXFP4 blocks
            for row, raw in pieces:  # some rows did: their int16 values, as the others'
                buf[row : row + len(raw)] = torch.from_numpy(int16_of(raw, 0, buf.shape[1]))
            codes = split_exponents(buf, sh) if sh.exponents else buf
            return _weight(codes, sh, self.ops, None, self.zeros, into)

        return held

    def _from_blocks(self, buf: torch.Tensor, pieces: list, into: Any) -> QuantizedWeight:
        """An expert's GGUF MXFP4 blocks laid straight into its panels (mxfp4_blocks.py): the
        weight split_exponents and _weight make of the same values, offsets the shared zeros."""
        out_f, in_f = buf.shape
        # the load's torch threads (one, loader.load_weights): a call lasts a few milliseconds, and
        # with the other core busy a second thread held up its end (twice the time, measured)
        codes, scales = mxfp4_blocks.panels(pieces, out_f, self.ops, into, torch.get_num_threads())
        zero = self.zeros.get(tuple(scales.shape))
        if zero is None:
            zero = self.zeros[tuple(scales.shape)] = torch.zeros(scales.shape)
        lanes = self.ops.quant_lanes
        return QuantizedWeight("fp4", codes, scales, zero, out_f, in_f, BLOCK, lanes, self.ops, True)

    def before(self, name: str, shard: Any) -> None:
        ex = self.experts.get(name)
        if ex is None:
            return
        slot = ex.slots.index(shard[0])
        buf = ex.staging.get(slot)
        if buf is None:
            buf = ex.staging[slot] = torch.empty(ex.dense.shape[1:], dtype=ex.dense.dtype)
            h = self.held.params.get(name) if self.held is not None else None
            if h is not None:  # the codes' scales land beside this expert's buffer (held.place)
                sh = HeldParam(
                    name,
                    h.kind,
                    h.group,
                    tuple(buf.shape),
                    exponents=h.exponents,
                    zero_offsets=h.zero_offsets,
                )
                if h.exponents and self.blocks_direct and buf.dim() == 2:
                    sh.blocks = []  # GGUF MXFP4 regions leave their blocks here, buf untouched
                self.held.by_storage[buf.untyped_storage().data_ptr()] = sh
                buf.slot_held = sh
        ex.param.data = buf.unsqueeze(0).expand(len(ex.slots), *buf.shape)

    def after(self, name: str, shard: Any) -> None:
        ex = self.experts.get(name)
        if ex is not None:
            self._expert_shard(ex, shard)
            return
        left = self.linear.get(name)
        if left is None:
            return
        left.discard(shard)
        if left:
            return
        del self.linear[name]
        module, param = _module_of(self.model, name), self.params[name]
        h = self.held.params.get(name) if self.held is not None else None
        if h is None:
            module.use_quantized(self.scheme, self.ops)  # releases the dense weight
        else:
            if h.exponents:
                param.data = split_exponents(param.data, h)
            module.hold_quantized(_weight(param.data, h, self.ops))
            h.scales = h.offsets = None  # in the module's panels now
            self.held.streamed.add(name)
        self.done.add(id(module))
        release_freed()

    def _expert_shard(self, ex: _Experts, shard: Any) -> None:
        slot = ex.slots.index(shard[0])
        ex.seen.setdefault(slot, set()).add(shard[1])
        if ex.seen[slot] != ex.shards:
            return
        buf = ex.staging.pop(slot)
        sh = getattr(buf, "slot_held", None)
        if sh is not None:
            del self.held.by_storage[buf.untyped_storage().data_ptr()]
        if ex.out is None:
            shared = sh is not None and (sh.exponents or sh.zero_offsets)  # one zero tensor for all
            ex.out = ExpertStacks(len(ex.slots), shared_offsets=shared)
        w = ex.convert(buf, sh, ex.out.into(slot))
        ex.out.put(slot, w)
        ex.param.data = ex.dense
        del buf, w
        ex.converted += 1
        if ex.converted % TRIM_EVERY == 0 or None not in ex.out.slots:
            # every few experts, not per expert: a trim hands the freed temporaries' pages back, and
            # the next expert's first touch of them costs page faults (system time several times
            # the decoding's); never trimming lets fragments of the heap pile up (peak RSS)
            release_freed()

    def finish(self) -> set[int]:
        """Hand every experts module its stacks (after all keys: biases are in by then)."""
        for name, ex in self.experts.items():
            if not name.endswith(".w13") or ex.out is None:
                continue
            other = self.experts.get(name[:-4] + ".w2")
            if other is None or other.out is None or None in ex.out.slots + other.out.slots:
                continue  # not every expert came: the loader's completeness check names it
            module = _module_of(self.model, name)
            module.hold_quantized(list(zip(ex.out.slots, other.out.slots, strict=True)), self.ops)
            self.done.add(id(module))
            ex.dense = other.dense = None
            if self.held is not None:
                self.held.streamed.update((name, other.name))
        return self.done
