"""What a model's layers receive (`ModelEnv`): their process groups, the MoE plan, the all2all
backend and pipeline stage, never the environment. Built by engine/builder.py; the model classes,
the loader's one-rank twin and the layers take it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from expertmesh.distributed.all2all import All2AllBackend, make_all2all
from expertmesh.distributed.moe_plan import ExpertPlacement, MoEPlan, expert_owners
from expertmesh.distributed.parallel_groups import ParallelGroups


@dataclass
class ModelEnv:
    """What a model's layers receive: their groups and decisions, never the environment."""

    groups: ParallelGroups
    moe_plan: MoEPlan
    all2all_backend: str
    layer_range: range
    expert_placement: str = "contiguous"
    poison_recv: bool = False
    dispatchers: list[All2AllBackend] = field(default_factory=list)
    num_redundant_experts: int = 0  # EPLB: physical expert slots beyond the logical experts
    initial_load: dict[int, list[int]] | None = None  # EPLB: measured load per layer, per expert

    def placement_for(self, layer: int, num_experts: int) -> ExpertPlacement:
        """Where layer `layer`'s experts start: the plan's placement, balanced for EPLB."""
        load = None if self.initial_load is None else self.initial_load.get(layer)
        if self.initial_load is not None and load is None:
            raise ValueError(f"the EPLB load file has no counts for MoE layer {layer}")
        if load is not None and len(load) != num_experts:
            raise ValueError(f"EPLB load for layer {layer} has {len(load)} experts, the model {num_experts}")
        return self.moe_plan.expert_placement(
            num_experts, self.expert_placement, self.num_redundant_experts, load
        )

    @property
    def is_first_stage(self) -> bool:
        return self.groups.pp.rank_in_group == 0

    @property
    def is_last_stage(self) -> bool:
        return self.groups.pp.rank_in_group == self.groups.pp.world_size - 1

    def make_dispatcher(self, num_experts: int) -> All2AllBackend | None:
        """One backend per MoE layer (so traffic is counted per layer), on the plan's group.

        "alltoall" routes tokens by expert owner, with the placement the layer's experts use (it
        needs expert parallelism: ParallelConfig checks that).
        """
        plan = self.moe_plan
        name = plan.dispatch_group_name
        if name is None:
            return None
        group = self.groups.get(name)
        owner = None
        if self.all2all_backend == "alltoall":
            # The owners are EP-group indices: that group's rank order is the weight shard rank.
            if (group.world_size, group.rank_in_group) != (plan.weight_shard_size, plan.weight_shard_rank):
                raise RuntimeError(f"group {group!r} does not match the MoE plan {plan!r}")
            owners = expert_owners(num_experts, plan.weight_shard_size, self.expert_placement)
            owner = torch.tensor(owners, dtype=torch.int64)  # [E]
        backend = make_all2all(self.all2all_backend, group, poison_recv=self.poison_recv, expert_owner=owner)
        self.dispatchers.append(backend)
        return backend
