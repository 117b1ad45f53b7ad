"""Expert load statistics of one rank's MoE layers, and EPLB's online rebalance.

Hot path: each MoE layer adds its (token, expert) pairs per physical slot into its row of one
preallocated [layers, slots] int64 tensor (an index_add; no host sync, nothing per step but a
copy of that tensor). Dummy lockstep forwards are not counted.

Counts are of this rank's routed tokens; ``snapshot`` sums them over the group whose ranks route
different tokens (the plan's count group: DP, or EP under sequence parallelism) and gathers the
pipeline stages' layers, so every rank gets the same whole-model answer. It is a collective:
every rank calls it at the same point (as with ``generate``).

The dict (``LLM.expert_load()``; JSON with string layer keys):
  num_experts, num_slots, top_k, ep_size, steps (counted forwards)
  layers          {layer: [pairs routed to each logical expert]}, cumulative
  last_step       {layer: [pairs per logical expert]} of the last counted forward
  tokens          {layer: tokens routed} (= sum(layers[layer]) / top_k)
  ep_rank_tokens  {layer: [pairs each EP rank computed]}, cumulative (one entry without EP)
  imbalance       {layer: max / mean of ep_rank_tokens} (1.0 = even; 0 tokens: 1.0)
  mean_imbalance  mean over layers
  placement       {layer: [[logical expert of each slot] per EP rank]}, now
  rebalances      online EPLB rebalances so far
  eplb_bytes_sent expert weight bytes the rebalances sent to other ranks, summed over all ranks
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from expertmesh.distributed.eplb import balanced_placement, check_movable
from expertmesh.layers.moe import MoE

log = logging.getLogger("expertmesh")


class ExpertLoad:
    def __init__(self, model: torch.nn.Module, plan: Any, groups: Any, top_k: int, num_experts: int) -> None:
        # The target's MoE layers; an MTP layer's (spec_decode/mtp.py) is not counted (its drafts run
        # with count_load=False) nor rebalanced.
        mtp = getattr(model, "mtp", None)
        drafting = {id(m) for m in mtp.modules()} if mtp is not None else set()
        moes = (m for m in model.modules() if isinstance(m, MoE) and id(m) not in drafting)
        self.moes = sorted(moes, key=lambda m: m.layer_index)
        self.plan, self.groups, self.top_k, self.num_experts = plan, groups, top_k, num_experts
        name = plan.count_group_name
        self.count_group = groups.get(name) if name is not None else None
        slots = max((m.placement.num_slots for m in self.moes), default=0)
        self.counts = torch.zeros(len(self.moes), slots, dtype=torch.int64)  # since the last fold
        self.before_step = torch.zeros_like(self.counts)
        # Folded counts (per logical expert and per EP rank) from before the last rebalance.
        self.folded_experts = torch.zeros(len(self.moes), num_experts, dtype=torch.int64)
        self.folded_ranks = torch.zeros(len(self.moes), plan.ep_size, dtype=torch.int64)
        for i, moe in enumerate(self.moes):
            moe.load = self.counts[i, : moe.placement.num_slots]
        self.steps = self.rebalances = self.bytes_moved = 0
        self.step_interval = 0  # EPLB online: rebalance every N counted forwards (0 = never)
        self.log_interval = 0  # log the balancedness every N forwards (0 = never)
        # EPLB's window_size: the last W forwards' pairs per logical expert, [W, layers, experts]
        # (a ring; logical experts, so it keeps its meaning across rebalances). None: no window.
        self.window: torch.Tensor | None = None
        self.window_filled = 0
        self._index_slots()

    def configure(self, eplb: Any | None) -> None:
        """EPLB's online settings from an EPLBConfig (None: counting only, no EPLB)."""
        self.step_interval = eplb.step_interval if eplb is not None else 0
        self.log_interval = (
            eplb.log_balancedness_interval if eplb is not None and eplb.log_balancedness else 0
        )
        size = eplb.window_size if eplb is not None else None
        shape = (size or 0, len(self.moes), self.num_experts)
        self.window = (
            None if size is None else torch.zeros(shape, dtype=torch.int64, device=self.counts.device)
        )
        if self.step_interval and self.moes and self.moes[0].ep_group is not None:
            check_movable(self.moes, self.moes[0].ep_group)  # fails loudly here, not mid-generate
        if eplb is not None and eplb.use_async:
            log.info("EPLB use_async=True: expert weights move synchronously here, at the rebalance step")

    def to(self, device: str | torch.device) -> ExpertLoad:
        for name in ("counts", "before_step", "slot_expert"):
            setattr(self, name, getattr(self, name).to(device))
        if self.window is not None:
            self.window = self.window.to(device)
        for i, moe in enumerate(self.moes):
            moe.load = self.counts[i, : moe.placement.num_slots]
        return self

    def _index_slots(self) -> None:
        """slot_expert [layers, slots]: each slot's logical expert (padding slots: num_experts)."""
        index = torch.full(tuple(self.counts.shape), self.num_experts, dtype=torch.int64)
        for i, moe in enumerate(self.moes):
            index[i, : moe.placement.num_slots] = torch.tensor(moe.placement.slot_expert, dtype=torch.int64)
        self.slot_expert = index.to(self.counts.device)

    # ---- per step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before every forward (dummies too, so the ranks agree on when): log the balancedness
        and rebalance when it is time; note where the step starts."""
        if self.log_interval and self.steps and self.steps % self.log_interval == 0:
            self._log_balancedness()
        if self.step_interval and self.steps and self.steps % self.step_interval == 0:
            self.rebalance()
        self.before_step.copy_(self.counts)
        self.steps += 1

    def end_step(self) -> None:
        """After a forward: its pairs per logical expert into EPLB's window (when it keeps one)."""
        if self.window is None:
            return
        step = self.counts - self.before_step
        per_expert = torch.zeros(step.shape[0], self.num_experts + 1, dtype=step.dtype, device=step.device)
        per_expert.scatter_add_(1, self.slot_expert, step)
        self.window[self.window_filled % self.window.shape[0]] = per_expert[:, : self.num_experts]
        self.window_filled += 1

    def window_load(self) -> torch.Tensor:
        """[layers, experts]: the pairs of the window's forwards, summed over the ranks that route
        different tokens. A collective."""
        assert self.window is not None, "EPLB keeps no window (window_size=None)"
        load = self.window.sum(0)
        if self.count_group is not None and self.count_group.world_size > 1:
            load = self.count_group.all_reduce(load)
        return load.cpu()

    def _log_balancedness(self) -> None:
        """vLLM's balancedness, mean / max pairs of an EP rank (1.0 = even), averaged over this
        stage's MoE layers: for the last forward and since the start. A collective."""
        total, step, _, f_ranks = self._split(self._summed())
        last, overall = [], []
        for i, moe in enumerate(self.moes):
            p, n = moe.placement, moe.placement.num_slots
            now = p.expert_load_per_rank(total[i, :n].tolist())
            last.append(_balancedness(p.expert_load_per_rank(step[i, :n].tolist())))
            overall.append(_balancedness([a + int(b) for a, b in zip(now, f_ranks[i], strict=True)]))
        if self.groups.world.rank_in_group == 0 and self.moes:
            log.info(
                "EPLB balancedness (mean / max pairs of an EP rank, %d MoE layers) after %d forwards: "
                "last %.3f, since the start %.3f",
                len(self.moes), self.steps, sum(last) / len(last), sum(overall) / len(overall),
            )  # fmt: skip

    # ---- reading --------------------------------------------------------------------------
    def _local(self) -> torch.Tensor:
        """This rank's counters as one int64 vector: slots (total, last step), folded experts, ranks."""
        return torch.cat(
            [
                self.counts.flatten().cpu(),
                (self.counts - self.before_step).flatten().cpu(),
                self.folded_experts.flatten(),
                self.folded_ranks.flatten(),
            ]
        )

    def _summed(self) -> torch.Tensor:
        local = self._local()
        if self.count_group is None or self.count_group.world_size == 1:
            return local
        # On the counters' device: NCCL reduces only CUDA tensors.
        return self.count_group.all_reduce(local.to(self.counts.device)).cpu()

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        L, P = self.counts.shape
        sizes = [L * P, L * P, L * self.num_experts, L * self.plan.ep_size]
        parts = torch.split(flat, sizes)
        return (
            parts[0].view(L, P),
            parts[1].view(L, P),
            parts[2].view(L, self.num_experts),
            parts[3].view(L, self.plan.ep_size),
        )

    def _per_expert(self, slot_counts: torch.Tensor, placement: Any) -> list[int]:
        out = [0] * self.num_experts
        for slot, e in enumerate(placement.slot_expert):
            out[e] += int(slot_counts[slot])
        return out

    def snapshot(self) -> dict[str, Any]:
        """The documented dict (module doc), the same on every rank. A collective."""
        total, step, f_experts, f_ranks = self._split(self._summed())
        layers, last, ranks, placement = {}, {}, {}, {}
        for i, moe in enumerate(self.moes):
            p, n = moe.placement, moe.placement.num_slots
            per_expert = self._per_expert(total[i, :n], p)
            layers[moe.layer_index] = [a + int(b) for a, b in zip(per_expert, f_experts[i], strict=True)]
            last[moe.layer_index] = self._per_expert(step[i, :n], p)
            now = p.expert_load_per_rank(total[i, :n].tolist())
            ranks[moe.layer_index] = [a + int(b) for a, b in zip(now, f_ranks[i], strict=True)]
            placement[moe.layer_index] = [p.local_experts(r) for r in range(p.ep_size)]
        part = {"layers": layers, "last_step": last, "ep_rank_tokens": ranks, "placement": placement}
        moved = self.bytes_moved
        if self.groups.world.world_size > 1:
            moved = int(self.groups.world.all_reduce(torch.tensor([moved], device=self.counts.device))[0])
        if self.groups.pp.world_size > 1:  # every stage's layers, on every rank
            merged: dict[str, dict] = {k: {} for k in part}
            for other in self.groups.pp.all_gather_object(part):
                for k in part:
                    merged[k].update(other[k])
            part = {k: dict(sorted(v.items())) for k, v in merged.items()}
        out = summarize(part, self.num_experts, self.top_k, self.plan.ep_size, self.steps, self.rebalances)
        return {**out, "eplb_bytes_sent": moved}

    # ---- EPLB -----------------------------------------------------------------------------
    def rebalance(self) -> int:
        """Online EPLB on every rank of the EP group at once: a new placement per layer from the
        load of the window's forwards, or (no window) counted since the last rebalance, summed
        over the ranks routing different tokens; the expert weights moved to it. Returns the bytes
        this rank sent."""
        if self.window is not None:  # the window's forwards, per logical expert
            by_expert = self.window_load().tolist()
        else:  # since the last rebalance (the last fold)
            total = self._split(self._summed())[0]
            by_expert = [
                self._per_expert(total[i, : m.placement.num_slots], m.placement)
                for i, m in enumerate(self.moes)
            ]
        sent = 0
        self._fold()
        for i, moe in enumerate(self.moes):
            p = moe.placement
            new = balanced_placement(by_expert[i], p.ep_size, p.num_slots)
            if new != p:
                sent += moe.apply_placement(new)
        self._index_slots()
        self.rebalances += 1
        self.bytes_moved += sent
        log.info("EPLB rebalance %d after %d steps: %d bytes sent", self.rebalances, self.steps, sent)
        return sent

    def _fold(self) -> None:
        """Slot counts change meaning with the placement: keep them per expert and per rank."""
        for i, moe in enumerate(self.moes):
            p, n = moe.placement, moe.placement.num_slots
            local = self.counts[i, :n].cpu()
            self.folded_experts[i] += torch.tensor(self._per_expert(local, p))
            self.folded_ranks[i] += torch.tensor(p.expert_load_per_rank(local.tolist()))
        self.counts.zero_()


def _balancedness(per_rank: list[int]) -> float:
    return sum(per_rank) / len(per_rank) / max(per_rank) if max(per_rank) else 1.0


def summarize(
    part: dict[str, dict], num_experts: int, top_k: int, ep_size: int, steps: int, rebalances: int
) -> dict[str, Any]:
    """The documented dict from the per-layer parts (also what a stats file holds)."""
    imbalance = {}
    for layer, ranks in part["ep_rank_tokens"].items():
        mean = sum(ranks) / len(ranks)
        imbalance[layer] = round(max(ranks) / mean, 4) if mean else 1.0
    some = next(iter(part["placement"].values()), [])
    return {
        "num_experts": num_experts,
        "num_slots": sum(len(r) for r in some),
        "top_k": top_k,
        "ep_size": ep_size,
        "steps": steps,
        "layers": part["layers"],
        "last_step": part["last_step"],
        "tokens": {layer: sum(c) // top_k for layer, c in part["layers"].items()},
        "ep_rank_tokens": part["ep_rank_tokens"],
        "imbalance": imbalance,
        "mean_imbalance": round(sum(imbalance.values()) / len(imbalance), 4) if imbalance else 1.0,
        "placement": part["placement"],
        "rebalances": rebalances,
    }


def read_initial_load(path: str | None) -> dict[int, list[int]] | None:
    """Per-layer, per-expert counts from an `--expert-stats` JSON file (its "layers"), or None."""
    if path is None:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        return {int(layer): [int(c) for c in counts] for layer, counts in data["layers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"eplb load_path {path!r} is not an expert stats file ({exc!r})") from exc


GAUGE_EVERY = 32  # counted forwards between two server snapshots (a collective when ranks > 1)


def gauges(snapshot: dict[str, Any] | None) -> dict[str, dict[tuple, float]]:
    """The server's /metrics gauges of a snapshot: metric -> {label values: value}, the labels
    named by entrypoints/metrics.py (layer and expert, layer and ep_rank, layer)."""
    if snapshot is None:
        return {"expert_load_pairs": {}, "expert_ep_rank_pairs": {}, "expert_load_imbalance": {}}
    return {
        "expert_load_pairs": {
            (layer, e): c for layer, cs in snapshot["layers"].items() for e, c in enumerate(cs)
        },
        "expert_ep_rank_pairs": {
            (layer, r): c for layer, cs in snapshot["ep_rank_tokens"].items() for r, c in enumerate(cs)
        },
        "expert_load_imbalance": {(layer,): v for layer, v in snapshot["imbalance"].items()},
    }
