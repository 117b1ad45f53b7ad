"""Expert-parallel load balancing (EPLB): a placement from measured load, and moving the weights.

vLLM's terms: E logical experts, ``num_redundant_experts`` R extra physical slots holding
replicas of the hottest ones, E + R physical slots over the EP ranks (``moe_plan.slots_per_rank``).

``balanced_placement`` (moe_plan.py) decides where replicas go; this module moves the weights.

``move_expert_weights`` carries a layer from one placement to the next between steps: every rank
of the EP group calls it with the same two placements (lockstep), each slot that changes expert
receives it from the lowest rank that held it, over ``all_to_all_single`` per weight tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from expertmesh.distributed.moe_plan import ExpertPlacement, balanced_placement, replica_counts

__all__ = ["balanced_placement", "check_movable", "move_expert_weights", "replica_counts", "slot_form"]


def move_expert_weights(
    experts: Any, old: ExpertPlacement, new: ExpertPlacement, group: Any, ep_rank: int
) -> int:
    """Fill this rank's slots for `new` from wherever `old` had each expert; returns bytes sent.

    `experts` exposes ``slot_tensors(i) -> list[Tensor]`` (views of local slot i's storage, the
    same shapes and dtypes in every slot), whatever the weight format. Every rank of the EP group
    (`group`, ``rank_in_group == ep_rank``) must call this with the same placements.
    """
    if old.num_slots != new.num_slots or old.ep_size != new.ep_size:
        raise ValueError("a rebalance keeps the slots: old and new placements differ in shape")
    plan = _transfers(old, new)  # (src rank, src local slot, dst rank, dst local slot)
    outgoing = [t for t in plan if t[0] == ep_rank]
    incoming = [t for t in plan if t[2] == ep_rank]
    W = new.ep_size
    send_splits = [sum(1 for t in outgoing if t[2] == r) for r in range(W)]
    recv_splits = [sum(1 for t in incoming if t[0] == r) for r in range(W)]
    # Outgoing sorted by destination, incoming by source: the order all_to_all_single keeps.
    outgoing.sort(key=lambda t: (t[2], t[3]))
    incoming.sort(key=lambda t: (t[0], t[3]))
    sent = 0
    for j in range(len(experts.slot_tensors(0))):  # every rank has >= 1 slot
        like = experts.slot_tensors(0)[j]
        # Copies first: a slot may be both a source and a destination.
        rows = [experts.slot_tensors(t[1])[j] for t in outgoing]
        send = torch.stack(rows) if rows else like.new_empty((0, *like.shape))
        recv = group.all_to_all_single(send, recv_splits, send_splits) if W > 1 else send
        for row, t in enumerate(incoming):
            experts.slot_tensors(t[3])[j].copy_(recv[row])
        sent += (sum(send_splits) - send_splits[ep_rank]) * like.numel() * like.element_size()
    return sent


def slot_form(experts: Any, what: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each tensor `slot_tensors` gives: what EPLB moves a slot, the same for
    every local slot (an expert may land in any), else an error naming `what` and the forms."""
    try:
        forms = [
            [(tuple(t.shape), str(t.dtype)) for t in experts.slot_tensors(i)]
            for i in range(len(experts.expert_ids))
        ]
    except (AttributeError, TypeError) as e:  # a weight form slot_tensors does not know
        raise ValueError(f"EPLB cannot move the experts of {what}: {e}") from e
    for i, form in enumerate(forms):
        if form != forms[0]:
            raise ValueError(
                f"EPLB cannot move the experts of {what}: local slots 0 and {i} hold different forms "
                f"({forms[0]} vs {form})"
            )
    return forms[0] if forms else []


def check_movable(moes: list[Any], group: Any) -> None:
    """Before the first online rebalance: every MoE layer's slots hold one form on every rank of
    the EP group (`group`; a collective), so each all_to_all of a move has one row shape."""
    forms = [slot_form(m.experts, f"MoE layer {m.layer_index}") for m in moes]
    ranks = group.all_gather_object(forms)
    for r, theirs in enumerate(ranks):
        for m, mine, other in zip(moes, forms, theirs, strict=True):
            if other != mine:
                raise ValueError(
                    f"EPLB cannot move the experts of MoE layer {m.layer_index}: EP rank {r} holds "
                    f"them as {other}, EP rank {group.rank_in_group} as {mine}"
                )


def _transfers(old: ExpertPlacement, new: ExpertPlacement) -> list[tuple[int, int, int, int]]:
    """For each slot whose expert changes (or moves in), where it comes from: the lowest rank that
    held it under `old` (the destination itself when it already had it, a local copy)."""
    old_rank = old.slot_rank
    out = []
    for rank in range(new.ep_size):
        before = old.local_experts(rank)
        for i, e in enumerate(new.local_experts(rank)):
            if i < len(before) and before[i] == e:
                continue  # already in place
            if e in before:
                out.append((rank, before.index(e), rank, i))
                continue
            src_slot = min(s for s, x in enumerate(old.slot_expert) if x == e)
            src = old_rank[src_slot]
            out.append((src, old.local_slots(src).index(src_slot), rank, i))
    return out
