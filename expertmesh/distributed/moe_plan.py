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

Where each expert lives is an ``ExpertPlacement`` per MoE layer: physical slots (the E logical
experts plus ``num_redundant_experts`` replicas, vLLM's EPLB terms), each on one EP rank, every
rank a fixed number of them. The plan makes the start-up placement (``expert_placement``); EPLB
(distributed/eplb.py) only ever hands a layer a new ``ExpertPlacement`` with the same slots.

``balanced_placement`` (EPLB's, deterministic, so every rank computes the same one from the same counts):
  1. replicas: R times, one more replica for the expert with the highest load per replica
     (ties: the lower id), never more replicas than EP ranks;
  2. packing: replicas in order of falling load per replica, each onto the EP rank with the least
     load so far among those with a free slot that do not hold that expert yet (ties: lower rank).
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
    # made as a list: an index_put on meta (the loader's twin) runs torch's Python decompositions
    mapping = [-1] * num_experts
    for i, e in enumerate(local):
        mapping[e] = i
    return torch.tensor(mapping, dtype=torch.int64)


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


def slots_per_rank(num_slots: int, ep_size: int) -> list[int]:
    """Physical expert slots of each EP rank: P // ep, the first P % ep ranks one more."""
    base, extra = divmod(num_slots, ep_size)
    return [base + (1 if r < extra else 0) for r in range(ep_size)]


@dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer's physical expert slots: which logical expert each holds, on which EP rank.

    Slots are numbered rank by rank (rank 0's first), ``slots_per_rank`` of them each, so a slot
    never changes rank; a rebalance only changes ``slot_expert``. Every logical expert has at
    least one slot and never two on one rank.
    """

    slot_expert: tuple[int, ...]  # [P] logical expert held by each physical slot
    num_experts: int
    ep_size: int

    def __post_init__(self) -> None:
        held = set(self.slot_expert)
        if held != set(range(self.num_experts)):
            missing = sorted(set(range(self.num_experts)) - held)
            raise ValueError(f"expert placement: experts {missing} have no slot (slots {self.slot_expert})")
        for rank in range(self.ep_size):
            mine = self.local_experts(rank)
            if len(set(mine)) != len(mine):
                raise ValueError(f"expert placement: EP rank {rank} holds an expert twice: {mine}")

    @property
    def num_slots(self) -> int:
        return len(self.slot_expert)

    @property
    def slot_rank(self) -> list[int]:
        """[P] EP rank of each slot."""
        return [r for r, n in enumerate(slots_per_rank(self.num_slots, self.ep_size)) for _ in range(n)]

    def local_slots(self, rank: int) -> list[int]:
        start = sum(slots_per_rank(self.num_slots, self.ep_size)[:rank])
        return list(range(start, start + slots_per_rank(self.num_slots, self.ep_size)[rank]))

    def local_experts(self, rank: int) -> list[int]:
        """Logical expert of each of `rank`'s slots, in slot order."""
        return [self.slot_expert[s] for s in self.local_slots(rank)]

    def slot_map(self, rank: int) -> torch.Tensor:
        """[P] int64: physical slot -> index among `rank`'s slots, -1 for slots elsewhere."""
        return local_slot_map(self.num_slots, self.local_slots(rank))

    def replicas(self) -> list[list[int]]:
        """Physical slots of each logical expert, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, e in enumerate(self.slot_expert):
            out[e].append(slot)
        return out

    @property
    def is_identity(self) -> bool:
        """Slot e holds expert e: routing ids are already slot ids."""
        return self.slot_expert == tuple(range(self.num_experts))

    def expert_load_per_rank(self, slot_counts: list[int]) -> list[int]:
        """(token, expert) pairs each EP rank computes, from counts per physical slot."""
        out = [0] * self.ep_size
        for slot, rank in enumerate(self.slot_rank):
            out[rank] += int(slot_counts[slot])
        return out


def static_placement(num_experts: int, ep_size: int, placement: Placement = "contiguous") -> ExpertPlacement:
    """No replicas: the experts by ``expert_owners``, each rank's in ascending order."""
    owners = expert_owners(num_experts, ep_size, placement)
    order = sorted(range(num_experts), key=lambda e: (owners[e], e))
    return ExpertPlacement(tuple(order), num_experts, ep_size)


def replica_counts(load: list[float], num_slots: int, ep_size: int) -> list[int]:
    """Replicas of each logical expert: one each, then the extra slots to the hottest per replica."""
    num_experts = len(load)
    extra = num_slots - num_experts
    if extra < 0 or extra > num_experts * (ep_size - 1):
        raise ValueError(
            f"num_redundant_experts={extra} must be between 0 and num_experts x (EP size - 1) = "
            f"{num_experts * (ep_size - 1)}: no EP rank holds two copies of one expert"
        )
    counts = [1] * num_experts
    for _ in range(extra):
        best = max(
            (e for e in range(num_experts) if counts[e] < ep_size), key=lambda e: (load[e] / counts[e], -e)
        )
        counts[best] += 1
    return counts


def balanced_placement(load: list[float], ep_size: int, num_slots: int) -> ExpertPlacement:
    """The placement of E = len(load) experts in `num_slots` slots that evens the load per EP rank."""
    num_experts = len(load)
    if num_slots < ep_size:
        raise ValueError(f"{num_slots} expert slots cannot fill {ep_size} EP ranks (each needs one)")
    if any(v < 0 for v in load):
        raise ValueError(f"expert load must be >= 0, got {list(load)}")
    counts = replica_counts([float(v) for v in load], num_slots, ep_size)
    capacity = slots_per_rank(num_slots, ep_size)
    items = sorted(
        ((load[e] / counts[e], e) for e in range(num_experts) for _ in range(counts[e])),
        key=lambda it: (-it[0], it[1]),
    )
    held: list[list[int]] = [[] for _ in range(ep_size)]
    rank_load = [0.0] * ep_size
    for share, e in items:
        free = [r for r in range(ep_size) if len(held[r]) < capacity[r] and e not in held[r]]
        if not free:
            free = [_make_room(held, capacity, e)]
        rank = min(free, key=lambda r: (rank_load[r], r))
        held[rank].append(e)
        rank_load[rank] += share
    return ExpertPlacement(tuple(e for mine in held for e in sorted(mine)), num_experts, ep_size)


def _make_room(held: list[list[int]], capacity: list[int], e: int) -> int:
    """Every rank with a free slot already holds `e`: move one of another rank's experts into that
    free slot, freeing a place for `e` there. Returns the rank that now has room."""
    for q in range(len(held)):
        if len(held[q]) >= capacity[q]:
            continue
        for p in range(len(held)):
            if e in held[p]:
                continue
            for f in held[p]:
                if f not in held[q]:
                    held[p].remove(f)
                    held[q].append(f)
                    return p
    raise RuntimeError(f"no placement keeps expert {e}'s replicas on distinct EP ranks")  # not reachable


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

    @property
    def ep_rank(self) -> int:
        """This rank's index among the ranks that split the experts (0 when nobody splits them)."""
        return self.weight_shard_rank if self.expert_parallel else 0

    @property
    def ep_size(self) -> int:
        return self.weight_shard_size if self.expert_parallel else 1

    @property
    def count_group_name(self) -> DispatchGroup | None:
        """The group whose ranks route different tokens (load counts are summed over it)."""
        return self.dispatch_group_name

    def expert_placement(
        self,
        num_experts: int,
        placement: Placement = "contiguous",
        num_redundant_experts: int = 0,
        load: list[int] | None = None,
    ) -> ExpertPlacement:
        """The start-up placement of one MoE layer: static without EPLB; with redundant experts
        or a measured `load` (per logical expert), balanced packing (distributed/eplb.py)."""
        if not self.expert_parallel:
            if num_redundant_experts or load is not None:
                raise ValueError(
                    "EPLB (enable_eplb, num_redundant_experts) needs enable_expert_parallel=True: "
                    f"in MoE mode {self.mode!r} every rank holds a slice of every expert"
                )
            return static_placement(num_experts, 1)
        if not num_redundant_experts and load is None:
            return static_placement(num_experts, self.ep_size, placement)
        return balanced_placement(
            [1] * num_experts if load is None else load, self.ep_size, num_experts + num_redundant_experts
        )

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
