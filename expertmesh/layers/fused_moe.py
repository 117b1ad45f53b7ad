"""Expert weights and expert compute: tokens sorted by expert, one pair of matmuls per expert.

Holds `expert_ids` (the global experts this rank owns) and, for each, the
`[shard_rank]`-th of `shard_size` slices of the intermediate dimension. Returns this rank's
partial sum over its experts and slices in float32, never rounded to the model's dtype: who sums
the partials is the MoE plan's business, and the block rounds once, after the last sum.

Variants: biases on gate/up and down (the down bias joins on shard 0 only, so the sum over
shards adds it once), any activation of layers/activation.py, and the routing weight applied to
the expert's input instead of its output. Our fused CPU kernels serve gated experts, with biases
and GPT-OSS's clamped SwiGLU too (moe_f32_ex / moe_bf16_ex / moe_q_ex); input-weighted experts
(top-k > 1) take the per-expert torch path (correct first; docs/architectures.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.cpu import cpu_gemm, huge_pages
from expertmesh.cpu.cpu_kernels import CpuKernels
from expertmesh.distributed.fixed_sum import tree_sum
from expertmesh.distributed.moe_plan import local_slot_map
from expertmesh.layers.activation import GatedActivation
from expertmesh.layers.identity_experts import lookup_picks
from expertmesh.layers.quantization.packed import (
    QuantizedExperts,
    QuantizedMoE,
    QuantizedWeight,
    experts_native_form,
)
from expertmesh.layers.quantization.permuted import one_form
from expertmesh.layers.weights import copy_into, read, set_loader


class FusedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        expert_ids: list[int],
        hidden: int,
        intermediate: int,
        shard_rank: int,
        shard_size: int,
        act: str | object,
        dtype=torch.float32,
        bias: bool = False,
        weight_on_input: bool = False,
        slot_map: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if intermediate % shard_size:
            raise ValueError(
                f"expert intermediate size {intermediate} is not divisible by the {shard_size} ranks "
                "that split it; choose a parallel layout whose expert shard count divides it"
            )
        self.num_experts, self.expert_ids = num_experts, list(expert_ids)
        # slot_map [P]: physical expert slot (what routing hands us) -> local slot, -1 elsewhere;
        # by default slot = expert id. With EPLB replicas, several slots hold one expert.
        self.all_local = slot_map is None and self.expert_ids == list(range(num_experts))
        self.act = GatedActivation(act) if isinstance(act, str) else act  # [.., 2I] -> [.., I]
        self.act_name = self.act.kernel_name  # None: the fused kernel does not compute it
        self.weight_on_input = weight_on_input
        self.model_dtype = dtype  # its activations' (held checkpoints replace w13 / w2 by codes)
        self.shard_rank, self.inter = shard_rank, intermediate // shard_size
        self.full_inter = intermediate
        e = len(self.expert_ids)
        # The checkpoint halves w13 holds: gate (0) and up (1), or up only for ungated experts.
        self.parts = getattr(self.act, "parts", (0, 1))
        # [E, 2I, H] (or [E, I, H] ungated) and [E, H, I]
        rows = len(self.parts) * self.inter
        self.w13 = nn.Parameter(huge_pages.empty((e, rows, hidden), dtype), requires_grad=False)
        self.w2 = nn.Parameter(huge_pages.empty((e, hidden, self.inter), dtype), requires_grad=False)
        local = local_slot_map(num_experts, self.expert_ids) if slot_map is None else slot_map.clone()
        self.register_buffer("local_index", local, persistent=False)  # global expert -> local slot or -1
        set_loader(self.w13, self._load_w13, {(x, s) for x in self.expert_ids for s in self.parts})
        set_loader(self.w2, self._load_w2, {(x, None) for x in self.expert_ids})
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(e, rows, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, hidden, dtype=dtype), requires_grad=False)
            set_loader(self.w13_bias, self._load_w13, {(x, s) for x in self.expert_ids for s in self.parts})
            set_loader(self.w2_bias, self._load_w2, {(x, None) for x in self.expert_ids})

    def owns(self, expert: int) -> bool:
        return expert in self.expert_ids

    def set_slots(self, expert_ids: list[int], slot_map: torch.Tensor) -> None:
        """After EPLB moved weights: local slot i now holds logical expert `expert_ids[i]`."""
        if len(expert_ids) != len(self.expert_ids) or slot_map.shape != self.local_index.shape:
            raise ValueError("a rebalance keeps each rank's slot count and the physical slot count")
        self.expert_ids = list(expert_ids)
        self.local_index.copy_(slot_map)
        self.all_local = False

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        """Views of local slot `slot`'s weights as stored now (dense, packed panels, quantized codes
        with their scales, offsets and desc_act order, biases): what EPLB copies between ranks in
        place, whatever the format; same shapes and dtypes for every slot."""
        if self.chunked is not None:  # deterministic mode: per fixed chunk, stacks [E, ...]
            out = [w[slot] for _, w13, w2, _ in self.chunked for w in (w13, w2)]
        elif self.chunk_panels is not None:  # deterministic mode: per (expert, chunk) panels
            out = [w.data for pair in self.chunk_panels[slot] for w in pair]
        elif self.fused is not None:  # stacks [E, ...]: float panels or QuantizedExperts
            q = isinstance(self.fused[1], QuantizedExperts)
            out = [t for w in self.fused[1:3] for t in (w.slot_tensors(slot) if q else [w[slot]])]
        elif self.packed is not None:  # per expert: float panels, or quantized (slot_tensors)
            out = [
                t
                for w in self.packed[slot]
                for t in (w.slot_tensors() if hasattr(w, "slot_tensors") else [w.data])
            ]
        else:
            out = [self.w13.data[slot], self.w2.data[slot]]
        biases = (self.w13_bias, self.w2_bias) if self.w13_bias is not None else ()
        return out + [b.data[slot] for b in biases]

    def _load_w13(self, param: nn.Parameter, src: Any, shard_id: tuple[int, int]) -> None:
        """Weights [I, H] and biases [I]: this shard's rows of the gate (0) or up (1) part."""
        expert, half = shard_id
        dst = param.data[self.expert_ids.index(expert)].narrow(
            0, self.parts.index(half) * self.inter, self.inter
        )
        copy_into(dst, read(src, 0, self.shard_rank * self.inter, self.inter), f"expert {expert} w13[{half}]")

    def _load_w2(self, param: nn.Parameter, src: Any, shard_id: tuple[int, None]) -> None:
        """Weights [H, I]: this shard's columns; biases [H]: whole."""
        expert = shard_id[0]
        dst = param.data[self.expert_ids.index(expert)]
        if dst.dim() == 1:
            copy_into(dst, read(src), f"expert {expert} down bias")
            return
        copy_into(dst, read(src, 1, self.shard_rank * self.inter, self.inter), f"expert {expert} w2")

    # Deterministic mode (distributed/fixed_sum.py): this rank's fixed chunks of the intermediate
    # dim (0: off), and per chunk the fused kernel's stacked panels (None: the torch path).
    fixed_chunks = 0
    chunked: list[tuple[CpuKernels, torch.Tensor, torch.Tensor, str]] | None = None
    # Experts the fused kernel does not run (ungated, biased, weighted on the input): per local
    # expert, per chunk, (w13, w2) panels of our GEMM, whose row results do not depend on the rows.
    chunk_panels: list[list[tuple[Any, Any]]] | None = None

    def _chunk_dense(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk j's [E, 2c, H] gate|up rows and [E, H, c] down columns of the dense weights."""
        c = self.inter // self.fixed_chunks
        cols = slice(j * c, (j + 1) * c)
        w13 = torch.cat(
            [self.w13.data[:, cols], self.w13.data[:, self.inter + j * c : self.inter + (j + 1) * c]], 1
        )
        return w13.contiguous(), self.w2.data[:, :, cols].contiguous()

    def _pack_chunks(self, kernels: CpuKernels | None) -> None:
        """The fused kernel's stacks [E, ...] per fixed chunk (one stack a chunk: one slot a chunk
        and expert in a single stack measured 2-3x slower, many narrow experts for the kernel)."""
        plain = self.w13_bias is None and not self.weight_on_input and self.act_name is not None
        if kernels is None or not self.expert_ids:
            return  # the torch path of pair_sums on the dense weights
        if not plain or not kernels.moe_supports(self.w13.dtype, self.act_name):
            chunks = [self._chunk_dense(j) for j in range(self.fixed_chunks)]
            self.chunk_panels = [
                [(kernels.pack(w13[e]), kernels.pack(w2[e])) for w13, w2 in chunks]
                for e in range(len(self.expert_ids))
            ]
            cpu_gemm.release(self.w13)
            cpu_gemm.release(self.w2)
            return
        chunked = []
        for j in range(self.fixed_chunks):
            stacks = []
            for w in self._chunk_dense(j):
                shape = (w.shape[0], *kernels.panel_shape(*w.shape[1:], w.dtype))
                out = torch.empty(shape, dtype=w.dtype)
                for e in range(w.shape[0]):
                    out[e] = kernels.pack(w[e]).data
                stacks.append(out)
            chunked.append((kernels, stacks[0], stacks[1], self.act_name))
        self.chunked = chunked
        cpu_gemm.release(self.w13)
        cpu_gemm.release(self.w2)

    def pair_sums(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Deterministic mode: x [n, H], topk [n, k] -> [n, k, H] float32, each (token, pick)'s
        unweighted expert output over this rank's fixed chunks, added by the fixed tree (zero
        for picks held elsewhere). Routing weights on the input (weight_on_input) are applied
        here; on the output, by `finish`."""
        n, k = topk_ids.shape
        out = torch.zeros((n, k, x.shape[1]), dtype=torch.float32, device=x.device)
        if n == 0 or not self.expert_ids:
            return out
        slot = lookup_picks(self.local_index, topk_ids)  # [n, k], -1 elsewhere (or no expert)
        if self.chunked is not None:
            # One row per (token, pick), each with its one slot and weight 1 (1 * y + 0 is exact):
            # a call of the fused kernel per chunk, whose row results do not depend on the rows.
            rows = x.repeat_interleave(k, dim=0)  # [n * k, H], row t * k + p
            s = slot.reshape(-1, 1).to(torch.int32).contiguous()
            ones = torch.ones((n * k, 1), dtype=torch.float32)
            c = self.inter // self.fixed_chunks
            parts = [kern.moe(rows, s, ones, w13, w2, c, act) for kern, w13, w2, act in self.chunked]
            return tree_sum(parts).view(n, k, x.shape[1])
        c = self.inter // self.fixed_chunks
        chunks = self.chunk_panels
        if chunks is None:  # never packed: the dense weights' chunks, [E, ...] per chunk
            dense = [self._chunk_dense(j) for j in range(self.fixed_chunks)]
            chunks = [[(w13[e], w2[e]) for w13, w2 in dense] for e in range(len(self.expert_ids))]
        for e in range(len(self.expert_ids)):
            tok, pick = (slot == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xs = x[tok]
            if self.weight_on_input:
                xs = xs * topk_weights[tok, pick].unsqueeze(1).to(xs.dtype)
            parts = []
            for j, (w13, w2) in enumerate(chunks[e]):
                b13 = None
                if self.w13_bias is not None:
                    b = self.w13_bias.data[e]
                    b13 = torch.cat(
                        [b[j * c : (j + 1) * c], b[self.inter + j * c : self.inter + (j + 1) * c]]
                    )
                if isinstance(w13, torch.Tensor):
                    h = self.act(F.linear(xs, w13, b13))
                    parts.append(F.linear(h.float(), w2.float()))
                else:  # our kernel's panels: a row's product whatever the rows
                    h = self.act(w13(xs.contiguous(), b13))
                    parts.append(w2(h.contiguous(), None, torch.float32))
            out[tok, pick] = tree_sum(parts)
        return out

    def pick_terms(
        self, sums: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """[n, k, H] expert outputs (whole, or under EP this rank's picks, zero elsewhere) -> [n, k, H]
        float32 terms of the routed sum: the down bias and the routing weight added per pick."""
        terms = sums
        if self.w2_bias is not None:
            slot = lookup_picks(self.local_index, topk_ids)
            bias = self.w2_bias.data.float()[slot.clamp(min=0)]  # [n, k, H]
            terms = torch.where((slot >= 0).unsqueeze(2), terms + bias, terms)
        if not self.weight_on_input:
            terms = terms * topk_weights.float().unsqueeze(2)
        return terms

    @staticmethod
    def add_picks(terms: torch.Tensor, order_ids: torch.Tensor) -> torch.Tensor:
        """[n, k, H] terms -> [n, H] float32: added from zero in the order of the picks' (logical)
        expert ids, whatever rank computed each."""
        n, k = order_ids.shape
        y = torch.zeros((n, terms.shape[2]), dtype=torch.float32, device=terms.device)
        if n == 0:
            return y
        order = torch.argsort(order_ids, dim=1, stable=True)  # [n, k]
        terms = terms.gather(1, order.unsqueeze(2).expand(-1, -1, terms.shape[2]))
        for p in range(k):
            y = y + terms[:, p]
        return y

    def finish(self, sums: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """[n, k, H] whole (or, under EP, local) expert outputs -> [n, H] float32: the down bias,
        the routing weight, and the sum over the picks in the order of their expert ids."""
        return self.add_picks(self.pick_terms(sums, topk_ids, topk_weights), topk_ids)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [n, H], topk_ids/topk_weights: [n, k] -> [n, H] float32 partial sum over local experts."""
        if self.fused is not None:
            kernels, w13, w2, act = self.fused
            if self.all_local:  # every expert here: its slot is its id
                slot = topk_ids.to(torch.int32)
            else:
                slot = lookup_picks(self.local_index, topk_ids).to(torch.int32)
            return kernels.moe(x, slot, topk_weights, w13, w2, self.inter, act)
        if x.shape[0] == 1:
            return self._one_token(x, topk_ids, topk_weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return out
        k = topk_ids.shape[1]
        slot = lookup_picks(self.local_index, topk_ids).flatten()  # [n*k], -1: another rank's, or none
        order = torch.argsort(slot, stable=True)
        counts = torch.bincount(slot + 1, minlength=len(self.expert_ids) + 1).tolist()
        order = order[counts[0] :]  # drop (token, expert) pairs owned elsewhere
        token = order // k  # [m] source token of each sorted pair
        xs = x[token]  # [m, H]
        pair_weights = topk_weights.flatten()[order].unsqueeze(1)  # [m, 1]
        if self.weight_on_input:
            xs = xs * pair_weights.to(xs.dtype)
        ys = torch.empty(xs.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts[1:]):
            if count:
                ys[start : start + count] = self._expert(e, xs[start : start + count])
                start += count
        if not self.weight_on_input:
            ys *= pair_weights.float()
        return out.index_add_(0, token, ys)

    def native_form(self, keep: list) -> dict | None:
        """The experts of a native decode layer: every expert here in our fused kernel's panels, or
        quantized for moe_q (through its shim: experts_fn, experts_w)."""
        # biases and the clamped SwiGLU are moe_q_ex's only: the native layer's shims take neither
        if self.fused is None or not self.all_local or self.w13_bias is not None:
            return None
        kernels, w13, w2, act = self.fused
        if act not in CpuKernels.MOE_ACTIVATIONS:
            return None
        if isinstance(kernels, QuantizedMoE):
            form = experts_native_form(kernels.kernels, w13, w2, self.model_dtype, keep)
            act_id = kernels.kernels.MOE_ACTIVATIONS[act]
            return None if form is None else dict(form, w13=None, w2=None, inter=self.inter, act=act_id)
        if not isinstance(kernels, CpuKernels):
            return None
        return dict(w13=w13.data_ptr(), w2=w2.data_ptr(), inter=self.inter, act=kernels.MOE_ACTIVATIONS[act])

    packed: list[tuple[cpu_gemm.PackedWeight, cpu_gemm.PackedWeight]] | None = None  # per local expert
    # (kernels, w13 panels, w2 panels, activation): the whole block in one call of our CPU kernel.
    fused: tuple[CpuKernels, torch.Tensor, torch.Tensor, str] | None = None

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        if self.fixed_chunks:
            return self._pack_chunks(kernels)
        plain = self.w13_bias is None and not self.weight_on_input and self.act_name is not None
        form = getattr(self.act, "moe_q_form", None)  # biases / clamped SwiGLU: moe_*_ex
        extras = not plain and not self.weight_on_input and form is not None
        if (
            kernels is not None
            and self.expert_ids
            and (plain or extras)
            and kernels.moe_supports(self.w13.dtype, form[0] if extras else self.act_name, extras)
        ):
            # One expert at a time into the stacked panels, over the dense weights' own storage
            # where the panels are the same size (cpu_gemm.pack_in_place): one expert's copy at a
            # time while packing; otherwise into a new stack (the dense and packed coexist, 2x).
            packed = []
            for param in (self.w13, self.w2):
                shape = (len(self.expert_ids), *kernels.panel_shape(*param.shape[1:], param.dtype))
                same = torch.Size(shape).numel() == param.numel() and param.is_contiguous()
                out = param.data.view(shape) if same else torch.empty(shape, dtype=param.dtype)
                for e in range(len(self.expert_ids)):
                    out[e] = kernels.pack(param.data[e]).data  # packs a copy, then overwrites slot e
                cpu_gemm.release(param)
                packed.append(out)
            if extras:
                self.fused = (_MoeEx(kernels, *self._float_biases(), *form[1:]), *packed, form[0])
            else:
                self.fused = (kernels, packed[0], packed[1], self.act_name)
            return
        pairs = [
            (cpu_gemm.pack(self.w13[e], kernels), cpu_gemm.pack(self.w2[e], kernels, float32_out=True))
            for e in range(len(self.expert_ids))
        ]
        if pairs and all(a is not None and b is not None for a, b in pairs):
            self.packed = pairs
            cpu_gemm.release(self.w13)
            cpu_gemm.release(self.w2)

    quantizable = True

    def use_quantized(self, scheme: Any, kernels: CpuKernels | None) -> None:
        """Online weight-only quantization, one expert at a time (the dense and the compressed copy
        of one expert coexist, never two dense copies). With our kernel and plain gated experts the
        block runs in one call of moe_q; otherwise each expert's pair runs on the per-expert path."""
        if not self.expert_ids:
            return
        shards = self.full_inter // self.inter
        scheme.check_split(
            f"the experts' down projection [{self.w2.shape[1]}, {self.inter}]", self.inter, shards
        )
        pairs = []
        for e in range(len(self.expert_ids)):
            pairs.append(
                tuple(
                    QuantizedWeight.quantize(w[e], scheme.kind, scheme.group_size, kernels)
                    for w in (self.w13, self.w2)
                )
            )
        self.hold_quantized(pairs, kernels)

    def hold_quantized(self, pairs: list[tuple[QuantizedWeight, QuantizedWeight]], kernels: Any) -> None:
        """Serve the experts from compressed (w13, w2) pairs, one a local expert (online, or a
        checkpoint's codes as stored): with our kernel in one moe_q_ex call (biases and the clamped
        SwiGLU included), except experts weighted on their input."""
        if self.fixed_chunks:
            raise ValueError("deterministic=True does not serve quantized experts yet")
        cpu_gemm.release(self.w13)
        cpu_gemm.release(self.w2)
        form = self._moe_q_form(kernels)
        if form is not None and all(isinstance(w, QuantizedWeight) for p in pairs for w in p):  # not desc_act
            stacks = [QuantizedExperts.stack([p[i] for p in pairs]) for i in (0, 1)]
            name, limit, alpha = form
            self.fused = (
                QuantizedMoE(kernels, *self._float_biases(), limit, alpha),
                stacks[0],
                stacks[1],
                name,
            )
        else:
            w13s, w2s = (one_form([p[i] for p in pairs]) for i in (0, 1))  # desc_act: one form a slot
            self.packed = list(zip(w13s, w2s, strict=True))

    def _float_biases(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """(b13, b2) for moe_*_ex, made float32 in place (slot_tensors' views stay the kernel's); the
        down bias joins once across the shards of the intermediate dim: on shard 0 (None elsewhere)."""
        if self.w13_bias is None:
            return None, None
        for b in (self.w13_bias, self.w2_bias):
            b.data = b.data.to(torch.float32).contiguous()
        return self.w13_bias, None if self.shard_rank else self.w2_bias

    def _moe_q_form(self, kernels: Any) -> tuple[str, float, float] | None:
        """moe_q(_ex)'s activation (name, limit, alpha) for these experts, None: the per-expert path
        (input weighting, an activation it lacks, or biases / clamped SwiGLU on an older build)."""
        form = getattr(self.act, "moe_q_form", None)
        if kernels is None or self.weight_on_input or form is None:
            return None
        if getattr(kernels, "moe_q_ex", None) is None:
            plain = self.w13_bias is None and form[0] in kernels.MOE_ACTIVATIONS
            return form if plain else None
        return form if form[0] in kernels.MOE_Q_ACTIVATIONS else None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """[m, H] -> [m, H] float32: the down projection's product is not rounded."""
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        # The down bias joins once across the shards of the intermediate dim: on shard 0.
        b2 = None if self.w2_bias is None or self.shard_rank else self.w2_bias[e]
        if self.packed is not None:
            w13, w2 = self.packed[e]
            return w2(self.act(w13(x, b13)), b2, out_dtype=torch.float32)
        h = F.linear(x, self.w13[e], b13)
        return F.linear(self.act(h).float(), self.w2[e].float(), None if b2 is None else b2.float())

    def _one_token(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Decode at batch 1: no sort, gather or scatter, just the chosen local experts in expert order."""
        local = lookup_picks(self.local_index, topk_ids[0]).tolist()
        picks = sorted((slot, j) for j, slot in enumerate(local) if slot >= 0)
        out = None
        for slot, j in picks:
            w = topk_weights[0, j]
            if self.weight_on_input:
                y = self._expert(slot, x * w.to(x.dtype))
            else:
                y = self._expert(slot, x) * w.float()
            out = y if out is None else out + y
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device) if out is None else out


class _MoeEx:
    """The `kernels.moe(...)` of the fused path for float experts with biases or the clamped SwiGLU:
    CpuKernels.moe with its extras (the biases read at each call, so copies into them are seen)."""

    def __init__(self, kernels: CpuKernels, b13, b2, limit: float, alpha: float) -> None:
        self.kernels, self.b13, self.b2, self.limit, self.alpha = kernels, b13, b2, limit, alpha

    def moe(self, x, slot, weights, w13, w2, inter: int, act: str) -> torch.Tensor:
        biases = tuple(None if b is None else b.data for b in (self.b13, self.b2))
        return self.kernels.moe(x, slot, weights, w13, w2, inter, act, (*biases, self.limit, self.alpha))
