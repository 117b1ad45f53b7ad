"""Routers: router logits [n, E] -> (topk_weights [n, k] float32, topk_ids [n, k] int64).

One small function per family, registered by name; the model picks one at build time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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


ROUTERS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "softmax_topk": softmax_topk,
    "sparsemixer": sparsemixer,
}
