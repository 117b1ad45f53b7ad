"""Shard reading shared by every weight loader: works on a safetensors slice or a tensor.

A safetensors `get_slice` object reads only the rows a rank asks for, so each rank touches
only its own shard of the file.

Strictness (models/loader.py): before any rank slices, every checkpoint tensor is loaded into a
one-rank twin of the model on the meta device with `whole_tensors()` on, where `read` hands over
its source whole, so `copy_into` compares the tensor's full shape with the parameter's. Real
loads then check each shard for non-finite values.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("expertmesh")
_whole = False  # inside whole_tensors(): read() ignores the shard bounds
_allow_nonfinite = False


class ShapeMismatch(ValueError):
    def __init__(self, what: str, found: tuple[int, ...], expected: tuple[int, ...]) -> None:
        super().__init__(f"{what}: checkpoint tensor has shape {found}, expected {expected}")
        self.found, self.expected = found, expected


class NonFinite(ValueError):
    pass


@contextlib.contextmanager
def whole_tensors() -> Iterator[None]:
    """Loaders read their sources whole: a one-rank twin's shape check (see the module doc)."""
    global _whole
    _whole = True
    try:
        yield
    finally:
        _whole = False


@contextlib.contextmanager
def nonfinite_allowed(allowed: bool) -> Iterator[None]:
    """NaN/inf in a weight is a warning, not an error, while this is on (a flag of LLM)."""
    global _allow_nonfinite
    before, _allow_nonfinite = _allow_nonfinite, allowed
    try:
        yield
    finally:
        _allow_nonfinite = before


def shape_of(src: Any) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def read(src: Any, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
    """Materialise `src[..., start:start+length, ...]` along `dim` (all of it when dim is None)."""
    shape = shape_of(src)
    if dim is None or _whole:
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


# min and max in one pass propagate NaN and reach +-inf, without isfinite's bool tensor of the size
# of the weight (that check was most of loading a 150K-row embedding); other dtypes: isfinite
_MINMAX = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _all_finite(value: torch.Tensor) -> bool:
    if value.numel() == 0:
        return True
    if value.dtype not in _MINMAX:
        return bool(torch.isfinite(value).all())
    lo, hi = torch.aminmax(value)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def copy_into(dst: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(value.shape):
        raise ShapeMismatch(what, tuple(value.shape), tuple(dst.shape))
    if dst.is_floating_point() and not value.is_floating_point():
        raise ValueError(f"{what}: checkpoint tensor has dtype {value.dtype}, not a floating-point type")
    if dst.is_meta:
        return  # the twin's shape check: nothing to copy
    region = getattr(value, "held_region", None)
    if region is not None:  # codes of a weight held compressed: scales go beside (quantization/held.py)
        region.held.on_copy(dst, region)
        if getattr(region, "written", False):  # GGUF MXFP4 blocks (a meta value): placed by the region
            return
    if value.is_meta:
        return
    _check_finite(value, what)
    dst.copy_(value.to(dst.dtype))


def _check_finite(value: torch.Tensor, what: str) -> None:
    if value.is_floating_point() and not _all_finite(value):
        bad = int((~torch.isfinite(value)).sum())
        if not _allow_nonfinite:
            raise NonFinite(f"{what}: {bad} of {value.numel()} values are NaN or infinite")
        log.warning("%s: %d values are NaN or infinite (allowed)", what, bad)


def copy_rows_into(dst: torch.Tensor, src: Any, start: int, what: str) -> None:
    """copy_into(dst, read(src, 0, start, len(dst)), what); a source that decodes rows a piece at a
    time (`rows_into`: a GGUF embedding or head) writes them straight into dst, without a
    temporary of the whole table, and dst is then checked as copy_into checks the value."""
    into = getattr(src, "rows_into", None)
    if into is None or _whole or dst.is_meta or dst.dim() != 2 or not dst.is_floating_point():
        copy_into(dst, read(src, 0, start, dst.shape[0]), what)
        return
    shape = shape_of(src)
    if len(shape) != 2 or shape[1] != dst.shape[1]:
        raise ShapeMismatch(what, shape, tuple(dst.shape))
    if start < 0 or start + dst.shape[0] > shape[0]:
        stop = start + dst.shape[0]
        raise ValueError(f"shard [{start}, {stop}) is outside dim 0 of a tensor of shape {shape}")
    into(dst, start)
    _check_finite(dst, what)


def set_loader(param: torch.nn.Parameter, loader: Any, shards: set | None = None) -> None:
    """Attach a loader and the set of shard ids that must each be loaded exactly once."""
    param.weight_loader = loader
    param.expected_shards = shards if shards is not None else {None}


def default_loader(param: torch.nn.Parameter, src: Any, shard_id: Any = None) -> None:
    copy_into(param.data, read(src), "replicated weight")
