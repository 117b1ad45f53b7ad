"""bf16 products handed from our panel layout to oneDNN's matmul through torch (AMX CPUs).

Where AMX is usable (cpu_features.onednn_bf16_rows), CpuKernels sends products of many rows here:
the weight is unpacked from its panels for the call (a copy of its bytes, small next to the
products of that many rows) and torch's matmul, i.e. oneDNN with its AMX kernels, does the rest.
Our panels stay the only copy held, so memory does not grow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertmesh.layers.activation import gated, get_act


def unpack(data: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The dense [out, in] weight back from its panels (a copy), for torch's own matmul."""
    if data.dim() == 4:  # pairs [P, in/2, lanes, 2]
        dense = data.permute(0, 2, 1, 3).reshape(-1, data.shape[1] * 2)
    else:  # [P, in, lanes]
        dense = data.transpose(1, 2).reshape(-1, data.shape[1])
    return dense[:out_features, :in_features]


def moe(
    x: torch.Tensor,
    slot: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    inter: int,
    act: str,
) -> torch.Tensor:
    """CpuKernels.moe as torch matmuls per expert, for many tokens: the (token, expert) pairs
    sorted by expert, each expert's weights unpacked for its call, the weighted sum in float32 and
    returned in float32 unrounded (as the kernel does: a partial sum other ranks may add to).
    x [n, H], slot [n, k] int32 (-1: held elsewhere)."""
    n, hidden = x.shape
    k = slot.shape[1]
    flat = slot.flatten().long()  # [n*k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()
    order = order[counts[0] :]  # pairs held elsewhere dropped
    token = order // k
    xs = x.index_select(0, token)  # [m, H]
    ys = torch.empty(xs.shape, dtype=torch.float32)
    fn, start = get_act(act), 0
    for e, count in enumerate(counts[1:]):
        if count:
            h = F.linear(xs[start : start + count], unpack(w13[e], 2 * inter, hidden))
            ys[start : start + count] = F.linear(gated(h, fn), unpack(w2[e], hidden, inter))
            start += count
    ys *= weights.flatten()[order].unsqueeze(1)
    return torch.zeros(n, hidden, dtype=torch.float32).index_add_(0, token, ys)
