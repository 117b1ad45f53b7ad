"""The checkpoint as the loader sees it: logical tensors over every safetensors file at once.

A quantized checkpoint stores one logical weight as several tensors (FP8: the e4m3 weight and its
`weight_scale_inv` block scales; MXFP4: `*_blocks` and `*_scales`), possibly in different files of
a sharded checkpoint. A weight format (layers/quantization/registry.py) turns them into one
`LogicalTensor` that behaves like a safetensors slice: `get_shape()`, `get_dtype()` and indexing
with slices, which reads only the stored bytes (weights and scales) the requested region covers
and dequantizes just that region. Per-rank slicing (TP rows or columns, one EP expert) therefore
keeps every scale consistent with its weights by construction: a rank's slice that cuts a scale
block reads the whole block's scale and uses it for the part it keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# torch dtypes as safetensors names them (what get_dtype() returns)
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def local_groups(what: str, kind: tuple[str, int], i0: int, i1: int, in_f: int) -> tuple[int, int]:
    """(group, first group) of the inputs [i0, i1) of a weight with in_f inputs; whole groups only."""
    group = kind[1] or in_f  # 0: one scale per row
    if group >= in_f and (i0, i1) != (0, in_f):
        group = i1 - i0  # one scale a row: any slice of the inputs keeps it
        return group, 0
    if i0 % group or (i1 % group and i1 != in_f):
        raise ValueError(
            f"{what} ({kind[0]}, groups of {group}): a rank reads its inputs [{i0}, {i1}) of {in_f}, "
            "which cuts a group; choose a layout that keeps whole groups per rank"
        )
    return group, i0 // group


class CodesRegion:
    """What a held logical tensor's slice returns in place of floats: codes with their scales.
    `held`: the HeldWeights (held.py) that planned them, which imports this module."""

    perm: torch.Tensor | None = None  # desc_act: input perm[j] held at column j (quantization/permuted.py)

    def __init__(self, held: Any, codes, scales, offsets, group: int) -> None:
        self.held, self.codes, self.scales, self.offsets, self.group = held, codes, scales, offsets, group


class LogicalTensor:
    """A tensor made from stored pieces on demand; subclasses define `shape` and `materialize`."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    base: str = ""
    # (kind, group) when this tensor maps exactly onto a QuantizedWeight kind (layers/quantization/
    # held.py); `held` is set once the loader decided to hold it: slices then return codes.
    held_kind: tuple[str, int] | None = None
    # A picked part of this fused tensor can still be held (its slices carry their scales: mxfp4.py)
    held_through_picks: bool = False
    held_storage: torch.dtype = torch.uint8  # the held parameter's storage (mxfp4: int16)
    held_in: int | None = None  # inputs of the held weight when not the last dim's size (mxfp4)
    # the offsets are zero by the format (GGUF Q8_0 / Q6_K): a stack of experts shares one zero tensor
    held_zero_offsets: bool = False
    # Why a tensor with no held_kind is dequantized (logged once a reason); None: a float, say nothing
    unheld_reason: str | None = "groups out of input order (desc_act's g_idx)"
    held: Any = None

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def held_input_order(self, local_in: int) -> bytes | None:
        """The order a rank's `local_in` inputs are held in: b"" (as stored); desc_act formats
        (gptq.py) a key of their permutation, None where a rank's slice would cut a group."""
        return b""

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The region [start, stop) of every dim, dequantized (float32)."""
        raise NotImplementedError

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """Codes [o, i] uint8 of `held_kind`, scales and offsets [o, groups] float32 of a region
        whose inputs start at group g0 (groups of `group`)."""
        raise NotImplementedError

    def held_region(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (o0, o1), (i0, i1) = bounds
        group, g0 = local_groups(self.base, self.held_kind, i0, i1, self.shape[1])
        codes, scales, offsets = self.quantized((o0, o1), (i0, i1), group, g0)
        codes = codes.contiguous()
        codes.held_region = CodesRegion(self.held, codes, scales.float(), offsets.float(), group)
        return codes

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        bounds = []
        for d, size in enumerate(self.shape):
            s = index[d] if d < len(index) else slice(None)
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise TypeError(f"{type(self).__name__} takes plain slices, not {s!r}")
            start, stop, _ = s.indices(size)
            bounds.append((start, max(start, stop)))
        return self.held_region(bounds) if self.held is not None else self.materialize(bounds)


class CheckpointView:
    """Every tensor of the checkpoint's files by name: `keys()` with the file each lives in and
    `get_slice(key)`. A format's view (subclass) hides companion tensors and serves logical ones."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles  # path -> open file (models/tensor_file.TensorFile)
        self.file_of = {key: path for path, f in handles.items() for key in f.keys()}

    def stored(self, key: str) -> Any:
        return self.handles[self.file_of[key]].get_slice(key)

    def stored_dtype(self, key: str) -> str:
        return self.stored(key).get_dtype()

    def keys(self) -> list[tuple[str, str]]:
        """(logical key, the file to name in errors), in file order."""
        return [(key, path) for path, f in self.handles.items() for key in f.keys()]

    def get_slice(self, key: str) -> Any:
        return self.stored(key)

    held: Any = None  # HeldWeights once the loader planned them (layers/quantization/held.py)

    def serve(self, key: str, tensor: LogicalTensor) -> LogicalTensor:
        """A logical tensor as this view hands it out: codes when the plan holds what it fills."""
        if self.held is not None and key in self.held.keys:
            tensor.held = self.held
        return tensor


@contextlib.contextmanager
def opened(paths: list[str], opener: Any) -> Iterator[dict[str, Any]]:
    """Every file opened (memory-mapped) for the duration: a logical tensor may span two files."""
    with contextlib.ExitStack() as stack:
        yield {path: stack.enter_context(opener(path)) for path in paths}
