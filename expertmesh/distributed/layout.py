"""The layout rule: which global rank plays which (dp, pp, tp) role, and who shares a group.

rank = (dp * PP + pp) * TP + tp   (TP innermost, then PP, then DP)

Every group is derived from one grid, ``arange(world).reshape(DP, PP, TP)``, by moving the
dimension(s) it spans last and reading the rows. Nothing else in the package computes ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

GroupKind = Literal["tp", "pp", "dp", "ep", "world"]
GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp", "ep", "world")


def _rows(t: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(int(r) for r in row) for row in t.tolist()]


@dataclass(frozen=True)
class ParallelLayout:
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "enable_expert_parallel":
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name}={value!r} must be a bool")
            # bool is an int subclass; True is not a valid size.
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name}={value!r} must be an integer >= 1")

    # Short aliases keep the index arithmetic readable.
    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size} ({self})")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of a global rank."""
        self._check_rank(rank)
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        for name, v, n in (("dp", dp, self.dp), ("pp", pp, self.pp), ("tp", tp, self.tp)):
            if not 0 <= v < n:
                raise ValueError(f"{name}={v} outside [0, {n}) for {self}")
        return (dp * self.pp + pp) * self.tp + tp

    def grid(self) -> torch.Tensor:
        """[DP, PP, TP] tensor of global ranks."""
        return torch.arange(self.world_size).reshape(self.dp, self.pp, self.tp)

    def tp_group_ranks(self) -> list[tuple[int, ...]]:
        # Same (dp, pp): TP is already the last dim.
        return _rows(self.grid().reshape(-1, self.tp))

    def pp_group_ranks(self) -> list[tuple[int, ...]]:
        # Same (dp, tp): move PP last -> [DP, TP, PP].
        return _rows(self.grid().permute(0, 2, 1).reshape(-1, self.pp))

    def dp_group_ranks(self) -> list[tuple[int, ...]]:
        # Same (pp, tp): move DP last -> [PP, TP, DP].
        return _rows(self.grid().permute(1, 2, 0).reshape(-1, self.dp))

    def ep_group_ranks(self) -> list[tuple[int, ...]]:
        """Same pp, all (dp, tp), dp-major: the EP group, and the flattened DP x TP group.

        Rank i of a group is global rank (dp, pp, tp) with i = dp * TP + tp.
        """
        # Move PP first -> [PP, DP, TP], then flatten (DP, TP).
        return _rows(self.grid().permute(1, 0, 2).reshape(self.pp, -1))

    @property
    def world_ranks(self) -> list[tuple[int, ...]]:
        return [tuple(range(self.world_size))]

    def group_ranks(self, kind: GroupKind) -> list[tuple[int, ...]]:
        if kind == "world":
            return self.world_ranks
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; valid: {', '.join(GROUP_KINDS)}")
        return getattr(self, f"{kind}_group_ranks")()

    def group_of(self, kind: GroupKind, rank: int) -> tuple[int, ...]:
        """The group of the given kind that contains ``rank``."""
        self._check_rank(rank)
        for ranks in self.group_ranks(kind):
            if rank in ranks:
                return ranks
        raise AssertionError(f"rank {rank} in no {kind} group of {self}")  # unreachable


def check_world_size(layout: ParallelLayout, world_size: int) -> None:
    """Fail before any collective when the launcher's world does not match the layout."""
    if world_size != layout.world_size:
        raise ValueError(
            f"WORLD_SIZE={world_size} does not match the layout DP={layout.dp} x PP={layout.pp} x "
            f"TP={layout.tp} = {layout.world_size} (data_parallel_size x pipeline_parallel_size x "
            "tensor_parallel_size)"
        )
