"""A process group that speaks in group indices (the set of groups one rank belongs to, and their
creation, are parallel_groups.py).

Every ``src``/``dst`` given to a :class:`Group` is an index inside the group (0..world_size-1);
the group translates it to a global rank itself, so no caller mixes the two numberings (the
seed bug: DP-group indices used on the EP group).

Tensor collectives that reduce or gather in place (``all_reduce``, ``broadcast``, ``recv``) work
on the tensor given when it is contiguous; always use the returned tensor. With one rank every
collective is the identity and needs no ``torch.distributed`` at all.

gloo lacks uneven all-gather, and reduce-scatter only came to it in recent torch, so:
  all_gather_v      padded all_gather, then slice (gloo and NCCL: NCCL has no uneven one either)
  reduce_scatter_v  NCCL: padded native reduce_scatter; gloo: all_reduce, then own slice
  all_to_all_single native on both (gloo has had alltoall_base for a long time)

Partial sums cross ranks in float32: the layers hand float32 partials to ``all_reduce`` /
``reduce_scatter_v`` / an all2all combine and round the sum to the model's dtype once, after
it. ``Group.reduce_dtype`` (float32 by default) is the narrowest dtype a summed tensor travels
in: set it to bfloat16 and each rank's float32 partial is rounded to bf16 before the sum (half
the bytes, the rounding error of every rank's partial added up); ``benchmarks/layouts.py``
measures both. Narrower tensors (a bf16 embedding row, int counts) go as they are.

Each collective adds what this rank moves to ``Group.traffic`` (padding included), counted as if
every byte went directly from the rank that has it to the rank that needs it; an all-reduce of N
bytes counts 2 * (p - 1) / p * N each way (reduce-scatter + all-gather). Object collectives count
calls only.

Every collective of a multi-rank group tells the watchdog (distributed/watchdog.py) what this
rank is waiting in and for whom, so a peer that stops answering is named, never waited on forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

import expertmesh.distributed.watchdog as watchdog
from expertmesh.distributed.fixed_sum import tree_sum

ReduceOp = Literal["sum", "max", "min"]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a receive buffer with a value no correct result has (NaN, or -1 / max for ints)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        info = torch.iinfo(t.dtype)
        t.fill_(-1 if info.min < 0 else info.max)
    return t


@dataclass
class Traffic:
    """Bytes this rank moved through one group (mutable: a running counter)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0

    def snapshot(self) -> tuple[int, int, int]:
        return self.bytes_sent, self.bytes_received, self.calls


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_sizes(sizes: list[int], world_size: int, what: str) -> None:
    if len(sizes) != world_size:
        raise ValueError(f"{what}: len(sizes)={len(sizes)} != group world_size={world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{what}: negative size in {sizes}")


class Group:
    """One process group, addressed by index inside the group.

    ``pg`` is the torch process group whose rank order equals ``ranks``; it may be None for a
    single rank, or for a group that spans the whole default world.
    """

    def __init__(
        self,
        ranks: tuple[int, ...],
        global_rank: int,
        pg: Any = None,
        name: str = "tp",
        *,
        backend: str | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.ranks = tuple(int(r) for r in ranks)
        self.name = name
        if len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"group {name!r}: ranks {self.ranks} must be non-empty and distinct")
        if global_rank not in self.ranks:
            raise ValueError(f"group {name!r}: global rank {global_rank} not in ranks {self.ranks}")
        self.global_rank = global_rank
        self.rank_in_group = self.ranks.index(global_rank)
        self.world_size = len(self.ranks)
        self.traffic = Traffic()
        self.reduce_dtype = reduce_dtype  # see the module docstring
        # Deterministic mode (distributed/fixed_sum.py): the fixed chunk count of layout-invariant
        # sums; 0 = off (partial sums all-reduced as they come).
        self.fixed_chunks = 0
        self.pg = self._resolve_pg(pg) if self.world_size > 1 else None
        self.backend = (backend or dist.get_backend(self.pg)) if self.pg is not None else "none"

    def _resolve_pg(self, pg: Any) -> Any:
        if not dist.is_initialized():
            raise RuntimeError(f"group {self.name!r} of {self.world_size} ranks needs torch.distributed")
        if pg is None:
            pg = dist.group.WORLD
        actual = tuple(dist.get_process_group_ranks(pg))
        # Gather order and src/dst translation rely on torch's group ranks matching ours.
        if actual != self.ranks:
            raise ValueError(f"group {self.name!r}: process group has ranks {actual}, expected {self.ranks}")
        return pg

    def __repr__(self) -> str:
        return (
            f"Group(name={self.name!r}, ranks={self.ranks}, rank_in_group={self.rank_in_group}, "
            f"backend={self.backend!r})"
        )

    # --- bookkeeping -------------------------------------------------------------------------

    def _count(self, sent: int, received: int) -> None:
        self.traffic.bytes_sent += sent
        self.traffic.bytes_received += received
        self.traffic.calls += 1

    def _global(self, index: int, what: str) -> int:
        if not 0 <= index < self.world_size:
            raise ValueError(f"group {self.name!r}: {what}={index} outside [0, {self.world_size})")
        return self.ranks[index]

    def _watch(self, op: str, peer: int | None = None):
        """The watchdog's view of this call: a collective on the group, or a send/recv with one peer."""
        if peer is not None:
            return watchdog.waiting(f"{self.name}.{op} (rank {peer})", (peer,))
        return watchdog.waiting(f"{self.name}.{op}", self.ranks, f"{self.name}{list(self.ranks)}")

    def for_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x as it travels to be summed: cast down to ``reduce_dtype`` when that is narrower."""
        if not x.is_floating_point() or torch.finfo(self.reduce_dtype).bits >= torch.finfo(x.dtype).bits:
            return x
        return x.to(self.reduce_dtype)

    # --- tensor collectives ------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Sum (max, min) over the group, in x's dtype (a sum: ``for_sum``'s, then back to x's)."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"all_reduce op {op!r}; valid: {', '.join(ops)}")
        if self.world_size == 1:
            return x
        wire = (self.for_sum(x) if op == "sum" else x).contiguous()
        with self._watch("all_reduce"):
            dist.all_reduce(wire, op=ops[op], group=self.pg)
        moved = 2 * (self.world_size - 1) * _nbytes(wire) // self.world_size
        self._count(moved, moved)
        return wire.to(x.dtype)

    def ordered_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of float32 subtree sums, added by the binary tree in group order
        (``fixed_sum.tree_sum``): an all-gather, so every rank adds the same terms in the same order,
        whatever the collective does inside. The group size must be a power of two."""
        if self.world_size == 1:
            return x
        return tree_sum(list(self.all_gather(x.unsqueeze(0)).unbind(0)))

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Equal-shaped tensors from every rank, concatenated along ``dim`` in group order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        with self._watch("all_gather"):
            dist.all_gather(parts, x, group=self.pg)
        self._count((self.world_size - 1) * _nbytes(x), (self.world_size - 1) * _nbytes(x))
        return torch.cat(parts, dim=dim)

    def all_gather_v(self, x: torch.Tensor, sizes: list[int], *, poison: bool = False) -> torch.Tensor:
        """x [sizes[me], ...] on each rank -> [sum(sizes), ...], group order. Sizes may be 0."""
        _check_sizes(sizes, self.world_size, f"{self.name}.all_gather_v")
        if sizes[self.rank_in_group] != x.shape[0]:
            raise ValueError(
                f"{self.name}.all_gather_v: sizes[{self.rank_in_group}]={sizes[self.rank_in_group]} "
                f"!= local rows {x.shape[0]}"
            )
        if self.world_size == 1:
            return x
        width = max(sizes)
        if width == 0:
            return x.new_empty((0, *x.shape[1:]))
        padded = x.new_zeros((width, *x.shape[1:]))  # [max(sizes), ...]
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        if poison:
            for p in parts:
                poison_(p)
        with self._watch("all_gather_v"):
            dist.all_gather(parts, padded, group=self.pg)
        self._count((self.world_size - 1) * _nbytes(padded), (self.world_size - 1) * _nbytes(padded))
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    def reduce_scatter_v(self, x: torch.Tensor, sizes: list[int], *, poison: bool = False) -> torch.Tensor:
        """x [sum(sizes), ...] on each rank -> this rank's rows of the sum, [sizes[me], ...]."""
        _check_sizes(sizes, self.world_size, f"{self.name}.reduce_scatter_v")
        if x.shape[0] != sum(sizes):
            raise ValueError(f"{self.name}.reduce_scatter_v: {x.shape[0]} rows != sum(sizes)={sum(sizes)}")
        if self.world_size == 1:
            return x
        start = sum(sizes[: self.rank_in_group])
        stop = start + sizes[self.rank_in_group]
        if self.backend != "nccl":
            # gloo: no (uneven) reduce-scatter everywhere; reduce the whole buffer, keep our rows.
            wire = self.for_sum(x)
            return self.all_reduce(wire.clone() if wire is x else wire)[start:stop].to(x.dtype)
        width = max(sizes)
        if width == 0:
            return x.new_empty((0, *x.shape[1:]))
        dtype, x = x.dtype, self.for_sum(x)
        chunks = [x.new_zeros((width, *x.shape[1:])) for _ in sizes]  # one padded slot per rank
        offset = 0
        for chunk, n in zip(chunks, sizes, strict=True):
            chunk[:n] = x[offset : offset + n]
            offset += n
        out = x.new_empty((width, *x.shape[1:]))
        if poison:
            poison_(out)
        with self._watch("reduce_scatter_v"):
            dist.reduce_scatter(out, chunks, group=self.pg)
        self._count((self.world_size - 1) * _nbytes(out), (self.world_size - 1) * _nbytes(out))
        return out[: sizes[self.rank_in_group]].to(dtype)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s x on every rank (received in place into x when contiguous)."""
        src_global = self._global(src, "src")
        if self.world_size == 1:
            return x
        x = x.contiguous()
        with self._watch("broadcast"):
            dist.broadcast(x, src_global, group=self.pg)
        if src == self.rank_in_group:
            self._count((self.world_size - 1) * _nbytes(x), 0)
        else:
            self._count(0, _nbytes(x))
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        dst_global = self._global(dst, "dst")
        if dst == self.rank_in_group:
            raise ValueError(f"group {self.name!r}: send to itself (dst={dst})")
        x = x.contiguous()
        with self._watch("send", dst_global):
            dist.send(x, dst_global, group=self.pg)
        self._count(_nbytes(x), 0)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into x (a buffer of the right shape and dtype) from group index ``src``."""
        src_global = self._global(src, "src")
        if src == self.rank_in_group:
            raise ValueError(f"group {self.name!r}: recv from itself (src={src})")
        if not x.is_contiguous():
            raise ValueError(f"group {self.name!r}: recv buffer must be contiguous")
        with self._watch("recv", src_global):
            dist.recv(x, src_global, group=self.pg)
        self._count(0, _nbytes(x))
        return x

    def all_to_all_single(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], *, poison: bool = False
    ) -> torch.Tensor:
        """Rows in_splits[j] of x go to rank j; rows out_splits[j] of the result come from j."""
        _check_sizes(in_splits, self.world_size, f"{self.name}.all_to_all_single in_splits")
        _check_sizes(out_splits, self.world_size, f"{self.name}.all_to_all_single out_splits")
        if sum(in_splits) != x.shape[0]:
            raise ValueError(f"{self.name}.all_to_all_single: sum(in_splits) != {x.shape[0]} rows")
        if self.world_size == 1:
            if out_splits != in_splits:
                raise ValueError(f"single rank: out_splits {out_splits} != in_splits {in_splits}")
            return x
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        if poison:
            poison_(out)
        with self._watch("all_to_all_single"):
            dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=self.pg)
        row = _nbytes(x[:1]) if x.shape[0] else _nbytes(out[:1])
        me = self.rank_in_group
        self._count(row * (sum(in_splits) - in_splits[me]), row * (sum(out_splits) - out_splits[me]))
        return out

    # --- control plane -----------------------------------------------------------------------

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._watch("all_gather_object"):
            dist.all_gather_object(out, obj, group=self.pg)
        self._count(0, 0)
        return out

    def broadcast_object(self, obj: Any, src: int) -> Any:
        src_global = self._global(src, "src")
        if self.world_size == 1:
            return obj
        box = [obj if src == self.rank_in_group else None]
        with self._watch("broadcast_object"):
            dist.broadcast_object_list(box, src=src_global, group=self.pg)
        self._count(0, 0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            with self._watch("barrier"):
                dist.barrier(group=self.pg)
