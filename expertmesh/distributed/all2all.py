"""MoE token exchange across one group: dispatch sends tokens out, combine sums partial results.

Contract, on the group the MoE plan names (``sizes[i]`` = tokens held by group rank i):

  dispatch(x [n, hidden], topk_ids [n, k], topk_weights [n, k], sizes)
      -> (x_recv [m, hidden], ids_recv [m, k], w_recv [m, k]): the tokens this rank must run
         its experts on, with their routing
  combine(y_recv [m, hidden], sizes)
      -> [sizes[me], hidden]: for each of this rank's tokens, the sum over the group's ranks of
         their partial results (each rank's weighted sum over its own experts)

A topk id of -1 names no expert (identity experts' places, layers/identity_experts.py): every
backend hands it on unchanged, the experts skip it, and alltoall sends a token for it nowhere.

combine sums in y_recv's dtype (the MoE block hands float32 partials, rounded to the model's
dtype once, after the sum), travelling in the group's ``reduce_dtype`` at the narrowest.

Every call checks ``len(sizes) == group.world_size`` and that this rank's entry matches its
tensor, so a backend handed the wrong group, or group indices from another group, fails loudly.

Backends:
  naive                    dispatch: group rank i broadcasts its slot (m = sum(sizes), every
                           rank's tokens in group order); combine: all-reduce, own slice.
                           Simple on purpose: the reference the others are checked against.
  allgather_reducescatter  all_gather_v / reduce_scatter_v, same m and order (the default).
  alltoall                 EP only: each token goes once to every EP rank owning one of its
                           selected experts (``all_to_all_single`` with uneven splits, after an
                           exchange of the counts); m = the rows received, grouped by source rank.
                           combine sends the partials back the reverse way and sums them per
                           token at the source. Stateful: each dispatch must be followed by the
                           combine of the same layer call before the next dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertmesh.distributed.group import Group, poison_


class All2AllBackend:
    """Base class: argument checks and byte counting around ``_dispatch`` / ``_combine``.

    ``stats``: bytes_sent / bytes_received by this rank in its dispatch and combine calls (as the
    group counts them, padding included) and the number of such calls. ``poison_recv`` fills
    every receive buffer with NaN (ints: -1) first, so a slot nobody wrote shows at once.
    """

    name = "base"

    def __init__(self, group: Group, poison_recv: bool = False) -> None:
        self.group = group
        self.poison_recv = poison_recv
        self.stats: dict[str, int] = {"bytes_sent": 0, "bytes_received": 0, "calls": 0}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group!r}, poison_recv={self.poison_recv})"

    def set_expert_owner(self, owner: torch.Tensor) -> None:
        """[P] group rank of each physical expert slot (the MoE layer's placement); only the
        alltoall backend routes by it."""

    def reset_stats(self) -> dict[str, int]:
        """Return the counters so far and start again from zero (e.g. once per engine step)."""
        old, self.stats = self.stats, {"bytes_sent": 0, "bytes_received": 0, "calls": 0}
        return old

    def _check_sizes(self, sizes: list[int], local_rows: int | None, what: str) -> None:
        g = self.group
        where = f"all2all {self.name!r}.{what} on group {g.name!r} {g.ranks}"
        if len(sizes) != g.world_size:
            raise ValueError(
                f"{where}: len(sizes)={len(sizes)} but the group has {g.world_size} ranks; sizes must "
                "list the token count of every rank of the group this backend was built on"
            )
        if any(int(s) < 0 for s in sizes):
            raise ValueError(f"{where}: negative entry in sizes={sizes}")
        if local_rows is not None and sizes[g.rank_in_group] != local_rows:
            raise ValueError(
                f"{where}: sizes[{g.rank_in_group}]={sizes[g.rank_in_group]} (this rank's index in the "
                f"group) but the local tensor has {local_rows} rows"
            )

    def _account(self, before: tuple[int, int, int]) -> None:
        sent, received, _ = self.group.traffic.snapshot()
        self.stats["bytes_sent"] += sent - before[0]
        self.stats["bytes_received"] += received - before[1]
        self.stats["calls"] += 1

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sizes = [int(s) for s in sizes]
        self._check_sizes(sizes, x.shape[0], "dispatch")
        if topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"all2all {self.name!r}.dispatch: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                f"topk_weights {tuple(topk_weights.shape)} must share the token dim and [n, k]"
            )
        if self.group.world_size == 1:
            return x, topk_ids, topk_weights
        before = self.group.traffic.snapshot()
        out = self._dispatch(x, topk_ids, topk_weights, sizes)
        self._account(before)
        return out

    def combine(self, y_all: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        sizes = [int(s) for s in sizes]
        self._check_sizes(sizes, None, "combine")
        if y_all.shape[0] != self._combine_rows(sizes):
            raise ValueError(
                f"all2all {self.name!r}.combine on group {self.group.name!r}: y_all has "
                f"{y_all.shape[0]} rows but dispatch handed out {self._combine_rows(sizes)} "
                f"(sizes={sizes})"
            )
        if self.group.world_size == 1:
            return y_all
        before = self.group.traffic.snapshot()
        out = self._combine(y_all, sizes)
        self._account(before)
        return out

    def _combine_rows(self, sizes: list[int]) -> int:
        """Rows combine expects: what dispatch returned (every rank's tokens, for the gathers)."""
        return sum(sizes)

    def _dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _combine(self, y_all: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _own_rows(self, sizes: list[int]) -> slice:
        start = sum(sizes[: self.group.rank_in_group])
        return slice(start, start + sizes[self.group.rank_in_group])


class NaiveAll2All(All2AllBackend):
    name = "naive"

    def _dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, total = self.group, sum(sizes)
        outs = [t.new_empty((total, *t.shape[1:])) for t in (x, topk_ids, topk_weights)]
        if self.poison_recv:
            for t in outs:
                poison_(t)
        offset = 0
        for i, n in enumerate(sizes):
            rows = slice(offset, offset + n)
            offset += n
            if n == 0:  # every rank knows sizes, so every rank skips the same slots
                continue
            for out, local in zip(outs, (x, topk_ids, topk_weights), strict=True):
                slot = out[rows]  # a contiguous view: broadcast fills it in place
                if i == g.rank_in_group:
                    slot.copy_(local)
                received = g.broadcast(slot, src=i)
                assert received.data_ptr() == slot.data_ptr()
        return outs[0], outs[1], outs[2]

    def _combine(self, y_all: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        # Clone: the caller's y_all stays its own partial result.
        return self.group.all_reduce(y_all.clone())[self._own_rows(sizes)]


class AllGatherReduceScatterAll2All(All2AllBackend):
    name = "allgather_reducescatter"

    def _dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, poison = self.group, self.poison_recv
        return (
            g.all_gather_v(x, sizes, poison=poison),
            g.all_gather_v(topk_ids, sizes, poison=poison),
            g.all_gather_v(topk_weights, sizes, poison=poison),
        )

    def _combine(self, y_all: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self.group.reduce_scatter_v(y_all, sizes, poison=self.poison_recv)


@dataclass(frozen=True)
class _Route:
    """What one alltoall dispatch did, for its combine to undo."""

    sizes: list[int]
    source_rows: torch.Tensor  # [m_sent] int64: local token of each sent row, in send order
    send_splits: list[int]  # rows sent to each group rank
    recv_splits: list[int]  # rows received from each group rank


class AllToAllAll2All(All2AllBackend):
    """Each token to the EP ranks owning its selected experts, once per rank; partials come back.

    ``expert_owner`` [E]: the group rank holding each expert (``moe_plan.expert_owners``). The
    received rows carry their full topk ids and weights; the receiver's experts skip the
    (token, expert) pairs they do not own, so each returned row is that rank's weighted partial
    sum. Rows a rank sends to itself go through the self split of ``all_to_all_single``, which
    the group does not count as traffic.

    Stateful: dispatch remembers the send order and splits, and combine uses them, so one layer
    call must pair dispatch with combine (one backend per MoE layer, as ModelEnv builds them). A
    dispatch replaces any route a failed call left behind.
    """

    name = "alltoall"

    def __init__(self, group: Group, poison_recv: bool = False, expert_owner: torch.Tensor | None = None):
        super().__init__(group, poison_recv)
        if expert_owner is None:
            raise ValueError(
                "all2all backend 'alltoall' requires enable_expert_parallel=True: it sends each token "
                "to the EP ranks owning its experts (expert_owner); without expert parallelism use "
                "'allgather_reducescatter' or 'naive'"
            )
        self.set_expert_owner(expert_owner)
        self._route: _Route | None = None

    def set_expert_owner(self, expert_owner: torch.Tensor) -> None:
        group = self.group
        owner = torch.as_tensor(expert_owner, dtype=torch.int64).cpu()  # [E] or [P] slots
        if (
            owner.dim() != 1
            or owner.numel() == 0
            or not bool(((owner >= 0) & (owner < group.world_size)).all())
        ):
            raise ValueError(
                f"alltoall: expert_owner must be a non-empty [E] tensor of ranks in "
                f"[0, {group.world_size}) of group {group.name!r}; got {owner.tolist()}"
            )
        self.expert_owner = owner

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, num_experts={self.expert_owner.numel()})"

    def _owner_on(self, device: torch.device) -> torch.Tensor:
        if self.expert_owner.device != device:  # moved once, then reused
            self.expert_owner = self.expert_owner.to(device)
        return self.expert_owner

    def _dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, poison = self.group, self.poison_recv
        self._route = None
        owners = self._owner_on(topk_ids.device)[topk_ids.clamp(min=0)]  # [n, k] group rank of each pick
        # A place naming no expert (an identity expert's, layers/identity_experts.py) goes to the
        # spare column W, dropped: a token whose picks are all identity is sent nowhere.
        owners = torch.where(topk_ids >= 0, owners, torch.full_like(owners, g.world_size))
        wanted = torch.zeros(x.shape[0], g.world_size + 1, dtype=torch.bool, device=x.device)  # [n, W+1]
        wanted.scatter_(1, owners, True)  # a token whose experts share a rank goes there once
        wanted = wanted[:, : g.world_size]
        # Send order: by destination rank, then by token (nonzero is row-major on [W, n]).
        dest, rows = wanted.t().nonzero(as_tuple=True)  # [m_sent] each
        send = torch.bincount(dest, minlength=g.world_size)  # [W]
        # Receivers size their buffers from the counts: one int per destination first.
        recv = g.all_to_all_single(send, [1] * g.world_size, [1] * g.world_size, poison=poison)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        out = tuple(
            g.all_to_all_single(t[rows], recv_splits, send_splits, poison=poison)
            for t in (x, topk_ids, topk_weights)
        )
        self._route = _Route(sizes, rows, send_splits, recv_splits)
        return out[0], out[1], out[2]

    def _combine_rows(self, sizes: list[int]) -> int:
        if self.group.world_size == 1:
            return sum(sizes)  # dispatch handed the tokens back as they were
        route = self._pending(sizes)
        return sum(route.recv_splits)

    def _pending(self, sizes: list[int]) -> _Route:
        route = self._route
        if route is None:
            raise RuntimeError(
                f"all2all 'alltoall'.combine on group {self.group.name!r} without a dispatch before "
                "it: dispatch and combine must be called in pairs, one layer call at a time"
            )
        if route.sizes != sizes:
            raise ValueError(f"alltoall.combine: sizes={sizes} but the dispatch had {route.sizes}")
        return route

    def _combine(self, y_all: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        route, self._route = self._pending(sizes), None
        # The reverse exchange: each partial returns to the rank, and the row, it came from.
        back = self.group.all_to_all_single(
            self.group.for_sum(y_all), route.send_splits, route.recv_splits, poison=self.poison_recv
        )  # [m_sent, H] in send order
        out = y_all.new_zeros((sizes[self.group.rank_in_group], *y_all.shape[1:]))  # [n, H]
        return out.index_add_(0, route.source_rows, back.to(y_all.dtype))


ALL2ALL_BACKENDS: dict[str, type[All2AllBackend]] = {
    "naive": NaiveAll2All,
    "allgather_reducescatter": AllGatherReduceScatterAll2All,
    "alltoall": AllToAllAll2All,
}
KNOWN_ALL2ALL_BACKENDS: tuple[str, ...] = tuple(ALL2ALL_BACKENDS)
DEFAULT_ALL2ALL_BACKEND = "allgather_reducescatter"


def make_all2all(
    name: str, group: Group, poison_recv: bool = False, expert_owner: torch.Tensor | None = None
) -> All2AllBackend:
    """Backend ``name`` on ``group``. ``expert_owner`` [E] (group rank of each expert) is needed
    by "alltoall", which only exists with expert parallelism; the gathering backends ignore it."""
    if name not in ALL2ALL_BACKENDS:
        raise ValueError(f"unknown all2all backend {name!r}; valid: {', '.join(KNOWN_ALL2ALL_BACKENDS)}")
    if name == "alltoall":
        return AllToAllAll2All(group, poison_recv=poison_recv, expert_owner=expert_owner)
    return ALL2ALL_BACKENDS[name](group, poison_recv=poison_recv)
