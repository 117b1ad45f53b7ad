"""Zero-compute (identity) experts (LongCat-Flash: 512 real experts plus 256 identity ones, top-12
of the 768): an identity expert's output is the token's input times its routing weight.

The router scores real and identity experts together; `split_identity` then takes the identity
picks out of the selection before any exchange: their weights are summed per token and applied to
the token where it lives (no rank receives a token for an identity expert), and their places in
the [n, k] selection become NO_EXPERT (weight 0), which every all2all backend and the experts
skip. The compute per token thus varies with how many of its picks are real.
"""

from __future__ import annotations

import torch

NO_EXPERT = -1  # a selection place that names no expert: no exchange, no compute


def split_identity(
    weights: torch.Tensor, ids: torch.Tensor, num_real: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [n, k], ids [n, k]) over num_real + identity experts -> (identity weight [n, 1]
    float32: the sum of the token's identity picks, real weights [n, k] with 0 at identity places,
    real ids [n, k] with NO_EXPERT at identity places)."""
    identity = ids >= num_real
    weight = weights.float().masked_fill(~identity, 0.0).sum(dim=-1, keepdim=True)
    return weight, weights.masked_fill(identity, 0.0), ids.masked_fill(identity, NO_EXPERT)


def lookup_picks(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] where ids may hold NO_EXPERT, which stays NO_EXPERT (a plain index would wrap)."""
    picked = table[ids.clamp(min=0)]
    return torch.where(ids >= 0, picked, torch.full_like(picked, NO_EXPERT))
