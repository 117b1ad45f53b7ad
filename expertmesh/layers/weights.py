"""Shard reading shared by every weight loader: works on a safetensors slice or a tensor.

A safetensors `get_slice` object reads only the rows a rank asks for, so each rank touches
only its own shard of the file.
"""

from __future__ import annotations

from typing import Any

import torch


def shape_of(src: Any) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def read(src: Any, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
    """Materialise `src[..., start:start+length, ...]` along `dim` (all of it when dim is None)."""
    shape = shape_of(src)
    if dim is None:
        return src if isinstance(src, torch.Tensor) else src[:]
    length = shape[dim] - start if length is None else length
    if start < 0 or start + length > shape[dim]:
        raise ValueError(
            f"shard [{start}, {start + length}) is outside dim {dim} of a tensor of shape {shape}"
        )
    if isinstance(src, torch.Tensor):
        return src.narrow(dim, start, length)
    index = tuple(slice(None) for _ in range(dim)) + (slice(start, start + length),)
    return src[index]


def copy_into(dst: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(value.shape):
        raise ValueError(
            f"{what}: checkpoint shard has shape {tuple(value.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(value.to(dst.dtype))


def set_loader(param: torch.nn.Parameter, loader: Any, shards: set | None = None) -> None:
    """Attach a loader and the set of shard ids that must each be loaded exactly once."""
    param.weight_loader = loader
    param.expected_shards = shards if shards is not None else {None}


def default_loader(param: torch.nn.Parameter, src: Any, shard_id: Any = None) -> None:
    copy_into(param.data, read(src), "replicated weight")
