"""Where MoE weights live, which group exchanges tokens, and how partial sums are reduced.

Decided once per rank from the layout (DESIGN.md section 4). Invariant: gather across exactly
the ranks that hold different tokens; sum partial results exactly once across exactly the ranks
that hold different weight shards.

  mode    when                  weights (shard rank / size)        dispatch  after
  ------  --------------------  ---------------------------------  --------  -------------
  tp      DP=1, EP off          intermediate dim, tp / TP          -         tp_all_reduce
  dp_tp   DP>1, EP off          intermediate dim, dp*TP+tp / DP*TP dp        tp_all_reduce
  ep      EP on, DP=1           whole experts, tp / TP (EP = TP)   -         tp_all_reduce
  ep      EP on, DP>1, TP=1     whole experts, dp / DP (EP = DP)   ep        none
  ep_sp   EP on, DP>1, TP>1     whole experts, dp*TP+tp / DP*TP    ep        tp_all_gather

In every row the shard rank is dp * TP + tp over DP * TP ranks (the index in the "ep" group):
with DP=1 it is tp, with TP=1 it is dp. In ep_sp each TP rank runs the MoE on its
``sp_slice(n)`` (ceil(n / TP) tokens, trailing ranks shorter), and the TP all-gather of
``sp_sizes(n)`` rebuilds the n rows. Shared experts are dense: plain TP on the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from expertmesh.distributed.layout import ParallelLayout

MoEMode = Literal["tp", "dp_tp", "ep", "ep_sp"]
DispatchGroup = Literal["dp", "ep"]
ReduceAfter = Literal["tp_all_reduce", "none", "tp_all_gather"]
Placement = Literal["contiguous", "round_robin"]


def local_slot_map(num_experts: int, local: list[int]) -> torch.Tensor:
    """[E] int64: global expert id -> its index in `local`, -1 for experts held elsewhere."""
    mapping = torch.full((num_experts,), -1, dtype=torch.int64)
    mapping[torch.tensor(local, dtype=torch.int64)] = torch.arange(len(local), dtype=torch.int64)
    return mapping


def expert_owners(num_experts: int, ep_size: int, placement: Placement = "contiguous") -> list[int]:
    """EP rank owning each expert: E // ep per rank, the first E % ep ranks one more."""
    if num_experts < 1 or ep_size < 1:
        raise ValueError(f"num_experts={num_experts} and ep_size={ep_size} must be >= 1")
    if placement == "round_robin":
        return [e % ep_size for e in range(num_experts)]
    if placement != "contiguous":
        raise ValueError(f"unknown expert placement {placement!r}; valid: contiguous, round_robin")
    base, extra = divmod(num_experts, ep_size)
    owners: list[int] = []
    for rank in range(ep_size):
        owners += [rank] * (base + (1 if rank < extra else 0))
    return owners


@dataclass(frozen=True)
class MoEPlan:
    mode: MoEMode
    weight_shard_rank: int
    weight_shard_size: int
    dispatch_group_name: DispatchGroup | None
    reduce_after: ReduceAfter
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def expert_parallel(self) -> bool:
        return self.mode in ("ep", "ep_sp")

    @property
    def sequence_parallel(self) -> bool:
        return self.mode == "ep_sp"

    def sp_sizes(self, n: int) -> list[int]:
        """Tokens each TP rank takes in ep_sp mode: ceil(n / TP), trailing ranks fewer (maybe 0)."""
        if not self.sequence_parallel:
            raise ValueError(f"sp_sizes is for mode 'ep_sp', not {self.mode!r}")
        chunk = -(-n // self.tp_size)
        return [max(0, min(chunk, n - r * chunk)) for r in range(self.tp_size)]

    def sp_slice(self, n: int) -> slice:
        """This TP rank's rows of the n local tokens in ep_sp mode."""
        sizes = self.sp_sizes(n)
        start = sum(sizes[: self.tp_rank])
        return slice(start, start + sizes[self.tp_rank])

    def local_experts(self, num_experts: int, placement: Placement = "contiguous") -> list[int]:
        """Global ids of the experts on this rank, ascending.

        In EP modes, whole experts by ``expert_owners``; otherwise every rank holds a shard of
        every expert, so all ids.
        """
        owners = expert_owners(num_experts, self.weight_shard_size, placement)
        if not self.expert_parallel:
            return list(range(num_experts))
        return [e for e, owner in enumerate(owners) if owner == self.weight_shard_rank]

    def expert_map(self, num_experts: int, placement: Placement = "contiguous") -> torch.Tensor:
        """[E] int64: global expert id -> local index on this rank, -1 where not local."""
        return local_slot_map(num_experts, self.local_experts(num_experts, placement))

    @staticmethod
    def decide(layout: ParallelLayout, global_rank: int) -> MoEPlan:
        dp, _, tp = layout.coords(global_rank)
        DP, TP = layout.dp, layout.tp  # the table's names
        flat = dict(weight_shard_rank=dp * TP + tp, weight_shard_size=DP * TP, tp_rank=tp, tp_size=TP)
        if not layout.enable_expert_parallel:
            if DP == 1:
                return MoEPlan("tp", dispatch_group_name=None, reduce_after="tp_all_reduce", **flat)
            return MoEPlan("dp_tp", dispatch_group_name="dp", reduce_after="tp_all_reduce", **flat)
        if DP == 1:
            # Tokens are identical across TP; each rank runs its own experts on all of them.
            return MoEPlan("ep", dispatch_group_name=None, reduce_after="tp_all_reduce", **flat)
        if TP == 1:
            return MoEPlan("ep", dispatch_group_name="ep", reduce_after="none", **flat)
        return MoEPlan("ep_sp", dispatch_group_name="ep", reduce_after="tp_all_gather", **flat)
