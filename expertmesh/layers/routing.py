"""Routers: router logits [n, E] -> (topk_weights [n, k] float32, topk_ids [n, k] int64).

One small function per routing rule, registered by name; a family picks one. `Router` is the
layer: the router linear (its weight, optional bias and selection-only correction bias) and the
rule, with the config's parameters (renormalise, groups, scaling factor, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import plain
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.weights import default_loader, set_loader
from expertmesh.registries import lookup


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, **_: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral (renormalised) and Qwen-MoE (renormalised when norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _masked_softmax_pick(
    scores: torch.Tensor, ref: torch.Tensor, jitter_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick argmax of `scores`; weight = softmax over the logits within the sparsemixer band."""
    top, idx = scores.max(dim=-1, keepdim=True)
    factor = ref.abs().clamp(min=top)
    outside = ((top - ref) / factor) > (2 * jitter_eps)
    gates = torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1)
    return gates.gather(-1, idx), idx


def sparsemixer(
    logits: torch.Tensor, top_k: int, jitter_eps: float, **_: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's eval-mode sparsemixer: hard-wired top-2, weights not renormalised."""
    if top_k != 2:
        raise ValueError(f"PhiMoE's sparsemixer routing is top-2 only; got num_experts_per_tok={top_k}")
    scores = logits.float()
    w1, e1 = _masked_softmax_pick(scores, scores, jitter_eps)
    masked = scores.scatter(-1, e1, float("-inf"))  # expert 2: expert 1 masked out
    w2, e2 = _masked_softmax_pick(masked, scores, jitter_eps)
    return torch.cat((w1, w2), dim=-1), torch.cat((e1, e2), dim=-1)


def topk_softmax(logits: torch.Tensor, top_k: int, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the top-k logits (GPT-OSS, with its router bias; Granite-MoE)."""
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def topk_sigmoid(
    logits: torch.Tensor, top_k: int, pw: Callable = plain, **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid of each selected logit (Llama 4, top-1; its weight scales the expert's input).
    `pw`: fixed_sum.pointwise in deterministic mode (bits independent of the batch size)."""
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    return pw(torch.sigmoid, values), ids


def _keep_groups(
    choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """`choice` [n, E] with the experts outside the `topk_group` best groups set to `fill`."""
    n, e = choice.shape
    keep = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices  # [n, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return choice.masked_fill(~mask.repeat_interleave(e // group_scores.shape[1], dim=1), fill)


def sigmoid_grouped(
    logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    pw: Callable = plain,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores; experts chosen by score + correction bias (the bias picks, never weighs),
    within the `topk_group` best of `n_group` groups (a group scores its two best); weights are
    the chosen sigmoid scores, renormalised when asked, times routed_scaling_factor.
    GLM-4.5 (one group) and DeepSeek-V3 (8 groups, 4 kept)."""
    scores = pw(torch.sigmoid, logits.float())  # [n, E]
    choice = scores + correction_bias.float()
    if n_group > 1:
        n, e = choice.shape
        grouped = choice.view(n, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, n_group]
        choice = _keep_groups(choice, group_scores, topk_group, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def softmax_corrected(
    logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor, scaling: float = 1.0, **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """LongCat-Flash: softmax over every expert (identity ones included); experts chosen by score +
    correction bias (unsorted, as the reference), weighed by the softmax score, never renormalised,
    times routed_scaling_factor."""
    scores = torch.softmax(logits.float(), dim=-1)
    ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1, sorted=False).indices
    return scores.gather(1, ids) * scaling, ids


def sqrtsoftplus(
    logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor, scaling: float = 1.0, **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4: sqrt(softplus(logit)) scores; experts chosen by score + correction bias
    (unsorted, as the reference), weighed by their scores renormalised to sum 1 (the reference
    renormalises whatever norm_topk_prob says; the published configs say true), times
    routed_scaling_factor."""
    scores = F.softplus(logits.float()).sqrt()
    ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling, ids


def _deepseek_v2_weights(
    weights: torch.Tensor, top_k: int, renormalize: bool, scaling: float
) -> torch.Tensor:
    """DeepSeek-V2's rule: renormalised when norm_topk_prob (and k > 1), else times
    routed_scaling_factor. transformers' port always scales and ignores norm_topk_prob; every
    published V2 config has norm_topk_prob false, where the two agree (docs/deepseek.md)."""
    if top_k > 1 and renormalize:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling


def softmax_greedy(
    logits: torch.Tensor, top_k: int, renormalize: bool = False, scaling: float = 1.0, **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 `greedy`: softmax over every expert, the top k taken (unsorted, as the reference
    does, so ties resolve alike)."""
    scores = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)
    return _deepseek_v2_weights(weights, top_k, renormalize, scaling), ids


def softmax_group_limited(
    logits: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    scaling: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 `group_limited_greedy`: softmax scores; a group (n_group of them) scores its best
    expert; the top k are taken within the topk_group best groups (the others scored 0, as the
    reference masks them)."""
    scores = torch.softmax(logits.float(), dim=-1)  # [n, E]
    n, e = scores.shape
    group_scores = scores.view(n, n_group, e // n_group).max(dim=-1).values  # [n, n_group]
    masked = _keep_groups(scores, group_scores, topk_group, 0.0)
    weights, ids = torch.topk(masked, top_k, dim=-1, sorted=False)
    return _deepseek_v2_weights(weights, top_k, renormalize, scaling), ids


ROUTERS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "softmax_topk": softmax_topk,
    "sparsemixer": sparsemixer,
    "topk_softmax": topk_softmax,
    "topk_sigmoid": topk_sigmoid,
    "sigmoid_grouped": sigmoid_grouped,
    "softmax_greedy": softmax_greedy,
    "softmax_group_limited": softmax_group_limited,
    "softmax_corrected": softmax_corrected,
    "sqrtsoftplus": sqrtsoftplus,
}
# Rules whose router linear runs in float32 whatever the model dtype, as the references do (their
# weight, and correction bias, are kept in float32 in bf16 checkpoints too).
FLOAT32_RULES = ("sigmoid_grouped", "softmax_greedy", "softmax_group_limited", "softmax_corrected")
# Rules that take a selection-only correction bias (`e_score_correction_bias`).
CORRECTED_RULES = ("sigmoid_grouped", "softmax_corrected", "sqrtsoftplus")


class Router(ReplicatedLinear):
    """The router linear [E, H] (+ bias) and its rule: x [n, H] -> (weights [n, k], ids [n, k])."""

    quantizable = False  # routing decisions stay in the model dtype (as vLLM keeps its gate)

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        rule: str,
        top_k: int,
        params: dict,
        bias: bool = False,
        dtype=None,
    ) -> None:
        self.fn = lookup(ROUTERS, rule, "router")
        self.fp32 = rule in FLOAT32_RULES
        super().__init__(hidden, num_experts, bias, torch.float32 if self.fp32 else dtype)
        self.rule, self.top_k, self.params = rule, top_k, dict(params)
        self.e_score_correction_bias = None
        if rule in CORRECTED_RULES:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
            set_loader(self.e_score_correction_bias, default_loader)

    pw: Callable = staticmethod(plain)  # deterministic mode: fixed_sum.pointwise (for sigmoids)
    # rules decode_layers computes (cpu/csrc/decode_layers.c), by its renormalize field: softmax_topk
    # (0 or 1: renormalised), topk_softmax (2)
    NATIVE_RULES = ("softmax_topk", "topk_softmax")

    def native_form(self, keep: list) -> dict | None:
        gemm = super().native_form(keep) if self.rule in self.NATIVE_RULES and not self.fp32 else None
        if gemm is None:
            return None
        return dict(
            router_fn=gemm[0], router_w=gemm[1], router_bias=gemm[2], experts=self.out_features,
            top_k=self.top_k,
            renormalize=2 if self.rule == "topk_softmax" else int(bool(self.params.get("renormalize"))),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(x.float() if self.fp32 else x)  # [n, E]
        extra = (
            {} if self.e_score_correction_bias is None else {"correction_bias": self.e_score_correction_bias}
        )
        if self.pw is not plain:
            extra["pw"] = self.pw
        return self.fn(logits, top_k=self.top_k, **self.params, **extra)
