"""The MoE block: router, experts, optional shared expert, and the plan's collectives.

The plan (distributed/moe_plan.py) decides once which ranks hold which weight slices, over
which group tokens are exchanged, and how partial sums are reduced. This block only follows it:
gather across exactly the ranks holding different tokens, sum exactly once across exactly the
ranks holding different weight shards.

Experts live in physical slots (an ``ExpertPlacement`` from the plan): routing picks logical
experts, ``to_slots`` turns each (token, expert) pair into one slot holding that expert (with
EPLB replicas: the token's index in the dispatch group modulo the expert's replica count, the
same answer on every rank), and the exchange and the experts work on slots. ``load`` (when the engine's
ExpertLoad attached one) counts the pairs per slot with one index_add, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.distributed.all2all import All2AllBackend
from expertmesh.distributed.eplb import move_expert_weights
from expertmesh.distributed.fixed_sum import chunk_count, pointwise
from expertmesh.distributed.moe_plan import ExpertPlacement, MoEPlan
from expertmesh.distributed.parallel_groups import ParallelGroups
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.activation import expert_activation
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.hash_routing import HASH_RULES, HashRouter
from expertmesh.layers.identity_experts import NO_EXPERT, split_identity
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.mlp import GatedMLP, UngatedMLP
from expertmesh.layers.routing import Router
from expertmesh.registries import lookup

# Qwen2-MoE's gated one; GLM / Llama 4 / Granite's; Nemotron-H's act(up) without a gate projection;
# DeepSeek-V4's plain one with its gate and up clamped by swiglu_limit
SHARED_EXPERTS = ("sigmoid_gated", "plain", "ungated", "clamped")


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
        plan: MoEPlan,
        groups: ParallelGroups,
        dispatcher: All2AllBackend | None,
        placement: str | ExpertPlacement = "contiguous",
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.plan, self.tp, self.dispatcher = plan, groups.tp, dispatcher
        self.layer_index, self.ep_group = layer_index, groups.ep if plan.expert_parallel else None
        if isinstance(placement, str):
            placement = plan.expert_placement(cfg.num_experts, placement)
        self.load: torch.Tensor | None = None  # [P] int64 pairs per slot, attached by ExpertLoad
        self.top_k, self.router_name = cfg.top_k, spec.router
        # Identity experts (layers/identity_experts.py) are scored beside the real ones, numbered
        # after them; their output is added where the token lives, once: by every SP slice, or by
        # TP rank 0 where the TP ranks' outputs are summed.
        self.num_real, self.num_identity = cfg.num_experts, cfg.identity_experts
        self.adds_identity = plan.sequence_parallel or groups.tp.rank_in_group == 0
        params = dict(
            renormalize=cfg.norm_topk_prob, jitter_eps=cfg.router_jitter_noise, n_group=cfg.n_group,
            topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
        )  # fmt: skip
        scored, bias = cfg.num_experts + cfg.identity_experts, spec.router_bias
        if spec.router in HASH_RULES:  # experts by token id (layers/hash_routing.py)
            self.gate = HashRouter(
                cfg.hidden_size,
                scored,
                spec.router,
                cfg.top_k,
                cfg.vocab_size,
                cfg.routed_scaling_factor,
                cfg.dtype,
            )
        else:
            self.gate = Router(cfg.hidden_size, scored, spec.router, cfg.top_k, params, bias, cfg.dtype)
        # Top-1 input weighting is a scaling of the token before its one expert: done here, so the
        # experts (and our fused kernel) see plain weights of 1.
        self.prescale = spec.weights_input and cfg.top_k == 1
        # EP places whole experts; otherwise every rank holds a slice of every expert.
        inter_rank, inter_size = (
            (0, 1) if plan.expert_parallel else (plan.weight_shard_rank, plan.weight_shard_size)
        )
        rank = plan.ep_rank
        self.experts = FusedExperts(
            cfg.num_experts,
            placement.local_experts(rank),
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            inter_rank,
            inter_size,
            expert_activation(spec.activation, cfg.hidden_act, cfg.swiglu_limit, cfg.swiglu_alpha),
            cfg.dtype,
            bias=spec.expert_bias,
            weight_on_input=spec.weights_input and not self.prescale,
            slot_map=None if placement.is_identity else placement.slot_map(rank),
        )
        # Deterministic mode (distributed/fixed_sum.py): the intermediate dim in fixed chunks; the
        # ranks holding different shards of every expert (tp, dp_tp modes: the "ep" group, indexed
        # by shard rank) add their (token, pick) subtree sums in tree order before any weighting.
        self.fixed = bool(getattr(groups.ep, "fixed_chunks", 0))
        self.shard_group = None
        if self.fixed:
            self.gate.pw = pointwise  # sigmoid scores: bits independent of the batch size
            self.adds_identity = True  # the routed sum is whole on every rank: nothing sums over TP
            shards = 1 if plan.expert_parallel else plan.weight_shard_size
            chunks = chunk_count(cfg.moe_intermediate_size, shards, "an expert's intermediate size")
            self.experts.fixed_chunks = chunks // shards
            if not plan.expert_parallel:
                self.shard_group = groups.ep
                if (groups.ep.world_size, groups.ep.rank_in_group) != (shards, plan.weight_shard_rank):
                    raise RuntimeError(f"group {groups.ep!r} does not match the MoE plan {plan!r}")
        self._set_placement(placement)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert is not None and spec.shared_width:
            lookup(dict.fromkeys(SHARED_EXPERTS), spec.shared_expert, "shared expert")
            # A dense MLP under plain TP, on the full local batch (never on an SP slice).
            mlp = UngatedMLP if spec.shared_expert == "ungated" else GatedMLP
            limit = cfg.swiglu_limit if spec.shared_expert == "clamped" else None
            extra = {} if limit is None else {"limit": limit}
            self.shared_expert = mlp(
                cfg.hidden_size, spec.shared_width, cfg.hidden_act, groups.tp, False, cfg.dtype, **extra
            )
            if spec.shared_expert == "sigmoid_gated":
                self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False, dtype=cfg.dtype)

    def _set_placement(self, placement: ExpertPlacement) -> None:
        """Routing tables for `placement`: each expert's slots ([E, max replicas], padded with its
        first) and their number; none when slot e is expert e."""
        self.placement = placement
        self.replica_slots = self.replica_count = None
        if not placement.is_identity:
            reps = placement.replicas()
            width = max(len(r) for r in reps)
            self.replica_slots = torch.tensor([r + r[:1] * (width - len(r)) for r in reps], dtype=torch.int64)
            self.replica_count = torch.tensor([len(r) for r in reps], dtype=torch.int64)
        if self.dispatcher is not None:
            self.dispatcher.set_expert_owner(torch.tensor(placement.slot_rank, dtype=torch.int64))

    def to_slots(self, ids: torch.Tensor, first_token: int) -> torch.Tensor:
        """[n, k] logical experts -> [n, k] physical slots: token i (counted from `first_token`,
        this rank's offset in the dispatch group) takes replica i mod the expert's count."""
        if self.replica_slots is None:
            return ids
        if self.replica_slots.device != ids.device:  # moved once, then reused
            self.replica_slots = self.replica_slots.to(ids.device)
            self.replica_count = self.replica_count.to(ids.device)
        token = torch.arange(first_token, first_token + ids.shape[0], device=ids.device).unsqueeze(1)
        if not self.num_identity:
            return self.replica_slots[ids, token % self.replica_count[ids]]
        real = ids.clamp(min=0)  # NO_EXPERT places stay NO_EXPERT
        slots = self.replica_slots[real, token % self.replica_count[real]]
        return torch.where(ids >= 0, slots, torch.full_like(slots, NO_EXPERT))

    def apply_placement(self, new: ExpertPlacement) -> int:
        """EPLB between steps, on every rank of the EP group at once: move the expert weights to
        `new` and route by it from the next step on. Returns the bytes this rank sent."""
        if self.ep_group is None:
            raise ValueError("a rebalance needs expert parallelism")
        rank = self.plan.ep_rank
        sent = move_expert_weights(self.experts, self.placement, new, self.ep_group, rank)
        self.experts.set_slots(new.local_experts(rank), new.slot_map(rank))
        self._set_placement(new)
        return sent

    def dispatch_sizes(self, ctx: ForwardContext) -> list[int]:
        if self.plan.sequence_parallel:
            return [size for n in ctx.dp_token_counts for size in self.plan.sp_sizes(n)]
        return list(ctx.dp_token_counts)

    def routed(
        self, x: torch.Tensor, ctx: ForwardContext, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`token_ids`: x's rows' token ids, for a router that routes by them (hash routing)."""
        weights, ids = self.gate(x, token_ids) if getattr(self.gate, "by_token", False) else self.gate(x)
        identity = None
        if self.num_identity:  # identity picks leave the selection here: never sent, never computed
            identity, weights, ids = split_identity(weights, ids, self.num_real)
        if self.prescale:
            x, weights = x * weights.to(x.dtype), torch.ones_like(weights)
        sizes = None if self.dispatcher is None else self.dispatch_sizes(ctx)
        first = 0 if sizes is None else sum(sizes[: self.dispatcher.group.rank_in_group])
        logical, ids = ids, self.to_slots(ids, first)
        if self.load is not None and ctx.count_load:
            flat = ids.flatten()
            if self.num_identity:
                flat = flat[flat >= 0]
            self.load.index_add_(0, flat, flat.new_ones(1).expand(flat.numel()))
        if self.dispatcher is None:
            x_all, ids_all, w_all = x, ids, weights
        else:
            x_all, ids_all, w_all = self.dispatcher.dispatch(x, ids, weights, sizes)
        if self.fixed:
            y = self._fixed_experts(x_all, ids_all, w_all, sizes, logical)
        elif self.dispatcher is None:
            y = self.experts(x_all, ids_all, w_all)
        else:
            y = self.dispatcher.combine(self.experts(x_all, ids_all, w_all), sizes)
        if identity is not None and self.adds_identity:
            y = y + x.float() * identity
        return y

    def _fixed_experts(self, x_all, ids_all, w_all, sizes, logical) -> torch.Tensor:
        """Deterministic mode: [n, H] float32, the whole routed sum for this rank's tokens, its picks
        added in the order of their logical expert ids (`logical` [n, k]) as one process adds them.
        Sharded experts (tp, dp_tp): every (token, pick)'s whole output by the fixed tree over the
        shards. Whole experts (EP): each pick is computed on one rank only, so its term travels
        back alone (the exchange adds zeros to it: exact) and the source adds the picks; with
        top-k <= 2 the ranks' local sums are sent instead (at most two non-zero terms meet, and
        a + b = b + a), k times fewer bytes."""
        sums = self.experts.pair_sums(x_all, ids_all, w_all)  # [m, k, H]
        if self.shard_group is not None:
            sums = self.shard_group.ordered_sum(sums)  # every expert's whole output, same bits
            if self.dispatcher is not None:  # the gathered tokens of the DP group: keep ours
                own = self.dispatcher._own_rows(sizes)
                sums, ids_all, w_all = sums[own], ids_all[own], w_all[own]
            return self.experts.add_picks(self.experts.pick_terms(sums, ids_all, w_all), logical)
        # EP: whole experts; without a dispatcher (mode "ep", DP 1) the TP ranks hold them
        over_tp = self.dispatcher is None and self.tp.world_size > 1
        if self.dispatcher is None and not over_tp:
            return self.experts.add_picks(self.experts.pick_terms(sums, ids_all, w_all), logical)
        m, k, hidden = sums.shape
        if k <= 2:
            y = self.experts.finish(sums, ids_all, w_all)
            return self.tp.all_reduce(y) if over_tp else self.dispatcher.combine(y, sizes)
        terms = self.experts.pick_terms(sums, ids_all, w_all).reshape(m, k * hidden)
        terms = self.tp.all_reduce(terms) if over_tp else self.dispatcher.combine(terms, sizes)
        return self.experts.add_picks(terms.view(-1, k, hidden), logical)

    def native_form(self, keep: list) -> dict | None:
        """Router and experts of a native decode layer (cpu/native_decode.py), when this block
        has no collective (no EP dispatch, no TP or SP), no shared expert and no input weighting."""
        local = self.dispatcher is None and not self.plan.sequence_parallel and self.tp.world_size == 1
        if not local or self.shared_expert is not None or self.prescale or self.num_identity:
            return None
        router, experts = self.gate.native_form(keep), self.experts.native_form(keep)
        if router is None or experts is None or router["experts"] != self.experts.num_experts:
            return None
        load = self.load if self.load is not None and self.load.is_contiguous() else None
        if self.load is not None and load is None:
            return None
        self._native_load = load  # the counters the descriptor adds to (ExpertLoad's view)
        return {**router, **experts, "load": None if load is None else load.data_ptr()}

    _native_load: torch.Tensor | None = None

    def native_routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """routed()'s routing of x for a native decode layer (its experts all local, no dispatch):
        slots [n, k] int32 and weights [n, k] float32; the native call counts the load."""
        weights, ids = self.gate(x)
        slots = self.to_slots(ids, 0).to(torch.int32).contiguous()
        return slots, weights.to(torch.float32).contiguous()

    def native_now(self, ctx: ForwardContext) -> bool:
        """What may change after the descriptor was built: the load counters, EPLB's slots."""
        return self.load is self._native_load and self._modules["experts"].all_local  # not __getattr__

    def _token_ids(self, ctx: ForwardContext, part: slice | None = None) -> torch.Tensor | None:
        """The step's token ids (of the SP slice `part`) for a hash router; None otherwise."""
        ids = ctx.input_ids if getattr(self.gate, "by_token", False) else None
        return ids if ids is None or part is None else ids[part]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [n, H] replicated over TP -> [n, H] replicated over TP, in x's dtype.

        The experts' and the shared expert's outputs are float32 partial sums; they are summed
        in float32 (the combine, the TP all-reduce) and rounded to x's dtype once, after the
        last sum, in every layout and in one process alike.
        """
        if self.fixed:
            return self._fixed_forward(x, ctx)
        shared = None
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # [n, H] float32, TP-partial
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(self.shared_expert_gate(x).float()) * shared
        if self.plan.sequence_parallel:
            sizes = self.plan.sp_sizes(x.shape[0])
            part = self.plan.sp_slice(x.shape[0])
            y = self.routed(x[part], ctx, self._token_ids(ctx, part))  # float32, summed over EP
            if shared is None:  # a gather sums nothing: round first, half the bytes
                return self.tp.all_gather_v(y.to(x.dtype), sizes)
            return (self.tp.all_gather_v(y, sizes) + self.tp.all_reduce(shared)).to(x.dtype)
        y = self.routed(x, ctx, self._token_ids(ctx))  # float32
        if shared is not None:
            y = y + shared
        return self.tp.all_reduce(y).to(x.dtype)

    def _fixed_forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """forward() in deterministic mode: the shared expert's down projection and the routed sum
        are whole on every rank already (fixed trees; picks added in expert-id order)."""
        shared = None
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # [n, H] float32, whole
            if self.shared_expert_gate is not None:
                shared = pointwise(F.sigmoid, self.shared_expert_gate(x).float()) * shared
        if self.plan.sequence_parallel:
            part = self.plan.sp_slice(x.shape[0])
            y = self.routed(x[part], ctx, self._token_ids(ctx, part))  # float32, summed over EP
            y = self.tp.all_gather_v(y, self.plan.sp_sizes(x.shape[0]))
        else:
            # whole: the EP exchange (or the TP all-reduce) is routed()'s
            y = self.routed(x, ctx, self._token_ids(ctx))
        return (y if shared is None else y + shared).to(x.dtype)
