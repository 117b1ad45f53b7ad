"""Layout-invariant sums: a fixed number of chunks, added by a fixed binary tree.

A sum a layout may split (a row-parallel product over its inner dimension K, an expert's down
projection over its intermediate dimension) is defined, in deterministic mode, as C chunk sums
(C = ``FIXED_CHUNKS``, the largest split supported, fewer when K does not divide) each computed
in float32 by the same kernel on the same shape whatever the layout, then added by the perfect
binary tree over the C chunk sums. A rank of W (W divides C, both powers of two) holds chunks
[r * C / W, (r + 1) * C / W): a whole subtree. It adds its chunks by the tree, and the ranks'
subtree sums are all-gathered in float32 and added by the tree over W (``Group.ordered_sum``),
never by an all-reduce whose internal order is unspecified. One process runs the same C chunks
and the same tree, so every layout gives the same float32 bits, then the same bf16 rounding.
"""

from __future__ import annotations

import torch

FIXED_CHUNKS = 8  # the largest TP (or DP x TP expert-shard) degree whose sums stay layout-invariant


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise sum of 2^n tensors: ((p0 + p1) + (p2 + p3)) + ... (the tree's fixed order)."""
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum takes a power of two of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def chunk_count(total: int, ranks: int, what: str, even: bool = True) -> int:
    """Chunks of a dimension of size `total` (the whole sum's, whatever the layout): the largest
    of 8, 4, 2, 1 that divides it into equal (and, for bf16 pairs, even) widths. `ranks` (the
    split of this layout) must divide it, else this layout cannot reproduce one process's order."""
    for c in (FIXED_CHUNKS, 4, 2, 1):
        if total % c == 0 and (not even or (total // c) % 2 == 0 or c == 1):
            if c % ranks:
                raise ValueError(
                    f"deterministic=True: {what} of {total} sums in {c} fixed chunks, which "
                    f"{ranks} ranks cannot split evenly; use a layout splitting it over {c} ranks or fewer"
                )
            return c
    raise AssertionError("unreachable: 1 always divides")


# torch runs an elementwise function's vectorized body over blocks of twice the vector width and a
# scalar loop over the rest, whose results (sigmoid, softplus, SiLU: another formula) may differ
# in the last bit; and it splits tensors of 32,768 elements or more over threads at boundaries
# that follow the size. So an element's bits could depend on the tensor's size: the batch, or this
# rank's share of the heads. pointwise() pads to whole blocks and runs under the split size.
POINTWISE_PAD = 64  # a multiple of twice any vector width (AVX-512: 32 floats)
POINTWISE_BLOCK = 1 << 14  # elements a call: below torch's per-thread grain (32,768)


def plain(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x): the default path where deterministic mode passes ``pointwise``."""
    return fn(x)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise `fn` (exp, sigmoid, softplus, silu), each element computed by the
    same code path whatever x's shape: flattened, padded to a multiple of POINTWISE_PAD, in
    calls of POINTWISE_BLOCK elements (each one thread's, every element in the vector body)."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % POINTWISE_PAD
    flat = torch.nn.functional.pad(flat, (0, pad)) if pad else flat.contiguous()
    if flat.numel() <= POINTWISE_BLOCK:
        return fn(flat)[:n].view(x.shape)
    out = torch.cat([fn(flat[i : i + POINTWISE_BLOCK]) for i in range(0, flat.numel(), POINTWISE_BLOCK)])
    return out[:n].view(x.shape)
