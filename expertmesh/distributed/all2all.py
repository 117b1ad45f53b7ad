"""MoE token exchange across one group: dispatch gathers tokens, combine sums partial results.

Contract, on the group the MoE plan names (``sizes[i]`` = tokens held by group rank i):

  dispatch(x [n, hidden], topk_ids [n, k], topk_weights [n, k], sizes)
      -> every rank's tokens in group order: [sum(sizes), hidden], [sum(sizes), k], [sum(sizes), k]
  combine(y_all [sum(sizes), hidden], sizes)
      -> the sum over the group's ranks of y_all, this rank's rows: [sizes[me], hidden]

Every call checks ``len(sizes) == group.world_size`` and that this rank's entry matches its
tensor, so a backend handed the wrong group, or group indices from another group, fails loudly.

Backends:
  naive                    dispatch: group rank i broadcasts its slot; combine: all-reduce, slice.
                           Simple on purpose: the reference the others are checked against.
  allgather_reducescatter  all_gather_v / reduce_scatter_v (the default).
  alltoall                 reserved (EP only, each token to its experts' owners); not built yet.
"""

from __future__ import annotations

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
        if y_all.shape[0] != sum(sizes):
            raise ValueError(
                f"all2all {self.name!r}.combine on group {self.group.name!r}: y_all has "
                f"{y_all.shape[0]} rows but sum(sizes)={sum(sizes)}"
            )
        if self.group.world_size == 1:
            return y_all
        before = self.group.traffic.snapshot()
        out = self._combine(y_all, sizes)
        self._account(before)
        return out

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


ALL2ALL_BACKENDS: dict[str, type[All2AllBackend]] = {
    "naive": NaiveAll2All,
    "allgather_reducescatter": AllGatherReduceScatterAll2All,
}
# Names accepted by configuration; "alltoall" is reserved until its backend lands.
KNOWN_ALL2ALL_BACKENDS: tuple[str, ...] = ("naive", "allgather_reducescatter", "alltoall")
DEFAULT_ALL2ALL_BACKEND = "allgather_reducescatter"


def make_all2all(name: str, group: Group, poison_recv: bool = False) -> All2AllBackend:
    if name == "alltoall":
        raise ValueError("alltoall requires enable_expert_parallel and is not implemented yet")
    if name not in ALL2ALL_BACKENDS:
        raise ValueError(f"unknown all2all backend {name!r}; valid: {', '.join(KNOWN_ALL2ALL_BACKENDS)}")
    return ALL2ALL_BACKENDS[name](group, poison_recv=poison_recv)
