"""The groups one rank belongs to (`ParallelGroups`: tp, pp, dp, ep, world) and their creation on
every rank in the same order (`init_groups`), from the layout rule (distributed/layout.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from expertmesh.distributed.group import Group
from expertmesh.distributed.layout import ParallelLayout, check_world_size


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank belongs to.

    ``ep`` always spans the same ranks: same pp, all (dp, tp), dp-major. With expert parallelism
    on it is the EP group (named "ep"); with it off it is the flattened DP x TP group of the
    DP x TP MoE mode (named "dp_tp"), whose index is the weight-shard rank dp * TP + tp.
    """

    layout: ParallelLayout
    tp: Group
    pp: Group
    dp: Group
    ep: Group
    world: Group

    @property
    def global_rank(self) -> int:
        return self.world.global_rank

    def set_reduce_dtype(self, dtype: torch.dtype) -> None:
        """The narrowest dtype partial sums travel in, on every group (Group.reduce_dtype)."""
        if not dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating dtype, not {dtype}")
        for group in {id(g): g for g in (self.tp, self.pp, self.dp, self.ep, self.world)}.values():
            group.reduce_dtype = dtype

    def set_fixed_chunks(self, chunks: int) -> None:
        """Deterministic mode on every group: sums a layout splits are taken over `chunks` fixed
        chunks by a fixed tree (distributed/fixed_sum.py); 0 turns it off. Set before building."""
        for group in {id(g): g for g in (self.tp, self.pp, self.dp, self.ep, self.world)}.values():
            group.fixed_chunks = chunks

    def get(self, name: str) -> Group:
        """Group by kind name ("tp", "pp", "dp", "ep", "world"); "dp_tp" is an alias of ep."""
        key = "ep" if name == "dp_tp" else name
        if key not in ("tp", "pp", "dp", "ep", "world"):
            raise ValueError(f"unknown group {name!r}; valid: tp, pp, dp, ep, dp_tp, world")
        return getattr(self, key)

    @staticmethod
    def single(layout: ParallelLayout | None = None) -> ParallelGroups:
        """All groups of one process: no torch.distributed needed."""
        layout = layout or ParallelLayout()
        check_world_size(layout, 1)
        names = {"tp": "tp", "pp": "pp", "dp": "dp", "ep": _ep_name(layout), "world": "world"}
        return ParallelGroups(layout=layout, **{k: Group((0,), 0, name=v) for k, v in names.items()})


def _ep_name(layout: ParallelLayout) -> str:
    return "ep" if layout.enable_expert_parallel else "dp_tp"


def init_groups(
    layout: ParallelLayout,
    global_rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta | None = None,
) -> ParallelGroups:
    """Create every group of every kind, in the same order on every rank, and return ours.

    torch requires all ranks to take part in each ``new_group``. Groups of one rank need no
    process group and are skipped (the same decision on every rank); a rank set seen before
    (e.g. EP == TP when DP == 1, or the whole world) reuses its process group.
    """
    check_world_size(layout, world_size)
    if world_size == 1:
        return ParallelGroups.single(layout)
    if not dist.is_initialized():
        raise RuntimeError("init_groups needs torch.distributed initialised for world_size > 1")
    if (dist.get_world_size(), dist.get_rank()) != (world_size, global_rank):
        raise ValueError(
            f"torch.distributed has world {dist.get_world_size()} rank {dist.get_rank()}, "
            f"expected world {world_size} rank {global_rank}"
        )
    pgs: dict[tuple[int, ...], Any] = {tuple(range(world_size)): dist.group.WORLD}
    mine: dict[str, Group] = {}
    for kind in ("tp", "pp", "dp", "ep", "world"):
        name = _ep_name(layout) if kind == "ep" else kind
        for ranks in layout.group_ranks(kind):
            if len(ranks) > 1 and ranks not in pgs:
                pgs[ranks] = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if global_rank in ranks:
                mine[kind] = Group(ranks, global_rank, pgs.get(ranks), name=name, backend=backend)
    return ParallelGroups(layout=layout, **mine)
