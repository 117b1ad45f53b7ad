"""Expert weights and expert compute: tokens sorted by expert, one pair of matmuls per expert.

Holds `expert_ids` (the global experts this rank owns) and, for each, the
`[shard_rank]`-th of `shard_size` slices of the intermediate dimension. Returns this rank's
partial sum over its experts and slices in float32, never rounded to the model's dtype: who sums
the partials is the MoE plan's business, and the block rounds once, after the last sum.

Variants: biases on gate/up and down (the down bias joins on shard 0 only, so the sum over
shards adds it once), any activation of layers/activation.py, and the routing weight applied to
the expert's input instead of its output. Our fused CPU kernels serve gated experts, with biases
and GPT-OSS's clamped SwiGLU too (moe_f32_ex / moe_bf16_ex / moe_q_ex); input-weighted experts
(top-k > 1) take the per-expert torch path (correct first; docs/architectures.md). The form the
weights are held and run in (dense, per expert, stacked for one kernel call) is one object,
`experts_form` (layers/expert_weights.py), chosen once after loading.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from expertmesh import huge_pages
from expertmesh.distributed.moe_plan import local_slot_map
from expertmesh.layers.activation import GatedActivation
from expertmesh.layers.expert_weights import DenseExperts, ExpertsWeight
from expertmesh.layers.identity_experts import lookup_picks
from expertmesh.layers.linear_weight import LinearWeight, release
from expertmesh.layers.ops import Ops
from expertmesh.layers.quantization.packed import QuantizedWeight
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
        self.parts = self.act.parts
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
        # The one form the experts' weights are held and run in (layers/expert_weights.py): the
        # dense stacks until the model's ops choose another (use_ops / use_quantized / hold_quantized).
        self.experts_form: ExpertsWeight = DenseExperts(self.w13, self.w2)

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
        place, whatever the form; same shapes and dtypes for every slot."""
        biases = (self.w13_bias, self.w2_bias) if self.w13_bias is not None else ()
        return self.experts_form.slot_tensors(slot) + [b.data[slot] for b in biases]

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
    # dim (0: off); its form is then DenseExperts or ChunkedStacks.
    fixed_chunks = 0

    def pair_sums(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Deterministic mode: x [n, H], topk [n, k] -> [n, k, H] float32, each (token, pick)'s
        unweighted expert output over this rank's fixed chunks, added by the fixed tree (zero
        for picks held elsewhere). Routing weights on the input (weight_on_input) are applied
        here; on the output, by `finish`."""
        return self.experts_form.pair_sums(self, x, topk_ids, topk_weights)

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
        return self.experts_form.apply(self, x, topk_ids, topk_weights)

    def native_form(self, keep: list) -> dict | None:
        """The experts of a native decode layer: every expert here in our fused kernel's panels, or
        quantized for moe_q (through its shim: experts_fn, experts_w)."""
        return self.experts_form.native_form(self, keep)

    def use_ops(self, ops: Ops) -> None:
        """The experts' form after loading, chosen once by the model's ops (layers/ops.py): our
        fused kernel's stacked panels where it serves them (per fixed chunk in deterministic mode),
        else one packed pair a local expert, else the dense stacks through torch."""
        self.experts_form = ops.experts_form(self)

    quantizable = True

    def use_quantized(self, scheme: Any, ops: Ops) -> None:
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
                    QuantizedWeight.quantize(w[e], scheme.kind, scheme.group_size, ops)
                    for w in (self.w13, self.w2)
                )
            )
        self.hold_quantized(pairs, ops)

    def hold_quantized(self, pairs: list[tuple[LinearWeight, LinearWeight]], ops: Ops) -> None:
        """Serve the experts from compressed (w13, w2) pairs, one a local expert (online, or a
        checkpoint's codes as stored): with our kernel in one moe_q_ex call (biases and the clamped
        SwiGLU included), except experts weighted on their input."""
        if self.fixed_chunks:
            raise ValueError("deterministic=True does not serve quantized experts yet")
        release(self.w13)
        release(self.w2)
        self.experts_form = ops.quantized_experts_form(self, pairs)

    def float_biases(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """(b13, b2) for moe_*_ex, made float32 in place (slot_tensors' views stay the kernel's); the
        down bias joins once across the shards of the intermediate dim: on shard 0 (None elsewhere)."""
        if self.w13_bias is None:
            return None, None
        for b in (self.w13_bias, self.w2_bias):
            b.data = b.data.to(torch.float32).contiguous()
        return self.w13_bias, None if self.shard_rank else self.w2_bias
