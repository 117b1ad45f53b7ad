"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual stream is `hc_mult` streams of
hidden values per token ([T, hc, D]) instead of one.

Before a block (attention or MoE), `HyperConnection` computes from the streams (flattened,
RMS-normed without a weight, one linear `fn` plus `base`, three learned `scale`s) three mixes:
`pre` (sigmoid + eps) collapses the streams into the block's input, `post` (2 x sigmoid) spreads
the block's output back over the streams, and `comb` (softmax + eps, then `hc_sinkhorn_iters`
Sinkhorn-Knopp normalisations towards a doubly-stochastic matrix) mixes the streams into the
residual: streams' = post * out + comb^T @ streams. `HyperHead` collapses the streams once more
(its own pre mix) before the final norm. All of it in float32, as the reference keeps these
modules; the weights are replicated over TP (every rank holds the whole streams).

Deterministic mode (`fixed`): torch's float32 F.linear and sigmoid give a row other bits beside
other rows (the BLAS and the vector tail follow the row count), so `fn` is multiplied on the
ops' packed form (our panel GEMM: a row's product does not follow the rows) and the sigmoids go
through fixed_sum.pointwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import plain, pointwise
from expertmesh.layers.linear_weight import DenseWeight, LinearWeight
from expertmesh.layers.ops import Ops
from expertmesh.layers.weights import default_loader, set_loader


def _param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
    set_loader(p, default_loader)
    return p


def _flat_norm(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, hc, D] -> [T, hc * D] float32, RMS-normed without a weight."""
    flat = streams.reshape(streams.shape[0], -1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class _Mixes(nn.Module):
    """The float32 product of the normed streams with a mix weight: F.linear, or in deterministic
    mode (`fixed`) the ops' packed form and pointwise sigmoids (module docstring)."""

    fixed = False
    pw = staticmethod(plain)
    form: LinearWeight | None = None

    def use_fixed_order(self, fixed: bool) -> None:
        self.fixed = fixed
        self.pw = pointwise if fixed else plain

    def use_ops(self, ops: Ops) -> None:
        if self.fixed:
            self.form = ops.linear_form(self._weight())

    def _weight(self) -> nn.Parameter:
        raise NotImplementedError

    def _mix(self, flat: torch.Tensor) -> torch.Tensor:
        if self.form is None or isinstance(self.form, DenseWeight):
            return F.linear(flat, self._weight())
        return self.form.apply(flat, None, torch.float32)


class HyperConnection(_Mixes):
    def __init__(self, hc: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps
        self.fn = _param((2 + hc) * hc, hc * hidden)
        self.base = _param((2 + hc) * hc)
        self.scale = _param(3)

    def _weight(self) -> nn.Parameter:
        return self.fn

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D] -> post [T, hc], comb [T, hc, hc] (float32) and the block input [T, D]."""
        hc, eps = self.hc, self.hc_eps
        mixes = self._mix(_flat_norm(streams, self.norm_eps))
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = self.pw(torch.sigmoid, pre_w * pre_s + pre_b) + eps
        post = 2 * self.pw(torch.sigmoid, post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * comb_s + comb_b.view(hc, hc), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a block: post * out spread over the streams, plus comb^T @ streams."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class HyperHead(_Mixes):
    """The last collapse of the streams (model.hc_head), before the final norm."""

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = _param(hc, hc * hidden)
        self.hc_base = _param(hc)
        self.hc_scale = _param(1)

    def _weight(self) -> nn.Parameter:
        return self.hc_fn

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = self._mix(_flat_norm(streams, self.norm_eps))
        pre = self.pw(torch.sigmoid, mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
