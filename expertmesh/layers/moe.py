"""The MoE block: router, experts, optional shared expert, and the plan's collectives.

The plan (distributed/moe_plan.py) decides once which ranks hold which weight slices, over
which group tokens are exchanged, and how partial sums are reduced. This block only follows it:
gather across exactly the ranks holding different tokens, sum exactly once across exactly the
ranks holding different weight shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.activation import expert_activation
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.mlp import GatedMLP
from expertmesh.layers.routing import Router
from expertmesh.registries import lookup

SHARED_EXPERTS = ("sigmoid_gated", "plain")  # Qwen2-MoE's gated one; GLM / Llama 4 / Granite's


@dataclass(frozen=True)
class MoESpec:
    """The blocks an MoE layer is built from, by name (a family's choice; models/family.py)."""

    router: str = "softmax_topk"
    router_bias: bool = False
    activation: str = "gated"
    expert_bias: bool = False
    weights_input: bool = False  # the routing weight scales the expert input, not its output
    shared_expert: str | None = None
    shared_width: int = 0


class MoE(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        spec: MoESpec,
        plan: Any,
        groups: Any,
        dispatcher: Any,
        placement: str = "contiguous",
    ) -> None:
        super().__init__()
        self.plan, self.tp, self.dispatcher = plan, groups.tp, dispatcher
        self.top_k, self.router_name = cfg.top_k, spec.router
        params = dict(
            renormalize=cfg.norm_topk_prob, jitter_eps=cfg.router_jitter_noise, n_group=cfg.n_group,
            topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
        )  # fmt: skip
        self.gate = Router(
            cfg.hidden_size, cfg.num_experts, spec.router, cfg.top_k, params, spec.router_bias, cfg.dtype
        )
        # Top-1 input weighting is a scaling of the token before its one expert: done here, so the
        # experts (and our fused kernel) see plain weights of 1.
        self.prescale = spec.weights_input and cfg.top_k == 1
        # EP places whole experts; otherwise every rank holds a slice of every expert.
        inter_rank, inter_size = (
            (0, 1) if plan.expert_parallel else (plan.weight_shard_rank, plan.weight_shard_size)
        )
        self.experts = FusedExperts(
            cfg.num_experts,
            plan.local_experts(cfg.num_experts, placement),
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            inter_rank,
            inter_size,
            expert_activation(spec.activation, cfg.hidden_act, cfg.swiglu_limit, cfg.swiglu_alpha),
            cfg.dtype,
            bias=spec.expert_bias,
            weight_on_input=spec.weights_input and not self.prescale,
        )
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert is not None and spec.shared_width:
            lookup(dict.fromkeys(SHARED_EXPERTS), spec.shared_expert, "shared expert")
            # A dense MLP under plain TP, on the full local batch (never on an SP slice).
            self.shared_expert = GatedMLP(
                cfg.hidden_size, spec.shared_width, cfg.hidden_act, groups.tp, False, cfg.dtype
            )
            if spec.shared_expert == "sigmoid_gated":
                self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False, dtype=cfg.dtype)

    def dispatch_sizes(self, ctx: ForwardContext) -> list[int]:
        if self.plan.sequence_parallel:
            return [size for n in ctx.dp_token_counts for size in self.plan.sp_sizes(n)]
        return list(ctx.dp_token_counts)

    def routed(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        weights, ids = self.gate(x)  # [n, k] each
        if self.prescale:
            x, weights = x * weights.to(x.dtype), torch.ones_like(weights)
        if self.dispatcher is None:
            return self.experts(x, ids, weights)
        sizes = self.dispatch_sizes(ctx)
        x_all, ids_all, w_all = self.dispatcher.dispatch(x, ids, weights, sizes)
        return self.dispatcher.combine(self.experts(x_all, ids_all, w_all), sizes)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [n, H] replicated over TP -> [n, H] replicated over TP, in x's dtype.

        The experts' and the shared expert's outputs are float32 partial sums; they are summed
        in float32 (the combine, the TP all-reduce) and rounded to x's dtype once, after the
        last sum, in every layout and in one process alike.
        """
        shared = None
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # [n, H] float32, TP-partial
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(self.shared_expert_gate(x).float()) * shared
        if self.plan.sequence_parallel:
            sizes = self.plan.sp_sizes(x.shape[0])
            y = self.routed(x[self.plan.sp_slice(x.shape[0])], ctx)  # float32, summed over EP
            if shared is None:  # a gather sums nothing: round first, half the bytes
                return self.tp.all_gather_v(y.to(x.dtype), sizes)
            return (self.tp.all_gather_v(y, sizes) + self.tp.all_reduce(shared)).to(x.dtype)
        y = self.routed(x, ctx)  # float32
        if shared is not None:
            y = y + shared
        return self.tp.all_reduce(y).to(x.dtype)
